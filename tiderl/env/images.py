"""PNG images as data URLs, the only image form the environment protocol carries.

An image travels inside a message's content parts (:class:`tiderl.env.protocol.ImagePart`) as
``data:image/png;base64,<PNG bytes in base64>``, the form vLLM's and SGLang's OpenAI chat APIs
take. :func:`decode_png_data_url` is the one check every image passes, on construction and on
decoding alike; it raises :class:`ImageError` (a ``ValueError``) with a one-line reason for:

* a URL that is not ``data:image/png;base64,...`` (no remote URLs: a consumer never fetches);
* base64 that does not decode;
* more than ``MAX_IMAGE_BYTES`` of PNG (checked on the URL's length, before decoding);
* bytes that are not a PNG (signature and ``IHDR`` chunk, its CRC included);
* more than ``MAX_IMAGE_PIXELS`` pixels (width x height from the header: nothing is
  decompressed, so a small file that inflates to a huge image costs nothing).

Only the header is read: a PNG whose later chunks are damaged passes here and fails in the
consumer's image decoder. Pure stdlib; the renderers (Pillow) live with the environments.
"""

from __future__ import annotations

import base64
import binascii
import struct
import zlib

PNG_DATA_URL_PREFIX = "data:image/png;base64,"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MAX_IMAGE_BYTES = 8 << 20  # PNG bytes of one image: a noisy 4K screenshot fits
MAX_IMAGE_PIXELS = 3840 * 2160  # width x height of one image: a 4K screen
_MAX_BASE64_CHARS = 4 * -(-MAX_IMAGE_BYTES // 3)
_IHDR_END = len(PNG_SIGNATURE) + 4 + 4 + 13 + 4  # length, type, the 13 data bytes, CRC


class ImageError(ValueError):
    """An image the protocol does not carry (the message says why, on one line)."""


def png_data_url(png: bytes) -> str:
    """The data URL of PNG bytes; ImageError if they break the rules above."""
    url = PNG_DATA_URL_PREFIX + base64.b64encode(png).decode("ascii")
    decode_png_data_url(url)
    return url


def decode_png_data_url(url: str) -> bytes:
    """The PNG bytes of a data URL, checked (see the module docstring)."""
    if not url.startswith(PNG_DATA_URL_PREFIX):
        raise ImageError(f"image_url: expected a {PNG_DATA_URL_PREFIX}... URL, got "
                         f"{url[:40]!r}")
    data = url[len(PNG_DATA_URL_PREFIX):]
    if len(data) > _MAX_BASE64_CHARS:
        raise ImageError(f"image: about {len(data) * 3 // 4} bytes, more than the limit "
                         f"({MAX_IMAGE_BYTES})")
    try:
        png = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("image_url: malformed base64") from None
    width, height = png_size(png)
    if width * height > MAX_IMAGE_PIXELS:
        raise ImageError(f"image: {width}x{height} = {width * height} pixels, more than the "
                         f"limit ({MAX_IMAGE_PIXELS})")
    return png


def png_size(png: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's header; ImageError if ``png`` is not a PNG."""
    if not png.startswith(PNG_SIGNATURE):
        raise ImageError("image: not a PNG (no PNG signature)")
    if len(png) < _IHDR_END:
        raise ImageError("image: not a PNG (truncated before the end of its header)")
    at = len(PNG_SIGNATURE)
    length, kind = struct.unpack(">I4s", png[at:at + 8])
    body = png[at + 4:at + 8 + 13]  # the type and the 13 data bytes, which the CRC covers
    (crc,) = struct.unpack(">I", png[at + 8 + 13:_IHDR_END])
    if length != 13 or kind != b"IHDR" or zlib.crc32(body) != crc:
        raise ImageError("image: not a PNG (a damaged IHDR header)")
    width, height = struct.unpack(">II", png[at + 8:at + 16])
    if width == 0 or height == 0:
        raise ImageError(f"image: {width}x{height} pixels, an empty image")
    return width, height

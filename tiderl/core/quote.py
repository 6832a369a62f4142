"""Values shown in error messages, cut to a bounded length.

An error names the key and shows what it was given; a value of any size (a 10 MB string in a
profile, a request body) shows as its start, an ellipsis and its length, so that every error
stays one readable line. Every error path quotes values with :func:`short`; the places that
print or send errors (the CLI's printer, the HTTP servers' error bodies) pass the whole line
through :func:`one_line`, the last guard.
"""

from __future__ import annotations

QUOTE_LIMIT = 200  # characters of a quoted value or a key
LINE_LIMIT = 1000  # characters of an error line


def cut(text: str, limit: int = QUOTE_LIMIT) -> str:
    """``text``, or, when longer than ``limit`` characters, its start, an ellipsis and its
    length in ``limit`` characters all told: ``aaaa… (10,000,000 characters)``."""
    return text if len(text) <= limit else _ends(text, f"… ({len(text):,} characters)", limit)


def short(value: object, limit: int = QUOTE_LIMIT) -> str:
    """``repr(value)``, cut as :func:`cut` does; a long string's or bytes' length is its own
    (their whole repr is never made)."""
    if isinstance(value, str | bytes) and len(value) > limit:
        unit = "characters" if isinstance(value, str) else "bytes"
        return _ends(repr(value[:limit]), f"… ({len(value):,} {unit})", limit)
    return cut(repr(value), limit)


def _ends(text: str, suffix: str, limit: int) -> str:
    """The start of ``text`` with ``suffix``, in ``limit`` characters."""
    return text[:max(0, limit - len(suffix))] + suffix


def one_line(message: str, limit: int = LINE_LIMIT) -> str:
    """``message`` on one line (each run of white space one space), cut to ``limit``."""
    return cut(" ".join(message.split()), limit)

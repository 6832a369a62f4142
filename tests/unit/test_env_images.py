"""Image content in the environment protocol, the gui environment and the gymnasium adapter's
image observations, on CPU. The environments defined here are also served by
tests/integration/test_env_images.py."""

from __future__ import annotations

import base64
import io
import re
import struct
import zlib
from collections.abc import Callable

import msgspec
import numpy as np
import pytest
from PIL import Image

from tiderl.env.base import Environment, StepResult, observation_text
from tiderl.env.gui import HEIGHT, WIDTH, GuiEnv, parse_action, render
from tiderl.env.images import (
    MAX_IMAGE_BYTES,
    MAX_IMAGE_PIXELS,
    PNG_DATA_URL_PREFIX,
    PNG_SIGNATURE,
    ImageError,
)
from tiderl.env.protocol import (
    MAX_IMAGES_PER_MESSAGE,
    ImagePart,
    ImageURL,
    Message,
    ObservationResponse,
    TextPart,
    image_part,
    messages_text,
)
from tiderl.env.registry import make_env

try:
    import gymnasium
except ImportError:  # the gym tests skip
    gymnasium = None


def solid_png(width: int, height: int, color: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, format="PNG")
    return out.getvalue()


def png_header(width: int, height: int) -> bytes:
    """A PNG signature and a valid IHDR chunk for width x height (no image data after it)."""
    body = b"IHDR" + struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return PNG_SIGNATURE + struct.pack(">I", 13) + body + struct.pack(">I", zlib.crc32(body))


def jpeg_bytes() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 8)).save(out, format="JPEG")
    return out.getvalue()


def decoded(png: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(png))
    image.load()
    return image


# -- a stand-in for an environment with bad screenshots (served in the integration tests) ------

def data_url(png: bytes) -> str:
    return PNG_DATA_URL_PREFIX + base64.b64encode(png).decode()


# the image URLs of each bad picture (built without the checks), and what its one-line error says
BAD_URLS: dict[str, Callable[[], list[str]]] = {
    "url": lambda: ["https://example.com/screen.png"],
    "base64": lambda: [PNG_DATA_URL_PREFIX + "!!not base64!!"],
    "jpeg": lambda: [data_url(jpeg_bytes())],
    "header": lambda: [data_url(PNG_SIGNATURE + bytes(40))],
    "pixels": lambda: [data_url(png_header(4000, 3000))],
    "bytes": lambda: [data_url(png_header(8, 8) + bytes(MAX_IMAGE_BYTES))],
    "many": lambda: [data_url(solid_png(4, 4))] * (MAX_IMAGES_PER_MESSAGE + 1),
}
BAD_PICTURES = {
    "url": "expected a data:image/png;base64,... URL",
    "base64": "malformed base64",
    "jpeg": "not a PNG (no PNG signature)",
    "header": "not a PNG (a damaged IHDR header)",
    "pixels": f"4000x3000 = 12000000 pixels, more than the limit ({MAX_IMAGE_PIXELS})",
    "bytes": f"more than the limit ({MAX_IMAGE_BYTES})",
    "many": f"{MAX_IMAGES_PER_MESSAGE + 1} images in one message",
}


def picture(name: str) -> Message:
    """The message showing picture ``name``: "ok" (a valid one) or one of ``BAD_URLS``."""
    if name == "ok":
        return Message(role="user", content=[image_part(solid_png(28, 28)), TextPart("red")])
    return Message(role="user", content=[ImagePart(ImageURL(url)) for url in BAD_URLS[name]()])


class PictureEnv(Environment):
    """Shows the picture each action (or the task) names: "ok" is a valid one, the others
    break one rule of tiderl.env.images each."""

    name = "picture"
    is_word_level = False

    def reset(self, task: str | None, seed: int) -> tuple[list[Message], dict]:
        return [picture(task or "ok")], {}

    def step(self, action: str) -> StepResult:
        name = action.strip()
        if name != "ok" and name not in BAD_URLS:
            return StepResult(f"no picture {name!r}", 0.0, False, {})
        return StepResult([picture(name)], 0.0, False, {})


# -- the protocol ------------------------------------------------------------------------------

def test_a_string_content_is_on_the_wire_exactly_as_before():
    message = Message(role="user", content="higher . 17 turns left .")
    assert msgspec.json.encode(message) == b'{"role":"user","content":"higher . 17 turns left ."}'
    assert msgspec.json.decode(msgspec.json.encode(message), type=Message) == message
    assert message.text() == "higher . 17 turns left ." and message.images() == []
    assert message.num_images == 0


def test_content_parts_round_trip_in_the_openai_shape():
    red, blue = solid_png(28, 28), solid_png(56, 28, (30, 30, 200))
    message = Message(role="user", content=[image_part(red), TextPart("Click red."),
                                            image_part(blue), TextPart("Then blue.")])
    wire = msgspec.json.decode(msgspec.json.encode(message))["content"]
    assert wire[0] == {"type": "image_url", "image_url": {"url": data_url(red)}}
    assert wire[1] == {"type": "text", "text": "Click red."}
    back = msgspec.json.decode(msgspec.json.encode(message), type=Message)
    assert back == message
    assert back.images() == [red, blue] and back.num_images == 2
    assert back.text() == "<image>\nClick red.\n<image>\nThen blue."
    assert back.text(image_marker="") == "Click red.\nThen blue."
    assert messages_text([Message(role="system", content="rules"), back]).startswith(
        "rules\n<image>\nClick red.")


def test_openai_extras_are_read_and_unknown_part_types_refused():
    png = solid_png(4, 4)
    body = {"role": "user", "content": [{"type": "image_url",
                                         "image_url": {"url": data_url(png), "detail": "high"}}]}
    assert msgspec.json.decode(msgspec.json.encode(body), type=Message).images() == [png]
    with pytest.raises(msgspec.ValidationError, match="Invalid value 'video'"):
        msgspec.json.decode(b'{"role": "user", "content": [{"type": "video"}]}', type=Message)
    with pytest.raises(TypeError, match="TextPart and ImagePart"):
        Message(role="user", content=[{"type": "text", "text": "a dict, not a part"}])


@pytest.mark.parametrize("name", sorted(BAD_PICTURES))
def test_each_bad_image_is_refused_when_built_and_when_decoded(name):
    with pytest.raises(ImageError, match=re.escape(BAD_PICTURES[name])):
        picture(name)
    content = [{"type": "image_url", "image_url": {"url": url}} for url in BAD_URLS[name]()]
    body = {"observation": "x", "reward": 0.0, "done": False,
            "messages": [{"role": "user", "content": content}]}
    with pytest.raises(msgspec.ValidationError) as info:  # a client decoding an answer
        msgspec.json.decode(msgspec.json.encode(body), type=ObservationResponse)
    assert BAD_PICTURES[name] in str(info.value) and "\n" not in str(info.value)
    assert "$.messages[0]" in str(info.value)


def test_the_limits_admit_a_4k_screenshot_header_and_refuse_one_pixel_more():
    assert image_part(png_header(3840, 2160)).png == png_header(3840, 2160)
    with pytest.raises(ImageError, match="pixels"):
        image_part(png_header(3840, 2161))


# -- the gui environment -----------------------------------------------------------------------

def play_solver(env: GuiEnv, task: str | None, seed: int) -> StepResult:
    env.reset(task, seed)
    while True:
        result = env.step(env.solve())
        if result.done:
            return result


def test_gui_observation_is_a_screenshot_and_an_instruction():
    env = GuiEnv()
    (system, user), info = env.reset("click 3", seed=5)
    assert system.role == "system" and "click(x, y)" in system.content
    assert [type(part) for part in user.content] == [ImagePart, TextPart]
    (png,) = user.images()
    image = decoded(png)
    assert (image.format, image.size, image.mode) == ("PNG", (WIDTH, HEIGHT), "RGB")
    assert (WIDTH % 28, HEIGHT % 28) == (0, 0)
    assert user.text().startswith("<image>\nClick the ") and "in this order" in user.text()
    assert info == {"kind": "click", "num_checks": 3, "width": WIDTH, "height": HEIGHT}
    assert observation_text([system, user]) == f"{system.content}\n{user.text()}"


def test_gui_is_deterministic_per_task_and_seed():
    def transcript(seed: int) -> list[Message]:
        env = GuiEnv()
        opening, _ = env.reset("form 2", seed)
        messages = list(opening)
        while True:
            result = env.step(env.solve())
            messages += result.observation
            if result.done:
                return messages
    assert transcript(3) == transcript(3)
    assert transcript(3)[1].images() != transcript(4)[1].images()


@pytest.mark.parametrize("task", ["click 1", "click 4", "form 1", "form 4", None])
def test_gui_solver_gets_full_reward(task):
    for seed in range(30):
        result = play_solver(GuiEnv(), task, seed)
        assert result.reward == 1.0 and result.info["submitted"], (task, seed)
        assert result.info["turns"] <= 7


def test_gui_click_out_of_order_earns_the_positions_that_match():
    env = GuiEnv()
    env.reset("click 3", seed=11)
    first, second, third = env.screen.asked
    centers = {w.color: w.center for w in env.screen.widgets if w.kind == "button"}
    for color in (first, third, second):
        env.step("click({}, {})".format(*centers[color]))
    ok = next(w for w in env.screen.widgets if w.kind == "ok")
    result = env.step("I am done: click({}, {})".format(*ok.center))
    assert result.done and result.reward == pytest.approx(1 / 3)
    assert (result.info["checks_passed"], result.info["num_checks"]) == (1, 3)
    assert "1 of 3 checks passed" in result.observation[0].text()


def test_gui_form_wrong_word_and_an_extra_box_score_partially():
    env = GuiEnv(max_turns=12)
    env.reset("form 2", seed=2)
    screen = env.screen
    field = next(w for w in screen.widgets if w.kind == "field")
    boxes = {w.color: w for w in screen.widgets if w.kind == "checkbox"}
    assert "no text field has focus" in env.step('type("x")').observation[0].text().lower()
    env.step("click({}, {})".format(*field.center))
    assert 'reads "wrong"' in env.step('type("wrong")').observation[0].text()
    extra = next(color for color in boxes if color not in screen.asked)
    for color in [*screen.asked, extra]:
        env.step("click({}, {})".format(*boxes[color].center))
    ok = next(w for w in screen.widgets if w.kind == "ok")
    result = env.step("click({}, {})".format(*ok.center))
    assert result.done and result.reward == pytest.approx((2 - 1) / 3)


def test_gui_turn_cap_scores_what_the_screen_passes():
    env = GuiEnv(max_turns=2)
    env.reset("click 2", seed=1)
    env.step(env.solve())  # the first asked button
    result = env.step("click(0, 0)")
    assert result.done and result.info["truncated"] and result.reward == 0.5
    assert "No turns left" in result.observation[0].text()
    assert env.step("click(1, 1)").done


def test_gui_tells_what_went_wrong_and_never_raises():
    env = GuiEnv()
    env.reset("click 1", seed=0)
    texts = [env.step(action).observation[0].text() for action in
             ("look around", "click(0, 0)", 'type("abc")', "click(99999, 5)")]
    assert "No action found" in texts[0] and "Nothing there at (0, 0)" in texts[1]
    assert "no text field" in texts[2] and "Nothing there" in texts[3]
    env.reset("form 1", seed=0)
    field = next(w for w in env.screen.widgets if w.kind == "field")
    env.step("click({}, {})".format(*field.center))
    assert "at most 12 printable ASCII" in env.step('type("caf\u00e9")').observation[0].text()
    assert "at most 12" in env.step(f'type("{"a" * 13}")').observation[0].text()


def test_parse_action_reads_the_first_action_anywhere_in_the_text():
    assert parse_action("click(3, 4)") == ("click", (3, 4))
    assert parse_action("The red one. CLICK ( 30 ,40 ) then type('x')") == ("click", (30, 40))
    assert parse_action('type("say \\"hi\\"") click(1, 2)') == ("type", 'say "hi"')
    assert parse_action("type('a\\\\b')") == ("type", "a\\b")
    assert parse_action("click(-1, 2)") is None and parse_action("nothing") is None


def test_gui_renders_the_same_bytes_for_the_same_screen():
    """(Its speed is measured in bench/env_server.py, ``gui_render_ms``.)"""
    env = GuiEnv()
    env.reset("form 4", seed=9)
    assert render(env.screen) == render(env.screen)


# -- the gymnasium adapter on image observations (the envs below fake a user's pixel env) ------

COLORS = {"red": (220, 40, 40), "blue": (40, 90, 220)}

if gymnasium is not None:

    class ColorSquareEnv(gymnasium.Env):
        """A 28 x 56 picture in one color; say the color to win. ``with_text``: a Dict
        observation, the picture under "image" and the instruction under "text"."""

        def __init__(self, with_text: bool = False, image_dtype: type = np.uint8):
            self.with_text = with_text
            self.image_dtype = image_dtype
            image = gymnasium.spaces.Box(0, 255, (28, 56, 3), np.uint8)
            self.observation_space = gymnasium.spaces.Dict({
                "image": image, "text": gymnasium.spaces.Text(max_length=64)}) \
                if with_text else image
            self.action_space = gymnasium.spaces.Text(max_length=64)
            self.color = "red"

        def _observation(self):
            picture = np.zeros((28, 56, 3), self.image_dtype)
            picture[:] = COLORS[self.color]
            if not self.with_text:
                return picture
            return {"image": picture, "text": "say the color"}

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            self.color = sorted(COLORS)[int(self.np_random.integers(len(COLORS)))]
            return self._observation(), {"color": self.color}

        def step(self, action):
            won = self.color in action
            return self._observation(), float(won), won, False, {}


def make_pixel_env():
    return ColorSquareEnv()


def make_pixel_text_env():
    return ColorSquareEnv(with_text=True)


def make_float_image_env():
    return ColorSquareEnv(with_text=True, image_dtype=np.float32)


needs_gym = pytest.mark.skipif(gymnasium is None, reason="gymnasium not installed")


@needs_gym
def test_gym_box_image_observation_becomes_an_image_part():
    env = make_env("gym:tests.unit.test_env_images:make_pixel_env", max_turns=3)
    (message,), info = env.reset(None, seed=1)
    assert message.role == "user" and message.text() == "<image>"
    picture = np.asarray(decoded(message.images()[0]))
    assert picture.shape == (28, 56, 3) and (picture == COLORS[info["color"]]).all()
    result = env.step(f"it is {info['color']}")
    assert result.done and result.reward == 1.0 and result.observation[0].num_images == 1


@needs_gym
def test_gym_dict_observation_gives_the_image_then_the_text():
    env = make_env("gym:tests.unit.test_env_images:make_pixel_text_env")
    (message,), _ = env.reset(None, seed=1)
    assert [type(part) for part in message.content] == [ImagePart, TextPart]
    assert message.text() == "<image>\nsay the color"
    assert decoded(message.images()[0]).size == (56, 28)


@needs_gym
def test_gym_image_key_without_a_uint8_rgb_array_is_an_image_error():
    env = make_env("gym:tests.unit.test_env_images:make_float_image_env")
    with pytest.raises(ImageError, match=r"observation\['image'\]: expected a uint8 array"):
        env.reset(None, seed=1)

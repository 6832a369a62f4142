"""Image observations over the real `tiderl env serve`: the gui environment's screenshots, bad
images an environment produces (each a one-line 4xx, the server serving on), and a gymnasium
env with image observations served as `gym`. The served test environments live in
tests/unit/test_env_images.py."""

import io
from pathlib import Path

import httpx
import pytest
from PIL import Image

from tests.integration.serving import env_serving, run_env_scenario
from tests.unit.test_env_images import BAD_PICTURES, COLORS, gymnasium
from tiderl.env.gui import HEIGHT, WIDTH, GuiEnv
from tiderl.env.images import PNG_DATA_URL_PREFIX
from tiderl.env.protocol import ImagePart, TextPart

ROOT = Path(__file__).resolve().parents[2]
PICTURE = "tests.unit.test_env_images:PictureEnv"
PIXELS = "tests.unit.test_env_images:make_pixel_env"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    gym = ["--gym", PIXELS] if gymnasium is not None else []
    with env_serving(tmp_path_factory.mktemp("env-images"), f"gui,{PICTURE}", "--max-sessions",
                     "8", *gym, env={"PYTHONPATH": str(ROOT)}) as served:
        yield served


def run(server, scenario):
    return run_env_scenario(server["url"], scenario)


def size_of(png: bytes) -> tuple[int, int]:
    return Image.open(io.BytesIO(png)).size


def test_gui_start_sends_a_png_screenshot_of_the_stated_size(server):
    raw = httpx.post(server["url"] + "/start", json={"env": "gui", "task": "click 3", "seed": 5},
                     timeout=10).json()
    httpx.post(server["url"] + "/end", json={"session": raw["session"]}, timeout=10)
    image, text = raw["messages"][1]["content"]
    assert image["type"] == "image_url" and image["image_url"]["url"].startswith(
        PNG_DATA_URL_PREFIX)
    assert text["type"] == "text" and text["text"].startswith("Click the ")
    assert set(raw["messages"][0]) == {"role", "content"}  # the system message: a string
    assert "<image>\nClick the " in raw["observation"]
    assert (raw["info"]["width"], raw["info"]["height"]) == (WIDTH, HEIGHT)

    async def scenario(client):
        first = await client.start("gui", "click 3", seed=5)
        again = await client.start("gui", "click 3", seed=5)
        other = await client.start("gui", "click 3", seed=6)
        for started in (first, again, other):
            await client.end(started.session)
        return first, again, other

    first, again, other = run(server, scenario)
    (png,) = first.messages[1].images()
    assert size_of(png) == (WIDTH, HEIGHT)
    assert first.messages == again.messages and first.observation == again.observation
    assert other.messages[1].images() != [png]


@pytest.mark.parametrize("task", ["click 3", "form 3"])
def test_gui_scripted_episode_gets_full_reward_in_lockstep_with_a_local_copy(server, task):
    async def scenario(client):
        local = GuiEnv()
        opening, info = local.reset(task, 8)
        started = await client.start("gui", task, seed=8)
        assert (started.messages, started.info) == (opening, info)
        while True:
            action = local.solve()
            expected = local.step(action)
            out = await client.step(started.session, action)
            assert (out.messages, out.reward, out.done) == (
                expected.observation, expected.reward, expected.done)
            assert [type(p) for p in out.messages[0].content] == [ImagePart, TextPart]
            if out.done:
                await client.end(started.session)
                return out

    out = run(server, scenario)
    assert out.reward == 1.0 and out.info["submitted"] and out.info["turns"] <= 7


def test_gui_wrong_episode_gets_partial_reward(server):
    async def scenario(client):
        local = GuiEnv()
        local.reset("click 3", 4)
        first, second, third = local.screen.asked
        centers = {w.color: w.center for w in local.screen.widgets if w.color}
        ok = next(w for w in local.screen.widgets if w.kind == "ok").center
        started = await client.start("gui", "click 3", seed=4)
        for color in (first, third, second):
            await client.step(started.session, "click({}, {})".format(*centers[color]))
        out = await client.step(started.session, "click({}, {})".format(*ok))
        await client.end(started.session)
        return out

    out = run(server, scenario)
    assert out.done and out.reward == pytest.approx(1 / 3)
    assert "1 of 3 checks passed" in out.observation


def post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(server["url"] + route, json=body, timeout=30)


@pytest.mark.parametrize("name", sorted(BAD_PICTURES))
def test_each_bad_image_is_a_one_line_4xx_and_the_server_serves_on(server, name):
    session = post(server, "/start", {"env": PICTURE, "task": "ok"}).json()["session"]
    response = post(server, "/observation", {"session": session, "action": name})
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_observation" and "\n" not in error["message"]
    assert BAD_PICTURES[name] in error["message"]
    good = post(server, "/observation", {"session": session, "action": "ok"})
    assert good.status_code == 200
    assert good.json()["messages"][0]["content"][0]["type"] == "image_url"
    post(server, "/end", {"session": session})
    refused = post(server, "/start", {"env": PICTURE, "task": name})
    assert refused.status_code == 422 and BAD_PICTURES[name] in refused.json()["error"][
        "message"]


@pytest.mark.skipif(gymnasium is None, reason="gymnasium not installed")
def test_a_gym_env_with_image_observations_is_served_as_gym(server):
    async def scenario(client):
        started = await client.start("gym", None, seed=2)
        won = await client.step(started.session, f"it is {started.info['color']}")
        return started, won

    started, won = run(server, scenario)
    (message,) = started.messages
    (png,) = message.images()
    assert size_of(png) == (56, 28) and started.observation == "<image>"
    pixel = Image.open(io.BytesIO(png)).convert("RGB").getpixel((3, 3))
    assert pixel == COLORS[started.info["color"]]
    assert won.done and won.reward == 1.0


def test_server_is_alive_after_all_of_it(server):
    assert server["proc"].poll() is None
    assert httpx.get(server["url"] + "/health", timeout=5).json()["status"] == "ok"
    assert "Traceback" not in server["log"].read_text()

"""Built-in environments, the latency model and the gymnasium adapter, all on CPU and seeded."""

import math
import random
import statistics
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiderl.env.base import Environment, StepResult, UnknownEnvironment, observation_text
from tiderl.env.config import LatencyConfig
from tiderl.env.guess import GuessEnv, parse_range
from tiderl.env.latency import LatencyModel
from tiderl.env.registry import ENV_NAMES, make_env
from tiderl.models.tokenizer import word_tokenizer
from tiderl.models.vocab import UNK

try:
    import gymnasium
except ImportError:  # the gym tests skip; the error test still runs
    gymnasium = None

SEEDS = range(200)


def play(env: Environment, task: str | None, seed: int) -> tuple[list[str], StepResult]:
    """Run the scripted solver to the end; return every text seen and the last result."""
    observation, _ = env.reset(task, seed)
    texts = [observation_text(observation)]
    while True:
        action = env.solve()
        result = env.step(action)
        texts += [action, observation_text(result.observation)]
        if result.done:
            return texts, result


@pytest.mark.parametrize("name", ENV_NAMES)
def test_scripted_solver_wins_within_the_cap(name):
    turns = []
    for seed in SEEDS:
        env = make_env(name, max_turns=20)
        _, result = play(env, None, seed)
        assert result.reward == 1.0, (name, seed)
        turns.append(result.info["turns"])
    assert max(turns) <= 20


def test_household_solver_needs_more_turns_in_bigger_layouts():
    turns = {play(make_env("household"), None, seed)[1].info["turns"] for seed in SEEDS}
    assert min(turns) <= 5 and max(turns) >= 12


@pytest.mark.parametrize("name", ENV_NAMES)
def test_same_task_and_seed_give_the_same_episode(name):
    for seed in (0, 7, 123):
        a, b = play(make_env(name), "task 3 60", seed), play(make_env(name), "task 3 60", seed)
        assert a[0] == b[0]
    transcripts = {tuple(play(make_env(name), None, seed)[0]) for seed in range(20)}
    assert len(transcripts) > 1


WORD_LEVEL = [name for name in ENV_NAMES if make_env(name).is_word_level]


def test_only_the_tool_calling_and_gui_environments_are_meant_for_a_byte_level_tokenizer():
    assert set(ENV_NAMES) - set(WORD_LEVEL) == {"calc", "gui"}


@pytest.mark.parametrize("name", WORD_LEVEL)
def test_every_observation_and_action_tokenizes_without_unk(name):
    tokenizer = word_tokenizer()
    for seed in SEEDS:
        texts, _ = play(make_env(name), None, seed)
        for text in texts:
            assert UNK not in tokenizer.encode(text).tokens, (name, seed, text)


@pytest.mark.parametrize("name", ENV_NAMES)
def test_turn_cap_ends_the_episode_with_zero_reward(name):
    env = make_env(name, max_turns=3)
    env.reset(None, 1)
    results = [env.step("look around") for _ in range(3)]
    assert [r.done for r in results] == [False, False, True]
    assert results[-1].reward == 0.0
    after = env.step("guess 5")
    assert after.done and after.reward == 0.0


@pytest.mark.parametrize("name", ENV_NAMES)
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 10_000), actions=st.lists(st.text(max_size=60), max_size=25))
def test_arbitrary_actions_never_crash(name, seed, actions):
    env = make_env(name, max_turns=20)
    env.reset(None, seed)
    for action in actions:
        result = env.step(action)
        assert isinstance(observation_text(result.observation), str)
        assert 0.0 <= result.reward <= 1.0
        if result.done:
            break


def test_guess_parses_leniently_and_gives_feedback():
    env = GuessEnv()
    env.reset("between 1 and 10", seed=3)
    target = env.target
    assert 1 <= target <= 10
    assert "invalid" in env.step("no idea").observation
    assert env.step(f"is it {target - 1}?").observation.startswith("higher") or target == 1
    assert env.step(f"guess {target}").reward == 1.0
    assert parse_range(None) == (1, 100) and parse_range("50") == (1, 50)
    assert parse_range("range 500 to 20") == (20, 500) and parse_range("1 5000") == (1, 1000)


def test_guess_discount():
    env = GuessEnv(discount=0.5)
    env.reset("1 100", seed=0)
    env.step("guess 1000" if env.target != 1000 else "guess 1")
    assert env.step(f"guess {env.target}").reward == 0.5


def test_guess_partial_credit_grades_the_closest_guess_of_a_lost_episode():
    env = make_env("guess", max_turns=2, options={"partial_credit": 0.5})
    env.reset("1 4", seed=3)
    far, near = env.target + 500, env.target + 2
    assert env.step(f"guess {near}").reward == 0.0  # not over yet
    lost = env.step(f"guess {far}")
    assert lost.done and lost.reward == pytest.approx(0.5 * (1 - math.log(3) / math.log(1001)))
    env.reset("1 4", seed=3)
    assert env.step("no number").reward == 0.0
    assert env.step("nothing").reward == 0.0  # no numeric guess: no partial credit
    env.reset("1 4", seed=3)
    assert env.step(f"guess {env.target}").reward == 1.0  # found beats any partial
    with pytest.raises(UnknownEnvironment, match="bad options"):
        make_env("guess", options={"partial": 0.5})
    with pytest.raises(ValueError, match="partial_credit"):
        GuessEnv(partial_credit=1.0)


def test_random_guesser_has_a_heavy_tail():
    """A uniformly random guesser's turn count: p90 at least twice the median."""
    turns = []
    for seed in range(300):
        env, rng = GuessEnv(max_turns=1000), random.Random(-1 - seed)
        env.reset(None, seed)
        while not env.step(f"guess {rng.randint(1, 100)}").done:
            pass
        turns.append(env.turns)
    deciles = statistics.quantiles(turns, n=10)
    assert deciles[8] >= 2 * statistics.median(turns)


def test_shop_pages_are_long_and_partial_purchases_score_partially():
    env = make_env("shop")
    env.reset(None, 5)
    page = env.step(env.solve()).observation
    assert len(page.split()) > 150
    env.step(env.solve())  # the item page of a fitting item
    result = env.step("buy")  # no color or size chosen
    assert result.done and result.reward == pytest.approx(3 / 5)


def test_household_rejects_impossible_actions():
    env = make_env("household")
    env.reset(None, 2)
    for action in ("take mug from cabinet 1", "put apple in fridge", "open nothing", "fly"):
        assert env.step(action).observation.startswith("nothing happens")
    assert "nothing" in env.step("inventory").observation


def test_make_env_rejects_unknown_names():
    with pytest.raises(UnknownEnvironment):
        make_env("chess")
    with pytest.raises(UnknownEnvironment):
        make_env("tiderl.env.latency:LatencyModel")  # not an Environment
    assert isinstance(make_env("tiderl.env.guess:GuessEnv", max_turns=5), GuessEnv)


@pytest.mark.parametrize(("kind", "median"), [("none", 0.0), ("fixed", 0.2), ("lognormal", 0.5)])
def test_latency_model_median(kind, median):
    config = LatencyConfig(kind=kind, median_s=median, sigma=1.0 if kind == "lognormal" else 0.0)
    model = LatencyModel(config, random.Random(0))
    samples = [model.sample() for _ in range(4000)]
    assert min(samples) >= 0.0
    assert statistics.median(samples) == pytest.approx(median, rel=0.08)
    if kind == "lognormal":
        assert statistics.quantiles(samples, n=10)[8] > 3 * median  # exp(1.28) ≈ 3.6


# -- gymnasium adapter (the test env below is a fake of a user's text env) ----------------------

if gymnasium is not None:

    class EchoWordEnv(gymnasium.Env):
        """Say the secret word to win; every other action is told "no"."""

        def __init__(self):
            self.observation_space = gymnasium.spaces.Text(max_length=200)
            self.action_space = gymnasium.spaces.Text(max_length=200)
            self.word = ""

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            self.word = (options or {}).get("task") or ("red", "blue")[self.np_random.integers(2)]
            return f"say the word {self.word}", {"word": self.word, "array": object()}

        def step(self, action):
            won = self.word in action
            return ("yes" if won else "no"), float(won), won, False, {}

    gymnasium.register("TideRLTestEcho-v0", entry_point=EchoWordEnv)


def make_echo_env():
    return EchoWordEnv()


@pytest.mark.skipif(gymnasium is None, reason="gymnasium not installed")
@pytest.mark.parametrize(
    "spec", ["gym:TideRLTestEcho-v0", "gym:tests.unit.test_envs:make_echo_env"])
def test_gym_adapter_contract(spec):
    env = make_env(spec, max_turns=3)
    observation, info = env.reset(None, seed=4)
    assert observation == f"say the word {info['word']}" and "array" not in info
    assert env.reset(None, seed=4)[0] == observation
    assert env.reset("green", seed=4)[0] == "say the word green"
    miss = env.step("purple")
    assert (miss.observation, miss.reward, miss.done) == ("no", 0.0, False)
    win = env.step("green!")
    assert (win.reward, win.done, win.info["terminated"]) == (1.0, True, True)
    env.reset("green", seed=0)
    results = [env.step("nope") for _ in range(3)]
    assert results[-1].done and results[-1].info["truncated"]


def test_gym_without_gymnasium_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "gymnasium", None)
    with pytest.raises(UnknownEnvironment, match="pip install gymnasium"):
        make_env("gym:TideRLTestEcho-v0")

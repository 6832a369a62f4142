"""Synthetic agentic-RL workloads: per-task turn plans drawn to match the paper's Table 4.

A :class:`WorkloadSampler` turns (seed, group id, step) into a GRPO group of :class:`TaskPlan`s.
Each plan lists its turns: the tokens appended to the context before the turn, the tokens the model
generates, the environment time after the action and, for multimodal tasks, how much of the
context keeps valid KV after the screenshot sliding window pruned old images.

Model (numbers and sources in ``docs/simulator-workloads.md``):

    mean rounds R(p), mean tokens T(p)      linear in progress p = step / total_steps (Table 4)
    latent turns X ~ lognormal(median m)    m solved so that E[min(ceil X, limit)] = R(p)
    turns = min(ceil X, max_turns)          a task cut by max_turns or the context cap is unfinished
    per turn: obs ~ O · lognormal, action ~ A · lognormal (mean-one multipliers)
    O solved so that E[trajectory tokens] = T(p)

Determinism: a group's plans are a function of (seed, workload, group id, step, is_eval) only, so
two policies simulated with the same seed see identical task streams in any order.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace

from tiderl.core.config import ConfigError, require, require_int, require_positive
from tiderl.core.quote import short
from tiderl.core.segments import ImageWindow
from tiderl.core.step_control import task_id

MIN_OBS_TOKENS = 8.0  # floor for the solved mean observation size (a bare "OK" plus chat markup)


def screenshot_tokens(width: int, height: int, patch: int = 16, merge: int = 2) -> int:
    """LLM tokens of one image in Qwen-VL tokenization (Qwen3-VL: 16 px patches, 2x2 merge).

    smart_resize rounds each side to the nearest multiple of patch*merge; every merged patch is one
    token, plus <|vision_start|> and <|vision_end|>. 1280x720 -> 1280x704 -> 40*22 + 2 = 882.
    """
    factor = patch * merge
    cols = max(1, round(width / factor))
    rows = max(1, round(height / factor))
    return cols * rows + 2


SCREENSHOT_TOKENS = screenshot_tokens(1280, 720)


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """One environment's trajectory statistics and latencies (docs/simulator-workloads.md)."""

    name: str
    rounds: tuple[float, float]  # mean turns at training start -> end (Table 4)
    tokens: tuple[float, float]  # mean trajectory tokens start -> end (Table 4)
    prompt_tokens: int  # shared GRPO-group prompt (system + instruction [+ first text page])
    action_tokens: float  # mean generated tokens per turn
    max_turns: int  # App. C: 20 text, 50 multimodal
    context_cap: int  # App. C: 8192 text; multimodal: assumption
    env_step_s: tuple[float, float]  # lognormal (median, sigma) per step, calibration §7
    env_reset_s: tuple[float, float]  # lognormal (median, sigma) for a reset, calibration §7
    image_tokens: int = 0  # per screenshot; 0 = text-only
    image_window: ImageWindow = field(default_factory=ImageWindow)  # screenshots: (10, 5)
    turn_sigma: float = 0.7  # lognormal sigma of the latent turn count
    group_share: float = 0.5  # share of the turn-count log-variance common to a group
    obs_sigma: float = 0.5  # lognormal sigma of per-turn observation text
    action_sigma: float = 0.4  # lognormal sigma of per-turn generated tokens
    reset_timeout_s: float = 300.0  # a reset draw is clipped here (OSWorld polls 300 s)
    reset_retry_p: float = 0.0  # chance that a reset fails once and is redone
    max_new_tokens: int = 256  # the engine's generation cap of one turn (an action is cut there)

    def __post_init__(self) -> None:
        for key in ("prompt_tokens", "action_tokens", "turn_sigma", "reset_timeout_s",
                    "max_new_tokens"):
            require_positive(getattr(self, key), key)
        for key in ("tokens", "env_step_s", "env_reset_s"):
            require(min(getattr(self, key)) > 0, key, f"expected positive numbers, got "
                    f"{short(getattr(self, key))}")
        require_int(self.max_turns, "max_turns", 1)
        require(self.prompt_tokens < self.context_cap // 2, "context_cap",
                f"expected more than twice prompt_tokens, got {short(self.context_cap)}")
        require(all(1.0 <= r < self.max_turns for r in self.rounds), "rounds",
                f"expected means in [1, max_turns), got {short(self.rounds)}")
        require(0.0 <= self.group_share < 1.0, "group_share", "expected a number in [0, 1)")

    @property
    def is_multimodal(self) -> bool:
        return self.image_tokens > 0

    def rounds_at(self, progress: float) -> float:
        return _lerp(self.rounds, progress)

    def tokens_at(self, progress: float) -> float:
        return _lerp(self.tokens, progress)


def _lerp(pair: tuple[float, float], progress: float) -> float:
    p = min(1.0, max(0.0, progress))
    return pair[0] + (pair[1] - pair[0]) * p


WORKLOADS: dict[str, WorkloadSpec] = {
    spec.name: spec
    for spec in (
        WorkloadSpec("webshop", rounds=(8, 5), tokens=(3400, 2400), prompt_tokens=500,
                     action_tokens=60, max_turns=20, context_cap=8192,
                     env_step_s=(0.2, 0.6), env_reset_s=(0.2, 0.6)),
        WorkloadSpec("alfworld", rounds=(16, 11), tokens=(7400, 7400), prompt_tokens=800,
                     action_tokens=80, max_turns=20, context_cap=8192,
                     env_step_s=(0.08, 0.6), env_reset_s=(0.5, 0.6), turn_sigma=0.6,
                     obs_sigma=0.3, action_sigma=0.3),
        WorkloadSpec("osworld", rounds=(35, 15), tokens=(12000, 12000), prompt_tokens=1200,
                     action_tokens=100, max_turns=50, context_cap=32768,
                     env_step_s=(3.0, 0.5), env_reset_s=(45.0, 0.7),
                     image_tokens=SCREENSHOT_TOKENS, image_window=ImageWindow(10, 5),
                     turn_sigma=0.6, reset_retry_p=0.02, max_new_tokens=512),
        WorkloadSpec("scienceboard", rounds=(39, 29), tokens=(24000, 23000), prompt_tokens=1500,
                     action_tokens=100, max_turns=50, context_cap=32768,
                     env_step_s=(3.0, 0.6), env_reset_s=(60.0, 0.7),
                     image_tokens=SCREENSHOT_TOKENS, image_window=ImageWindow(16, 8),
                     turn_sigma=0.6, reset_retry_p=0.02, max_new_tokens=512),
        # Coding agents from published 2026 traces (docs/simulator-workloads.md, "Coding
        # agents"): TraceLab's per-step appended and output tokens and Codex tool latencies,
        # vLLM x Mooncake's SWE-bench Pro context growth, AgentX's turns per session.
        WorkloadSpec("coding", rounds=(30, 30), tokens=(80_000, 80_000), prompt_tokens=4_600,
                     action_tokens=523, max_turns=100, context_cap=131_072,
                     env_step_s=(0.13, 1.87), env_reset_s=(2.1, 0.7), obs_sigma=1.35,
                     max_new_tokens=4_096),
        WorkloadSpec("swe_long", rounds=(43, 43), tokens=(110_000, 110_000),
                     prompt_tokens=4_600, action_tokens=444, max_turns=200,
                     context_cap=131_072, env_step_s=(0.13, 1.87), env_reset_s=(60.0, 0.5),
                     obs_sigma=1.35, max_new_tokens=4_096),
        # The two phases of the shifting-bottleneck workload (assumptions, not paper tasks;
        # docs/simulator-workloads.md): WebShop's task shape behind a slow, long-tailed tool
        # (rollout-bound), then few turns over long documents with a fast tool (trainer-bound).
        WorkloadSpec("webshop_slowenv", rounds=(8, 8), tokens=(3400, 3400), prompt_tokens=500,
                     action_tokens=60, max_turns=20, context_cap=8192,
                     env_step_s=(4.0, 1.2), env_reset_s=(0.2, 0.6)),
        WorkloadSpec("longdoc", rounds=(4, 4), tokens=(14000, 14000), prompt_tokens=2000,
                     action_tokens=60, max_turns=20, context_cap=16384,
                     env_step_s=(0.05, 0.3), env_reset_s=(0.2, 0.6), obs_sigma=0.3),
    )
}

# A workload whose environment changes with training progress: (env, progress it runs up to).
PHASED: dict[str, tuple[tuple[str, float], ...]] = {
    "shifting": (("webshop_slowenv", 0.5), ("longdoc", 1.0)),
}


def phase_env(workload: str, progress: float) -> str:
    """The environment a phased workload runs at ``progress`` (the last phase past the end)."""
    phases = PHASED[workload]
    return next((env for env, until in phases if progress < until), phases[-1][0])


def workload_envs(workload: str) -> tuple[str, ...]:
    """The environments of a workload name: one name, a mix such as ``webshop+alfworld`` (one
    environment per group), or a phased workload of :data:`PHASED` (its phases' environments)."""
    if workload in PHASED:
        return tuple(env for env, _ in PHASED[workload])
    envs = tuple(workload.split("+"))
    for env in envs:
        if env not in WORKLOADS:
            raise ConfigError("workload", f"expected one of {', '.join([*WORKLOADS, *PHASED])} "
                              f"or a '+'-joined mix, got {short(workload)}")
    return envs


@dataclass(frozen=True, slots=True)
class TurnPlan:
    context_add: int  # tokens appended before this turn (turn 0: own first obs beyond the prompt)
    action_tokens: int  # tokens the model generates this turn
    env_latency_s: float  # environment time after this turn's action
    kept_prefix: int | None = None  # pruning: context tokens whose KV stays valid (None = all)
    pruned_tokens: int = 0  # tokens removed from the context before this turn (pruned images)
    num_images: int = 0  # screenshots in the context this turn generates from


@dataclass(frozen=True, slots=True)
class TaskPlan:
    task_id: str
    group_id: str
    env: str
    is_eval: bool
    prompt_tokens: int
    reset_latency_s: float
    turns: tuple[TurnPlan, ...]
    reward: float  # in [0, 1], for reporting only
    is_finished: bool = True  # False: cut by max_turns or the context cap (reward 0)
    max_turns: int | None = None  # its environment's turn limit

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    @property
    def output_tokens(self) -> int:
        return sum(t.action_tokens for t in self.turns)

    @property
    def total_tokens(self) -> int:
        """Length of the final sequence: prompt + kept observations + actions (Table 4's tokens)."""
        return self.prompt_tokens + sum(
            t.context_add + t.action_tokens - t.pruned_tokens for t in self.turns)

    @property
    def turn_contexts(self) -> tuple[int, ...]:
        """Context length (prompt included) each turn's generation starts from."""
        contexts, length = [], self.prompt_tokens
        for turn in self.turns:
            length += turn.context_add - turn.pruned_tokens
            contexts.append(length)
            length += turn.action_tokens
        return tuple(contexts)

    @property
    def segment_tokens(self) -> tuple[int, ...]:
        """Training sequences: each pruning closes one (the context before it), then the last."""
        segments, length = [], self.prompt_tokens
        for turn in self.turns:
            if turn.pruned_tokens:
                segments.append(length)
            length += turn.context_add - turn.pruned_tokens + turn.action_tokens
        return (*segments, length)


# ---- calibration: solve the latent turn median and the mean observation size ---------------------


@dataclass(frozen=True, slots=True)
class WorkloadShape:
    """Solved parameters of one environment at one progress point."""

    turn_median: float
    obs_tokens: float  # mean observation text per turn (images excluded)
    turn_limit: int  # min(max_turns, turns that fit the context cap at mean sizes)


def _lognormal_cdf(x: float, median: float, sigma: float) -> float:
    if x <= 0:
        return 0.0
    return 0.5 * (1.0 + math.erf(math.log(x / median) / (sigma * math.sqrt(2.0))))


def turn_distribution(median: float, sigma: float, limit: int) -> list[float]:
    """P(turns = k) for k = 1..limit, turns = min(ceil X, limit), X ~ lognormal(median, sigma)."""
    cdf = [_lognormal_cdf(k, median, sigma) for k in range(limit)]
    probs = [cdf[k] - cdf[k - 1] for k in range(1, limit)]
    return [*probs, 1.0 - cdf[limit - 1]]


def _mean_turns(median: float, sigma: float, limit: int) -> float:
    return sum((k + 1) * p for k, p in enumerate(turn_distribution(median, sigma, limit)))


def solve_turn_median(rounds: float, sigma: float, limit: int) -> float:
    """Median of X such that E[min(ceil X, limit)] = rounds (bisection in log space)."""
    lo, hi = math.log(0.05), math.log(1e5)
    if rounds >= _mean_turns(math.exp(hi), sigma, limit):
        return math.exp(hi)
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if _mean_turns(math.exp(mid), sigma, limit) < rounds else (lo, mid)
    return math.exp(0.5 * (lo + hi))


def _num_obs(spec: WorkloadSpec, turns: float) -> float:
    """Observations with text: every turn when multimodal, else all but turn 0 (in the prompt)."""
    return turns if spec.is_multimodal else turns - 1


def _final_tokens(spec: WorkloadSpec, turns: int, obs: float) -> float:
    images = spec.image_window.live_after(turns) if spec.is_multimodal else 0
    return (spec.prompt_tokens + turns * spec.action_tokens + _num_obs(spec, turns) * obs
            + images * spec.image_tokens)


def context_turn_limit(spec: WorkloadSpec, obs: float) -> int:
    """Turns that fit under the context cap at mean sizes (pruning included), at most max_turns."""
    for turns in range(1, spec.max_turns + 1):
        if _final_tokens(spec, turns, obs) > spec.context_cap:
            return max(1, turns - 1)
    return spec.max_turns


def calibrate(spec: WorkloadSpec, progress: float) -> WorkloadShape:
    """Solve (turn median, obs size) so mean rounds and tokens match Table 4 at ``progress``."""
    rounds, tokens = spec.rounds_at(progress), spec.tokens_at(progress)
    limit, shape = spec.max_turns, None
    for _ in range(8):
        median = solve_turn_median(rounds, spec.turn_sigma, limit)
        probs = turn_distribution(median, spec.turn_sigma, limit)
        mean_turns = sum((k + 1) * p for k, p in enumerate(probs))
        mean_images = sum(p * spec.image_window.live_after(k + 1) for k, p in enumerate(probs))
        left = tokens - spec.prompt_tokens - mean_turns * spec.action_tokens
        left -= mean_images * spec.image_tokens if spec.is_multimodal else 0.0
        obs = max(MIN_OBS_TOKENS, left / max(1.0, _num_obs(spec, mean_turns)))
        shape = WorkloadShape(median, obs, limit)
        new_limit = context_turn_limit(spec, obs)
        if new_limit == limit:
            break
        limit = new_limit
    return shape


# ---- sampling ------------------------------------------------------------------------------------


def _with_env_step(spec: WorkloadSpec, env_step_s: tuple[float, float]) -> WorkloadSpec:
    median, sigma = env_step_s
    return replace(spec, env_step_s=(median or spec.env_step_s[0], sigma or spec.env_step_s[1]))


def _mean_one(rng: random.Random, sigma: float) -> float:
    """A lognormal multiplier with mean 1."""
    return math.exp(sigma * rng.gauss(0.0, 1.0) - 0.5 * sigma * sigma)


def _latency(rng: random.Random, median_sigma: tuple[float, float]) -> float:
    median, sigma = median_sigma
    return median * math.exp(sigma * rng.gauss(0.0, 1.0))


def _reset_latency(rng: random.Random, spec: WorkloadSpec) -> float:
    latency = min(spec.reset_timeout_s, _latency(rng, spec.env_reset_s))
    if rng.random() < spec.reset_retry_p:
        latency += min(spec.reset_timeout_s, _latency(rng, spec.env_reset_s))
    return latency


def _observe(spec: WorkloadSpec, context: int, starts: list[int],
             obs: int) -> tuple[int, int, int | None, list[int]]:
    """Append an observation (screenshot, then text) to a context whose screenshots begin at
    ``starts``; returns (context_add, pruned_tokens, kept_prefix, screenshot starts after)."""
    if not spec.is_multimodal:
        return obs, 0, None, starts
    starts = [*starts, context]
    drop = spec.image_window.to_drop(len(starts))
    if not drop:
        return obs + spec.image_tokens, 0, None, starts
    pruned = drop * spec.image_tokens  # the oldest go; later tokens shift left
    return obs + spec.image_tokens, pruned, starts[0], [s - pruned for s in starts[drop:]]


def _draw_turns(spec: WorkloadSpec, shape: WorkloadShape, rng: random.Random,
                target: int) -> tuple[tuple[TurnPlan, ...], bool]:
    """Up to ``target`` turns; False when the context cap ended the task early."""
    context, starts, turns = spec.prompt_tokens, [], []
    for k in range(target):
        has_text = spec.is_multimodal or k > 0  # a text task's first page is in the prompt
        obs = round(shape.obs_tokens * _mean_one(rng, spec.obs_sigma)) if has_text else 0
        add, pruned, kept, new_starts = _observe(spec, context, starts, obs)
        action = max(1, round(spec.action_tokens * _mean_one(rng, spec.action_sigma)))
        action = min(action, spec.max_new_tokens)
        if context + add - pruned + action > spec.context_cap:
            if k > 0:
                return tuple(turns), False
            action = spec.context_cap - context - add  # turn 0 always runs, its output cut
        latency = _latency(rng, spec.env_step_s)
        turns.append(TurnPlan(add, action, latency, kept, pruned, len(new_starts)))
        context, starts = context + add - pruned + action, new_starts
    return tuple(turns), True


class WorkloadSampler:
    """Draws GRPO groups of task plans for a workload (one environment, a '+'-joined mix or a
    phased workload); ``env_step_s`` (median, sigma) replaces every environment's step latency
    (a zero keeps that part of each environment's own)."""

    def __init__(self, workload: str, seed: int, total_steps: int,
                 env_step_s: tuple[float, float] = (0.0, 0.0)):
        require_int(total_steps, "total_steps", 1)
        self.workload = workload
        self.envs = workload_envs(workload)
        self.seed = seed
        self.total_steps = total_steps
        self.specs = {env: _with_env_step(WORKLOADS[env], env_step_s) for env in self.envs}
        self._shapes: dict[tuple[str, int], WorkloadShape] = {}

    def progress(self, step: int) -> float:
        return min(1.0, max(0.0, step / self.total_steps))

    def shape(self, env: str, step: int) -> WorkloadShape:
        """Solved parameters of ``env`` at ``step`` (cached per sampler)."""
        key = (env, step)
        if key not in self._shapes:
            self._shapes[key] = calibrate(self.specs[env], self.progress(step))
        return self._shapes[key]

    def group_rng(self, group_id: str, step: int, is_eval: bool) -> random.Random:
        """A generator owned by one group: str seeds hash with SHA-512, stable across processes."""
        return random.Random(f"{self.seed}|{self.workload}|{group_id}|{step}|{int(is_eval)}")

    def sample_group(self, group_id: str, size: int, step: int,
                     is_eval: bool = False) -> list[TaskPlan]:
        """``size`` sibling tasks sharing one prompt; a function of (seed, group, step, is_eval)."""
        require_int(size, "size", 1)
        rng = self.group_rng(group_id, step, is_eval)
        if self.workload in PHASED:
            env = phase_env(self.workload, self.progress(step))
        else:
            env = self.envs[rng.randrange(len(self.envs))]
        spec, shape = self.specs[env], self.shape(env, step)
        sigma_group = spec.turn_sigma * math.sqrt(spec.group_share)
        sigma_task = spec.turn_sigma * math.sqrt(1.0 - spec.group_share)
        median = shape.turn_median * math.exp(sigma_group * rng.gauss(0.0, 1.0))
        return [self._sample_task(spec, shape, rng, median, sigma_task, task_id(group_id, i),
                                  group_id, is_eval) for i in range(size)]

    def max_new_tokens(self) -> int:
        """The largest generation cap among the workload's environments."""
        return max(self.specs[env].max_new_tokens for env in self.envs)

    def _sample_task(self, spec: WorkloadSpec, shape: WorkloadShape, rng: random.Random,
                     median: float, sigma: float, task_id: str, group_id: str,
                     is_eval: bool) -> TaskPlan:
        wanted = math.ceil(median * math.exp(sigma * rng.gauss(0.0, 1.0)))
        reset = _reset_latency(rng, spec)
        turns, fits = _draw_turns(spec, shape, rng, min(wanted, spec.max_turns))
        finished = fits and wanted <= spec.max_turns
        reward = 0.5 + 0.5 * rng.random() if finished else 0.0
        return TaskPlan(task_id, group_id, spec.name, is_eval, spec.prompt_tokens, reset, turns,
                        reward, finished, spec.max_turns)

"""The whole job against a bare single-process GRPO loop on the same game, side by side in one run.

- ``bare``: what a popular single-process GRPO trainer does, all in one process on every core
  (``torch.set_num_threads(os.cpu_count())``): per step, B = groups x 8 episodes of the built-in
  ``guess`` environment (called in-process) in lockstep; each turn, one batched forward pass per
  generated token over every unfinished episode (right-padded, the whole context recomputed: the
  dense model has no KV cache), sampled by the engine's own ``Sampler`` at temperature 1; the
  turn then waits for its episodes' environment calls, run concurrently: it sleeps the max of
  their latency draws (the profile's ``LatencyModel``, seeded). Then GRPO: group advantages,
  ``TrainSample.from_trajectory`` and the clipped token-level loss of ``BareLoop`` from
  ``bench/trainer_overhead.py`` (imported, not copied: pad, forward, log-softmax/gather,
  backward, AdamW at the profile's lr), kl_beta 0. Measured: every step from step 0.
- ``job``: the real job (``run_local``: environment server over HTTP, coordinator, four rank
  processes) on the ``local`` profile with the same game, group size, batch (ERS min = ideal =
  B), kl_beta 0 and steps. Measured from its ``metrics.jsonl``: trained samples / the last
  record's ``end_s`` (the job's clock starts once every rank has said Hello: process start is
  not in it, the first step is); also reported, the same after the first step and the whole
  ``run_local`` wall time (``process_s``, process start and stop included).

Order: bare-zero, job-zero, bare-lognormal, job-lognormal (zero: ``env.step_latency.kind=none``;
lognormal: median 0.2 s, the profile's sigma). Figures: episodes/s, trained (loss) tokens/s, wall,
steps; job / bare episodes/s at each latency against the targets (>= 0.8 at zero, >= 3 at
lognormal). Not measured: reward or learning progress (the job trains slightly stale samples,
the bare loop none).

Run: ``.venv/bin/python bench/job_vs_bare.py [--steps N] [--quick] [--out PATH]``.

``--game one-token`` (written to ``job_vs_bare_one_token.json``): the per-step overhead, on
the game where a step holds almost no work: one turn of one token (32 episodes a step), zero
environment latency, no checkpoints on either side. Besides the bare loop it runs TRL's
``GRPOTrainer`` (``bench/peer_trl.py``, in its own virtual environment: ``--trl-python``) on
the same tasks and model, twice: with TRL's defaults (bf16 autocast, gradient checkpointing)
and in float32 as the job trains (``bf16=False``). Sides alternate, ``--rounds`` times;
medians and the job over each side are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import torch
from torch.nn.utils.rnn import pad_sequence

sys.path.insert(0, str(Path(__file__).parent))
from machine import machine_info, write_result
from trainer_overhead import BareLoop

from tiderl.core.commands import GroupSpec
from tiderl.core.grpo import group_advantages
from tiderl.core.ra2p import form_micro_batches
from tiderl.core.types import Trajectory, Turn
from tiderl.engine.request import SamplingParams
from tiderl.engine.sampler import Sampler
from tiderl.env.base import Environment
from tiderl.env.latency import LatencyModel
from tiderl.env.registry import make_env
from tiderl.launch.job import run_local
from tiderl.models.random_init import write_random_checkpoint
from tiderl.models.tokenizer import word_tokenizer
from tiderl.profile import Profile, load_profile
from tiderl.runtime.groups import Dataset
from tiderl.runtime.lineage import read_lineage
from tiderl.trainer.sample import TrainSample

GROUP_SIZE, MEDIAN_S = 8, 0.2
TARGETS = {"zero": 0.8, "lognormal": 3.0}
LATENCY = {"zero": ["env.step_latency.kind=none"],
           "lognormal": ["env.step_latency.kind=lognormal",
                         f"env.step_latency.median_s={MEDIAN_S}"]}


def game_overrides(groups: int, max_turns: int, max_new_tokens: int) -> list[str]:
    """What both sides play: the local profile's guess game, pinned here."""
    return ["env.envs=[guess]", "env.tasks={guess: '1 4'}", f"env.max_turns={max_turns}",
            f"engine.max_new_tokens={max_new_tokens}", f"job.group_size={GROUP_SIZE}",
            f"job.batch_min_groups={groups}", f"job.batch_groups={groups}", "trainer.kl_beta=0"]


@dataclass
class Episode:
    env: Environment
    trajectory: Trajectory
    context: list[int]  # every token before this turn's new context
    new_context: list[int]  # the prompt, then each observation
    is_done: bool = False


class BareGRPO:
    """The bare loop: lockstep rollout of one batch, then one GRPO step on it."""

    def __init__(self, profile: Profile, groups: int):
        self.profile, self.groups = profile, groups
        self.trainer = BareLoop(profile.trainer)
        self.tokenizer = word_tokenizer()
        self.dataset = Dataset(profile)
        self.sampler = Sampler(seed=profile.runtime.seed)
        self.sampling = SamplingParams(max_tokens=profile.engine.max_new_tokens,
                                       temperature=1.0)
        self.latency = LatencyModel(profile.env.step_latency, random.Random(profile.runtime.seed))
        self.eos = self.trainer.model.config.eos_token_id

    def _start(self, step: int) -> list[Episode]:
        cfg = self.profile.env
        episodes = []
        for g in range(self.groups):
            index = step * self.groups + g
            group = self.dataset.group(GroupSpec(f"g{index}", index, False, step))
            for task in group.tasks:
                env = make_env(task.env, max_turns=cfg.max_turns, options=cfg.options.get(task.env))
                observation, _ = env.reset(cfg.tasks.get(task.env), task.seed)
                episodes.append(Episode(env, Trajectory(task.task_id, task.group_id), [],
                                        self.tokenizer.encode(observation).ids))
        return episodes

    @torch.inference_mode()
    def _generate(self, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
        """One batched forward per new token over the rows still generating (eos or
        max_new_tokens ends a row); returns each row's tokens and behaviour logprobs."""
        rows = [list(p) for p in prompts]
        outs: list[tuple[list[int], list[float]]] = [([], []) for _ in prompts]
        live = list(range(len(prompts)))
        for _ in range(self.sampling.max_tokens):
            ids = pad_sequence([torch.tensor(rows[i]) for i in live], batch_first=True)
            last = torch.tensor([len(rows[i]) - 1 for i in live])
            logits = self.trainer.model(ids)[torch.arange(len(live)), last]
            tokens, logprobs = self.sampler(logits, [self.sampling] * len(live),
                                            [len(outs[i][0]) for i in live])
            for i, token, logprob in zip(live, tokens.tolist(), logprobs.tolist(), strict=True):
                rows[i].append(token)
                outs[i][0].append(token)
                outs[i][1].append(logprob)
            live = [i for i in live if outs[i][0][-1] != self.eos]
            if not live:
                break
        return outs

    def _play(self, episodes: list[Episode], version: int) -> None:
        # the AgentLoop's context cap cannot bind here (max_turns x ~20 tokens << 4096)
        while live := [e for e in episodes if not e.is_done]:
            outputs = self._generate([e.context + e.new_context for e in live])
            for e, (ids, logprobs) in zip(live, outputs, strict=True):
                e.trajectory.turns.append(Turn(e.new_context, ids, logprobs, version))
                e.context = e.context + e.new_context + ids
                result = e.env.step(self.tokenizer.decode(ids))
                e.new_context = self.tokenizer.encode(result.observation).ids
                e.is_done = result.done
                if result.done:
                    e.trajectory.reward = result.reward
            time.sleep(max(self.latency.sample() for _ in live))

    def step(self, step: int) -> tuple[int, int]:
        """One GRPO step; returns (episodes, loss tokens)."""
        episodes = self._start(step)
        self._play(episodes, version=step)
        samples = []
        for g in range(0, len(episodes), GROUP_SIZE):
            group = [e.trajectory for e in episodes[g:g + GROUP_SIZE]]
            advantages = group_advantages([t.reward or 0.0 for t in group],
                                          self.profile.trainer.adv_eps)
            samples += [s for t, a in zip(group, advantages, strict=True)
                        for s in TrainSample.from_trajectory(t, a)]
        by_id = {s.seq_id: s for s in samples}
        mbs = form_micro_batches([s.as_sequence() for s in samples], 1,
                                 self.profile.ra2p.tokens_per_rank)
        return len(samples), self.trainer.step([[by_id[r.seq_id] for r in mb.sequences]
                                                for mb in mbs])


def run_bare(profile: Profile, groups: int, steps: int) -> dict:
    torch.set_num_threads(os.cpu_count() or 1)
    start = time.monotonic()
    bare = BareGRPO(profile, groups)
    measured = time.monotonic()  # from step 0, as the job's clock (its launch) counts
    episodes = tokens = 0
    for step in range(steps):
        n, loss_tokens = bare.step(step)
        episodes, tokens = episodes + n, tokens + loss_tokens
    wall = time.monotonic() - measured
    return {"episodes_per_s": round(episodes / wall, 3), "loss_tok_s": round(tokens / wall, 1),
            "wall_s": round(wall, 2), "process_s": round(time.monotonic() - start, 2),
            "steps": steps, "episodes": episodes, "threads": torch.get_num_threads()}


def run_job(profile: Profile, root: Path, name: str) -> dict:
    start = time.monotonic()
    job = run_local(profile, run_root=root, job_id=name)
    process_s = time.monotonic() - start
    if job.exit_code != 0:
        raise SystemExit(f"{name}: the job failed (see {job.run_dir}/logs)")
    records = read_lineage(job.run_dir).metrics
    wall = records[-1].end_s
    samples = sum(r.trained_samples for r in records)
    loss_tokens = sum(r.trained_loss_tokens or 0 for r in records)
    after = records[-1].end_s - records[0].end_s
    later = samples - records[0].trained_samples
    return {"episodes_per_s": round(samples / wall, 3), "loss_tok_s": round(loss_tokens / wall, 1),
            "wall_s": round(wall, 2), "process_s": round(process_s, 2), "steps": len(records),
            "episodes": samples,
            "episodes_per_s_after_first_step": round(later / after, 3) if after > 0 else None}


PEER_CONFIGS = {"trl-defaults": {}, "trl-fp32": {"bf16": False}}


def peer_spec(profile: Profile, groups: int, steps: int, folder: Path) -> dict:
    """What ``peer_trl.py`` plays: the job's tasks in the job's order (one row per group, step
    by step), the job's model (step 0, written from the same seed) and learning rate."""
    write_random_checkpoint(profile.model.size, folder, profile.model.seed)
    dataset, cfg = Dataset(profile), profile.env
    rows = []
    for index in range(groups * steps):
        task = dataset.group(GroupSpec(f"g{index}", index, False, index // groups)).tasks[0]
        text = cfg.tasks.get(task.env)
        env = make_env(task.env, max_turns=cfg.max_turns, options=cfg.options.get(task.env))
        rows.append({"prompt": env.reset(text, task.seed)[0], "task": text, "seed": task.seed})
    return {"model": str(folder), "prompts": rows, "group_size": GROUP_SIZE, "groups": groups,
            "steps": steps, "lr": profile.trainer.lr, "max_turns": cfg.max_turns,
            "partial_credit": (cfg.options.get("guess") or {}).get("partial_credit", 0.0)}


def run_peer(python: str, spec: dict, config: dict, out_dir: Path) -> dict:
    spec = {**spec, "config": config, "out_dir": str(out_dir)}
    done = subprocess.run([python, str(Path(__file__).parent / "peer_trl.py")],
                          input=json.dumps(spec), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"peer_trl.py failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def one_token_profile(steps: int, groups: int = 4) -> tuple[Profile, list[str]]:
    """The local profile on the one-turn, one-token game (and its overrides)."""
    overrides = [*game_overrides(groups, 1, max_new_tokens=1), *LATENCY["zero"],
                 "runtime.checkpoint_every=0", f"job.steps={steps}"]
    return load_profile("local", overrides), overrides


def one_token_job(steps: int) -> dict:
    """One job on the one-token game (``bench/profile_job.py`` runs it under py-spy): its
    figures, the median step time after step 0, and the boundaries that moved ranks."""
    profile, _ = one_token_profile(steps)
    with tempfile.TemporaryDirectory(prefix="tiderl-one-token-") as tmp:
        out = run_job(profile, Path(tmp), "job")
        records = read_lineage(Path(tmp) / "job").metrics
    out["step_s_median"] = round(statistics.median(r.step_s for r in records[1:]), 3)
    out["moves"] = sum(a.roles != b.roles for a, b in pairwise(records))
    return out


def one_token(args: argparse.Namespace) -> None:
    """The one-turn, one-token game: job, bare loop and TRL in turns, ``args.rounds`` times."""
    groups, steps = 4, args.steps
    profile, overrides = one_token_profile(steps, groups)
    sides = ["job", "bare", *(PEER_CONFIGS if args.trl_python else ())]
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory(prefix="tiderl-one-token-") as tmp:
        spec = peer_spec(profile, groups, steps, Path(tmp) / "model")
        for r in range(args.rounds):
            for side in sides:
                print(f"round {r}: {side}, {steps} steps ...", file=sys.stderr)
                if side == "job":
                    runs[side].append(run_job(profile, Path(tmp), f"job-{r}"))
                elif side == "bare":
                    runs[side].append(run_bare(profile, groups, steps))
                else:
                    runs[side].append(run_peer(args.trl_python, spec, PEER_CONFIGS[side],
                                               Path(tmp) / side))
    medians = {side: statistics.median(x["episodes_per_s"] for x in xs)
               for side, xs in runs.items()}
    write_result(args.out or Path(__file__).parent / "results" / "job_vs_bare_one_token.json", {
        "what": "episodes/s on the one-turn, one-token guess game (32 episodes a step, zero env "
                "latency, no checkpoints): the whole job against a bare single-process loop and "
                "TRL's GRPOTrainer, in turns; medians over rounds",
        "episodes_per_s_median": medians,
        "job_over": {side: round(medians["job"] / m, 3) for side, m in medians.items()
                     if side != "job"},
        "target": {"job_over_trl-fp32": 0.6}, "rounds": args.rounds, "steps": steps,
        "runs": runs, "game": {"overrides": overrides, "episodes_per_step": groups * GROUP_SIZE},
        "peer_configs": PEER_CONFIGS, "machine": machine_info()})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--quick", action="store_true",
                        help="2 steps of 2 groups, 4 turns (a check it runs)")
    parser.add_argument("--game", choices=("guess", "one-token"), default="guess")
    parser.add_argument("--trl-python", default="",
                        help="one-token: the interpreter of a venv with trl and msgspec")
    parser.add_argument("--rounds", type=int, default=3, help="one-token: rounds in turns")
    args = parser.parse_args()
    if args.game == "one-token":
        one_token(args)
        return
    args.out = args.out or str(Path(__file__).parent / "results" / "job_vs_bare.json")
    steps, groups, max_turns = (2, 2, 4) if args.quick else (args.steps, 4, 12)
    game = game_overrides(groups, max_turns, max_new_tokens=2)
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="tiderl-job-vs-bare-") as tmp:
        for latency, overrides in LATENCY.items():
            profile = load_profile("local", [*game, *overrides, f"job.steps={steps}"])
            for side in ("bare", "job"):
                name = f"{side}-{latency}"
                print(f"{name}: {steps} steps ...", file=sys.stderr)
                runs[name] = (run_bare(profile, groups, steps) if side == "bare"
                              else run_job(profile, Path(tmp), name))
    def ratio(key: str, latency: str) -> float | None:
        job, bare = runs[f"job-{latency}"][key], runs[f"bare-{latency}"]["episodes_per_s"]
        return round(job / bare, 3) if job is not None else None

    ratios = {k: ratio("episodes_per_s", k) for k in LATENCY}
    after_first = {k: ratio("episodes_per_s_after_first_step", k) for k in LATENCY}
    latency = profile.env.step_latency
    write_result(args.out, {
        "what": "episodes/s of the whole job vs a bare single-process GRPO loop (generation "
                "included, same cores, same guess game), at zero and lognormal env latency",
        "runs": runs, "job_over_bare": ratios, "targets": TARGETS,
        "job_over_bare_after_first_step": after_first,
        "met": {k: ratios[k] >= TARGETS[k] for k in LATENCY}, "steps": steps,
        "game": {"overrides": game, "episodes_per_step": groups * GROUP_SIZE,
                 "lognormal": {"median_s": latency.median_s, "sigma": latency.sigma}},
        "machine": machine_info()})


if __name__ == "__main__":
    main()

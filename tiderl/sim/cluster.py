"""The simulated cluster: rollout pool, global buffer, trainer and the coordinator's step loop.

    WorkloadSampler ──groups (fed up to the staleness horizon)──> RolloutPool (CTB / request)
                                                                    │ group ready
                                                                    v
    ReadinessTracker <──record_ready── ReadyBuffer ──micro-batches of batch j──> step j executor
                                                                    │ update done
                                                                    v
              boundary: version += 1 ─ ERS plan (tiderl) ─ role moves ─ weight sync (rollout
              stalls, KV flushed) ─ next step starts (RA2P mode from RAS/TPRM, tiderl)

Step j consumes global batch j with policy version j; rollout keeps going during training
(asynchronous systems), bounded by the staleness throttle: training tasks are admitted only up
to (version + max_staleness + 1) batches. VeRL is the same machinery with staleness 0, every GPU
rolling out and then training (swap in, Ref, swap, Actor, sync and swap back).
All policy decisions come from ``tiderl.core`` objects (``SimResult.policies`` holds them).
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from tiderl.core.buffer import ReadyBuffer
from tiderl.core.ctb import SchedulingPolicy, make_policy
from tiderl.core.ers import ERSInput, ERSPolicy
from tiderl.core.ra2p import choose_mode, synthetic_ready_times
from tiderl.core.readiness import ReadinessTracker
from tiderl.core.types import MicroBatch, Mode, Role, SeqRef
from tiderl.sim.costcache import CachedCostModel
from tiderl.sim.events import EventLoop
from tiderl.sim.hardware import GPUS, MODELS
from tiderl.sim.micro import simulate_rollout_step, simulate_trainer_step
from tiderl.sim.results import RolloutResult, SimResult, StepRecord
from tiderl.sim.rollout import RolloutPool, SimGroup, trajectory_tokens
from tiderl.sim.scenario import SimScenario, SystemSpec
from tiderl.sim.trainer import StepExecutor, build_executor, typical_timings
from tiderl.sim.workload import TaskPlan, WorkloadSampler

__all__ = ["RolloutResult", "SimResult", "StepRecord", "simulate", "simulate_rollout_step",
           "simulate_trainer_step"]

TRAINER_ROLES = (Role.ACTOR, Role.REF)


def simulate(system: SystemSpec, scenario: SimScenario) -> SimResult:
    """Run ``scenario.steps`` training steps of ``system``; deterministic for the seed."""
    return Cluster(system, scenario).run()


class Cluster:
    """The coordinator: feeds tasks, runs steps, applies ERS plans and weight syncs."""

    def __init__(self, system: SystemSpec, scenario: SimScenario) -> None:
        self.system, self.scenario = system, scenario
        self.loop = EventLoop()
        self.cost = CachedCostModel(MODELS[scenario.model], GPUS[scenario.gpu])
        self.sampler = _sampler(scenario.workload, scenario.seed, scenario.steps)
        n = scenario.gpus
        # the trainer must hold its sharded state (CostModel.min_train_gpus), whatever the ratio
        self.min_trainer = min(self.cost.min_train_gpus(), max(1, n - 1))
        num_rollout = n if system.is_sync else min(scenario.num_rollout_gpus(),
                                                   max(1, n - self.min_trainer))
        self.roles = [Role.ACTOR] * (n - num_rollout) + [Role.ROLLOUT] * num_rollout
        self.max_staleness = 0 if system.is_sync else scenario.max_staleness
        self.policy = _rollout_policy(system, scenario)
        self.book = self.policy.config.new_book(max_staleness=self.max_staleness,
                                                tasks_per_step=scenario.batch_ideal)
        self.tracker = ReadinessTracker(0.0)
        self.pool = RolloutPool(self.loop, self.cost, self.book, self.policy,
                                round_interval_s=scenario.ctb_round_interval_s,
                                block_size=scenario.kv_block_size,
                                max_running=scenario.request_concurrency,
                                on_group_ready=self._on_group_ready)
        self.pool.on_idle_change = self._integrate_idle
        self.buffer = ReadyBuffer(self.tracker, group_size=scenario.group_size,
                                  batch_ideal=scenario.batch_ideal,
                                  max_staleness=self.max_staleness,
                                  tokens_per_rank=scenario.ra2p.tokens_per_rank,
                                  on_micro_batch=self._on_micro_batch,
                                  on_batch_closed=self._on_batch_closed)
        ers = scenario.ers_config()
        ers = replace(ers, min_trainer_ranks=max(ers.min_trainer_ranks, self.min_trainer))
        self.ers = ERSPolicy(ers, scenario.ra2p) if system.uses_ers else None
        self._num_retired = 0  # training tasks reported to the book as retired
        self.swap_s = self.cost.model_swap_s()
        self.cross_node = n > self.cost.gpu.gpus_per_node
        # step state
        self.step = 0
        self.version = 0
        self.mode: Mode = Mode.COLOCATED
        self.executor: StepExecutor | None = None
        self.waiting: dict[int, list[MicroBatch]] = {}
        self.closed_batches: set[int] = set()
        self.records: list[StepRecord] = []
        self.trained_tokens = 0
        self.trained_samples = 0
        self.in_step_tokens = 0
        self.num_fed_groups = 0
        self.fed_groups: list[list[TaskPlan]] = []  # the task stream, in feeding order
        self.mean_seq_tokens = 0.0
        self.last_num_mbs = 0
        # waits
        self.rwt_s = 0.0
        self.twt_s = 0.0
        self._idle_since = 0.0
        self._sync_window = (0.0, 0.0)
        self._is_parked = False  # verl: the rollout GPUs are training
        self._step_marks: dict[str, float] = {}

    # ---- the run ----

    def run(self) -> SimResult:
        for rank, role in enumerate(self.roles):
            if role is Role.ROLLOUT:
                self.pool.add_rank(rank, available_at=0.0)
        if self.ers is not None:  # the launch plan: a cold start maximises rollout (§5.2)
            self._apply_ers(0.0, is_launch=True)
        self._feed()
        self.mean_seq_tokens = self._fed_mean_tokens()
        self._start_step()
        self.loop.run()
        return self._result()

    def _feed(self) -> None:
        """Groups up to the book's staleness throttle (retired tasks + (max_staleness + 1)
        batches of the current size), so that the throttle is the core's."""
        limit = self.book.train_admission_limit
        horizon = -(-limit // self.scenario.group_size) if limit is not None else 0
        while self.num_fed_groups < horizon:
            idx = self.num_fed_groups
            batch = idx // self.scenario.batch_groups
            plans = list(_training_group(self.scenario.workload, self.scenario.seed,
                                         self.scenario.steps, idx, self.scenario.group_size,
                                         batch))
            self.pool.add_group(plans)
            self.fed_groups.append(plans)
            self.num_fed_groups += 1

    def _feed_eval(self) -> None:
        """An evaluation phase every ``eval_every`` steps (step 0 included): ``eval_groups``
        groups that bypass the staleness throttle and are never trained."""
        every, count = self.scenario.eval_every, self.scenario.eval_groups
        if every and count and self.step % every == 0:
            for i in range(count):
                self.pool.add_group(self.sampler.sample_group(
                    f"e{self.step}.{i}", self.scenario.group_size, self.step, is_eval=True))

    def _is_eval_step(self) -> bool:
        """An evaluation phase starts with the next step, or one is still running."""
        every, count = self.scenario.eval_every, self.scenario.eval_groups
        if every and count and self.step % every == 0:
            return True
        return any(group.is_eval for group in self.pool.groups.values())

    def _fed_mean_tokens(self) -> float:
        plans = [t.plan for t in self.pool.tasks.values()]
        return sum(trajectory_tokens(p) for p in plans) / max(1, len(plans))

    # ---- buffer events ----

    def _on_group_ready(self, group: SimGroup) -> None:
        if not group.is_eval:
            self.buffer.add_group(group, self.loop.now)

    def _on_micro_batch(self, batch: int, mb: MicroBatch) -> None:
        if self.executor is not None and batch == self.step:
            self._consume(batch, mb)
        else:
            self.waiting.setdefault(batch, []).append(mb)

    def _on_batch_closed(self, batch: int) -> None:
        if self.executor is not None and batch == self.step:
            self._is_parked = self.system.is_sync
            self.executor.close()
        else:
            self.closed_batches.add(batch)

    def _consume(self, batch: int, mb: MicroBatch) -> None:
        self.in_step_tokens += self.buffer.consume(batch, mb)
        self.executor.add(mb)

    # ---- steps ----

    def _start_step(self) -> None:
        now = self.loop.now
        self._integrate_idle()
        self._is_parked = False
        self._feed_eval()
        self.tracker.start_step(now)
        trainer = [r for r, role in enumerate(self.roles) if role in TRAINER_ROLES]
        num_trainer = len(trainer) if not self.system.is_sync else self.scenario.gpus
        kind, num_ref = self._executor_kind(num_trainer)
        self.buffer.num_dp_ranks = num_trainer - num_ref if kind == "decoupled" else num_trainer
        self.executor = build_executor(kind, self.loop, self.cost, num_gpus=num_trainer,
                                       num_ref=num_ref,
                                       max_aggregate=self.scenario.ra2p.max_aggregate,
                                       on_done=self._on_step_done,
                                       count_wait=not self.system.is_sync)
        self._step_marks = self._marks(now, kind)
        for mb in self.waiting.pop(self.step, []):
            self._consume(self.step, mb)
        if self.step in self.closed_batches:
            self.closed_batches.discard(self.step)
            self._is_parked = self.system.is_sync
            self.executor.close()

    def _executor_kind(self, num_trainer: int) -> tuple[str, int]:
        """(executor kind, Ref GPUs) for this step; tiderl's mode from the core cost models."""
        kind = self.system.trainer_kind
        if kind == "sync":
            return "batch", 0
        if kind != "ra2p":
            return kind, 0
        refs = self.roles.count(Role.REF)
        num_ref = refs if refs else (self.scenario.ra2p.num_ref_ranks if not self.ers else 0)
        if num_ref < 1 or num_trainer - num_ref < 1:
            self.mode = Mode.COLOCATED
            return "colocated", 0
        self.mode = self._choose_mode(num_trainer, num_ref)
        return (self.mode.value, num_ref if self.mode is Mode.DECOUPLED else 0)

    def _choose_mode(self, num_trainer: int, num_ref: int) -> Mode:
        """RA2P's choice on the expected ready times (RAS at start, the rest TPRM apart): the
        core's C_dec and C_col, each with the per-micro-batch times of its own layout (Ref on
        ``num_ref`` GPUs vs on all ``num_trainer``), chosen by the core's ``choose_mode``."""
        config = self.scenario.ra2p
        if config.mode != "auto":
            return Mode(config.mode)
        signals = self.tracker.signals(self.loop.now)
        num_mbs = max(1, signals.ras, self.last_num_mbs or self._expected_mbs(num_trainer))
        tprm = signals.tprm_s if signals.tprm_s is not None else self._mean_step_s() / num_mbs
        times = synthetic_ready_times(num_mbs, min(signals.ras, num_mbs), tprm)
        mb = self._typical_mb(num_trainer)
        dec = typical_timings(self.cost, mb, num_ref, num_trainer - num_ref, self.swap_s)
        col = typical_timings(self.cost, mb, num_trainer, num_trainer, self.swap_s)
        return choose_mode(times, dec, num_trainer - num_ref, config.max_aggregate, config,
                           colocated_timings=col)

    def _expected_mbs(self, num_dp: int) -> int:
        target = self.scenario.ra2p.tokens_per_rank * max(1, num_dp)
        return max(1, round(self.scenario.batch_ideal * self.mean_seq_tokens / target))

    def _typical_mb(self, num_dp: int) -> MicroBatch:
        """A micro-batch of the target size made of mean-length sequences."""
        seq = max(1, int(self.mean_seq_tokens))
        target = self.scenario.ra2p.tokens_per_rank * max(1, num_dp)
        count = max(1, min(self.scenario.batch_ideal, target // seq))
        return MicroBatch(0, tuple(SeqRef(f"t{i}", seq) for i in range(count)))

    def _last_rollout_idle_frac(self) -> float:
        """RWT of the last step over its rollout GPU-seconds (0 before the first step)."""
        if not self.records:
            return 0.0
        last = self.records[-1]
        capacity = last.num_rollout * (last.end_s - last.start_s)
        return min(1.0, last.rwt_s / capacity) if capacity > 0 else 0.0

    def _mean_step_s(self) -> float:
        if not self.records:
            return 0.0
        return sum(r.end_s - r.start_s for r in self.records) / len(self.records)

    def _on_step_done(self, now: float) -> None:
        executor = self.executor
        self.executor = None
        self._integrate_idle()
        self.trained_tokens += self.in_step_tokens
        self.trained_samples += executor.samples
        self.in_step_tokens = 0
        self.last_num_mbs = executor.num_micro_batches
        if executor.samples:
            self.mean_seq_tokens = executor.tokens / executor.samples
        self.twt_s += executor.twt_s
        record = self._record(executor, now)
        self.records.append(record)
        self.step += 1
        self.version += 1
        if self.step >= self.scenario.steps:
            self.loop.stop()
            return
        self.pool.set_version(self.version)
        retired = self.trained_samples + self.buffer.discarded_samples  # out of the window
        self.book.retire(retired - self._num_retired)
        self._num_retired = retired
        switch_s = self._apply_ers(now) if self.ers is not None else 0.0
        self._feed()
        sync_s = self._sync(now)
        record.rwt_s += sync_s * self.roles.count(Role.ROLLOUT)
        self.loop.at(now + max(sync_s, switch_s), lambda _: self._start_step())

    def _sync(self, now: float) -> float:
        """Weight sync to the rollout ranks: they stall for it and flush their KV (§5.2)."""
        num_rollout = len(self.pool.engines)
        sync_s = self.cost.weight_sync_s(num_rollout, self.cross_node)
        if self.system.is_sync:
            sync_s += self.swap_s  # and the Actor swaps back out for the rollout engine
        self.rwt_s += sync_s * num_rollout
        self._sync_window = (now, now + sync_s)
        for engine in self.pool.engines.values():
            engine.stall(now + sync_s)
            engine.kv.flush()
        return sync_s

    def _apply_ers(self, now: float, is_launch: bool = False) -> float:
        """ERS for step ``self.step``, at launch or at the post-update boundary: role moves (a
        leaving rollout rank's tasks resume elsewhere, fresh prefill) and, after an update, the
        next batch size. Returns the slowest role switch."""
        trainer = [r for r, role in enumerate(self.roles) if role in TRAINER_ROLES]
        num_ref = max(1, self.roles.count(Role.REF))
        mb = self._typical_mb(len(trainer))
        timings = typical_timings(self.cost, mb, num_ref, max(1, len(trainer) - num_ref),
                                  self.swap_s)
        inp = ERSInput(step=self.step, is_eval_step=self._is_eval_step(),
                       signals=self.tracker.signals(now), step_duration_s=self._mean_step_s(),
                       roles=tuple(self.roles), mode=self.mode, timings=timings,
                       num_micro_batches=max(1, self.last_num_mbs),
                       rollout_idle_frac=self._last_rollout_idle_frac())
        plan = self.ers.plan(inp)
        sync_s = self.cost.weight_sync_s(len(self.pool.engines), self.cross_node)
        switch_s = 0.0
        for change in plan.changes:
            self.roles[change.rank] = change.dst
            seconds = self.cost.role_switch_s(change.src, change.dst)
            if change.src is Role.ROLLOUT:
                self._integrate_idle()
                self.pool.remove_rank(change.rank)
                switch_s = max(switch_s, seconds)
            elif change.dst is Role.ROLLOUT:
                self.pool.add_rank(change.rank, available_at=now + max(sync_s, seconds))
        if not is_launch:  # step 0 trains B_ideal: nothing is ready yet to size it from
            # The staleness window stays B_ideal wide: sizing it by the elastic batch would
            # throttle rollout exactly when ERS shrinks a batch because too little was ready.
            self.buffer.set_batch_size(self.step, plan.batch_size, now)
        return switch_s

    # ---- metrics ----

    def _integrate_idle(self) -> None:
        """RWT: idle rollout GPU-seconds while no training task may be admitted (throttle),
        outside weight syncs (counted whole at the sync) and outside VeRL's training phase."""
        now, since = self.loop.now, self._idle_since
        self._idle_since = now
        if now <= since or self._is_parked or self.book.num_new > 0:
            return
        lo, hi = self._sync_window
        overlap = max(0.0, min(now, hi) - max(since, lo))
        self.rwt_s += (now - since - overlap) * self.pool.num_idle

    def _marks(self, now: float, kind: str) -> dict[str, float]:
        query, hit = self.pool.kv_counters()
        return {"start": now, "rwt": self.rwt_s, "query": query, "hit": hit,
                "discarded": self.buffer.discarded_tokens, "ras": self.tracker.step_ras,
                "kind": kind}

    def _record(self, executor: StepExecutor, now: float) -> StepRecord:
        marks = self._step_marks
        query, hit = self.pool.kv_counters()
        d_query = query - marks["query"]
        kind = marks["kind"]
        return StepRecord(
            step=self.step, start_s=marks["start"], end_s=now,
            trained_samples=executor.samples, trained_tokens=executor.tokens,
            ras=marks["ras"], tprm_s=self.tracker.signals(now).tprm_s,
            rwt_s=self.rwt_s - marks["rwt"], twt_s=executor.twt_s,
            mode=kind, num_rollout=self.roles.count(Role.ROLLOUT),
            num_trainer=executor.num_gpus,
            kv_hit_rate=(hit - marks["hit"]) / d_query if d_query else 0.0,
            max_staleness_seen=self.buffer.max_staleness_seen.get(self.step, 0),
            discarded_tokens=self.buffer.discarded_tokens - marks["discarded"])

    def _result(self) -> SimResult:
        wall = self.records[-1].end_s if self.records else self.loop.now
        query, hit = self.pool.kv_counters()
        decoded = sum(e.decoded_tokens for e in self.pool.all_engines())
        in_flight = (self.buffer.buffered_tokens + self.in_step_tokens
                     + self.pool.finished_in_open_groups())
        policies: dict[str, object] = {"book": self.book, "tracker": self.tracker,
                                       "ctb" if self.system.uses_ctb else "request": self.policy}
        if self.ers is not None:
            policies["ers"] = self.ers
        return SimResult(
            system=self.system.label, scenario=self.scenario, wall_s=wall,
            trained_tokens=self.trained_tokens, generated_tokens=self.pool.generated_tokens,
            discarded_tokens=self.buffer.discarded_tokens, in_flight_tokens=in_flight,
            decoded_tokens=decoded, goodput_tok_s=self.trained_tokens / wall if wall else 0.0,
            gen_tok_s=decoded / wall if wall else 0.0,
            kv_hit_rate=hit / query if query else 0.0, rwt_s=self.rwt_s, twt_s=self.twt_s,
            num_events=self.loop.num_events, num_ctb_rounds=self.pool.num_rounds,
            steps=self.records, policies=policies)


@lru_cache(maxsize=8)
def _sampler(workload: str, seed: int, total_steps: int) -> WorkloadSampler:
    return WorkloadSampler(workload, seed, total_steps)


@lru_cache(maxsize=1 << 16)
def _training_group(workload: str, seed: int, total_steps: int, index: int, size: int,
                    batch: int) -> tuple[TaskPlan, ...]:
    """Training group ``index`` of a task stream. A memo of a pure function (plans are frozen
    and a function of their arguments), so that the systems compared on one scenario draw the
    stream once: sampling is ~10% of a run."""
    sampler = _sampler(workload, seed, total_steps)
    return tuple(sampler.sample_group(f"g{index}", size, batch))


def _rollout_policy(system: SystemSpec, scenario: SimScenario) -> SchedulingPolicy:
    """The core's policy by name: CTB, or the request-level baseline at the scenario's
    per-GPU concurrency."""
    if system.uses_ctb:
        return make_policy(replace(scenario.ctb, policy="ctb"))
    return make_policy(replace(scenario.ctb, policy="request",
                               request_concurrency=scenario.request_concurrency))

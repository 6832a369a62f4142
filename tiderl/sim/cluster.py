"""The simulated cluster: an adapter between the event heap and the core's step controller.

    WorkloadSampler ──plans of the groups the controller feeds──> RolloutPool (engines, envs)
        RolloutPool ──turn and finish events──> controller.rollout (CTB's book)
                    <──CTB rounds: Admit / Pause / Resume──
        group complete ──controller.group_ready──> ReadyBuffer ──Dispatch──> StepExecutor
        executor done ──controller.step_done (RankReports, KV counters)──> RecordStep, Boundary
        Boundary ──weight sync: rollout engines stall, KV flushed; role switches──> acks on the
                   heap at the time each member is ready ──controller.boundary_acked──> ...

Every scheduling decision is the controller's (:mod:`tiderl.core.step_control`), the same object
the runtime coordinator drives over the bus; this module only says what the hardware makes of
the commands: how long a sync, a role switch or a micro-batch takes (``CostModel``).
"""

from __future__ import annotations

from collections import deque
from functools import lru_cache

from tiderl.core.commands import (
    Abort,
    Boundary,
    CloseStep,
    Command,
    Dispatch,
    FeedGroups,
    Finish,
    GroupDropped,
    GroupSpec,
    JoinRollout,
    LeaveRollout,
    Retire,
    StartStep,
    StepOutcome,
)
from tiderl.core.records import reward_summary
from tiderl.core.segments import task_of
from tiderl.core.step_control import (
    StepControlConfig,
    StepControlError,
    StepController,
    Substrate,
    effective_config,
    effective_view,
    group_of_task,
    initial_roles,
)
from tiderl.core.system import SystemSpec
from tiderl.core.types import Group, Role
from tiderl.sim.costcache import CachedCostModel
from tiderl.sim.events import EventLoop
from tiderl.sim.hardware import GPUS, MODELS, CostModel
from tiderl.sim.results import RolloutResult, SimResult, WindowSlots
from tiderl.sim.rollout import RolloutPool, SimGroup, group_of
from tiderl.sim.scenario import SimScenario
from tiderl.sim.single_gpu import simulate_rollout_step, simulate_trainer_step
from tiderl.sim.trainer import StepExecutor, build_executor
from tiderl.sim.workload import TaskPlan, WorkloadSampler

__all__ = ["RolloutResult", "SimResult", "simulate", "simulate_rollout_step",
           "simulate_trainer_step"]


def simulate(system: SystemSpec, scenario: SimScenario) -> SimResult:
    """Run ``scenario.job.steps`` training steps of ``system``; deterministic for the seed."""
    return Cluster(system, scenario).run()


def scenario_step_config(system: SystemSpec, scenario: SimScenario,
                   cost: CostModel) -> StepControlConfig:
    """The step cycle of ``system`` on the scenario: the trainer keeps enough GPUs to hold its
    sharded state (``CostModel.min_train_gpus``), request-level engines their concurrency."""
    sampler = stream_sampler(scenario.sim.workload, scenario.sim.seed, scenario.job.steps,
                             scenario.env_step)
    substrate = Substrate(kv_tokens=cost.kv_capacity_tokens(),
                          max_new_tokens=sampler.max_new_tokens(),
                          kv_block_tokens=scenario.kv_block_size,
                          min_trainer_ranks=min_trainer(scenario, cost),
                          request_concurrency=scenario.sim.request_concurrency,
                          stream_tokens_per_rank=scenario.sim.stream_tokens_per_rank,
                          over_provision=scenario.sim.async_over_provision)
    return effective_config(system, scenario.job, scenario.ctb, scenario.ra2p, scenario.ers,
                            substrate)


def scenario_effective_view(system: SystemSpec, scenario: SimScenario) -> dict[str, object]:
    """What ``system`` runs on the scenario (:func:`tiderl.core.step_control.effective_view`),
    on the scenario's simulated GPUs."""
    cost = CachedCostModel(MODELS[scenario.sim.model], GPUS[scenario.sim.gpu])
    return effective_view(scenario_step_config(system, scenario, cost), scenario.ctb,
                          scenario.ra2p, scenario.ers)


def min_trainer(scenario: SimScenario, cost: CostModel) -> int:
    return min(cost.min_train_gpus(), max(1, scenario.sim.gpus - 1))


class Cluster:
    """One simulated job: the heap, the rollout pool, the step executor and the controller."""

    def __init__(self, system: SystemSpec, scenario: SimScenario) -> None:
        self.system, self.scenario = system, scenario
        self.loop = EventLoop()
        self.cost = CachedCostModel(MODELS[scenario.sim.model], GPUS[scenario.sim.gpu])
        self.sampler = stream_sampler(scenario.sim.workload, scenario.sim.seed,
                                      scenario.job.steps, scenario.env_step)
        n = scenario.sim.gpus
        num_rollout = min(scenario.num_rollout_gpus(), max(1, n - min_trainer(scenario,
                                                                             self.cost)))
        roles = initial_roles(system, n, num_rollout, scenario.ra2p.placement)
        self.controller = StepController(scenario_step_config(system, scenario, self.cost), roles,
                                         self._group, now=0.0)
        self.pool = RolloutPool(self.loop, self.cost, self.controller.rollout,
                                round_interval_s=scenario.sim.ctb_round_interval_s,
                                block_size=scenario.kv_block_size,
                                max_running=scenario.sim.request_concurrency,
                                on_group_ready=self._on_group_ready)
        self.swap_s = self.cost.model_swap_s()
        self.cross_node = n > self.cost.gpu.gpus_per_node
        self.start: StartStep | None = None
        self.executor: StepExecutor | None = None
        self.fed_groups: list[tuple[TaskPlan, ...]] = []  # the task stream, in feeding order
        self._plans: dict[str, tuple[TaskPlan, ...]] = {}  # groups fed, until they run
        self._rewards: dict[str, float] = {}  # task id -> reward, of the ready groups
        self._step_rewards: dict[str, float] = {}  # the step's tasks (a task may have segments)
        # where the device-seconds go: the groups trained and dropped, the trainer's work
        self._trained_groups: set[str] = set()
        self._dropped_groups: set[str] = set()
        self._device_s: dict[str, float] = {}
        # where the window's places go: ready groups until a step trains them, the open step's
        # (in dispatch order), trained groups until the window moves past them, and the samples
        # of dropped groups whose Retire is still to come
        self._ready: dict[str, SimGroup] = {}
        self._step_groups: dict[str, None] = {}
        self._unretired: deque[tuple[SimGroup, float]] = deque()  # (group, when it trained)
        self._dropped_samples = 0
        self._window = WindowSlots()

    # ---- the run ----

    def run(self) -> SimResult:
        """Every step, or a StepControlError when the events ran out before the last one (a
        stall is a bug to see, not a short result to report)."""
        self._apply(self.controller.launch(0.0))
        self.loop.run()
        done = len(self.controller.ledger.records)
        if done < self.scenario.job.steps:
            raise StepControlError(
                f"the simulation stalled after {done} of {self.scenario.job.steps} steps at "
                f"t={self.loop.now:.1f} s ({self.controller.state.phase.name.lower()}, "
                f"{self.pool.book.num_new} tasks waiting for admission)")
        return self._result()

    def _group(self, spec: GroupSpec) -> Group:
        """The controller's dataset: training group ``index`` of the task stream (its batch sets
        the workload's progress), or an evaluation group of step ``spec.step``."""
        if spec.is_eval:
            plans = tuple(self.sampler.sample_group(spec.group_id, self.scenario.job.eval_size,
                                                    spec.step, is_eval=True))
        else:
            sim, job = self.scenario.sim, self.scenario.job
            plans = training_group(sim.workload, sim.seed, job.steps, spec.index,
                                   job.group_size, spec.index // job.batch_groups,
                                   self.scenario.env_step)
        self._plans[spec.group_id] = plans
        return group_of(plans)

    def _apply(self, commands: list[Command]) -> None:
        for command in commands:
            if isinstance(command, FeedGroups):
                for spec in command.groups:
                    plans = self._plans.pop(spec.group_id)
                    self.pool.add_group(plans)
                    if not spec.is_eval:
                        self.fed_groups.append(plans)
            elif isinstance(command, JoinRollout):
                self.pool.add_rank(command.rank)
            elif isinstance(command, LeaveRollout):
                self.pool.remove_rank(command.rank)
            elif isinstance(command, StartStep):
                self._start_step(command)
            elif isinstance(command, Dispatch):
                for seq in command.mb.sequences:
                    task = task_of(seq.seq_id)
                    self._step_rewards[task] = self._rewards[task]
                    self._trained_groups.add(group_of_task(task))
                    self._step_groups[group_of_task(task)] = None
                self.executor.add(command.mb)
            elif isinstance(command, GroupDropped):
                self._dropped_groups.add(command.group_id)
                self._ready.pop(command.group_id, None)
                self._dropped_samples += self.scenario.job.group_size  # its Retire follows
            elif isinstance(command, Retire):
                self._retire(command.num_tasks)
            elif isinstance(command, CloseStep):
                self.executor.close()
            elif isinstance(command, Boundary) and not command.is_final:
                self._boundary(command)
            elif isinstance(command, Finish):
                self.loop.stop()
            elif isinstance(command, Abort):
                raise StepControlError(command.reason)

    # ---- rollout ----

    def _on_group_ready(self, group: SimGroup) -> None:
        if not group.is_eval:
            self._rewards.update(group.rewards)
            self._ready[group.group_id] = group
        ready = None if group.is_eval else group
        self._apply(self.controller.group_ready(group.group_id, ready, self.loop.now))

    # ---- steps ----

    def _start_step(self, start: StartStep) -> None:
        self.start = start
        self._step_rewards = {}
        switch_s = self.scenario.sim.colocate_switch_s if self.system.is_sync else 0.0
        self.executor = build_executor(start.step_mode, self.loop, self.cost,
                                       num_gpus=len(start.ranks), num_ref=len(start.ref_ranks),
                                       max_aggregate=start.max_aggregate or 1,
                                       on_done=self._on_step_done,
                                       count_wait=not self.system.is_sync, setup_s=switch_s)

    def _on_step_done(self, now: float) -> None:
        executor, start = self.executor, self.start
        self.executor = self.start = None
        self._spend(executor.gpu_s)
        for group_id in self._step_groups:
            if (group := self._ready.pop(group_id, None)) is not None:
                group.window.train_s = group.num_samples * (now - group.ready_time)
                self._unretired.append((group, now))
        self._step_groups.clear()
        query, hit = self.pool.kv_counters()
        reward_mean, solved_frac = reward_summary(list(self._step_rewards.values()))
        for task in self._step_rewards:
            del self._rewards[task]
        outcome = StepOutcome(start.step, executor.reports(start), kv_queries=query,
                              kv_hits=hit, reward_mean=reward_mean, solved_frac=solved_frac)
        self._apply(self.controller.step_done(outcome, now))

    def _retire(self, num_samples: int) -> None:
        """The window moved past ``num_samples`` samples: a dropped group's first (its Retire
        follows its GroupDropped), then trained groups in the order they trained; each trained
        one's place ends now."""
        dropped = min(num_samples, self._dropped_samples)
        self._dropped_samples -= dropped
        left = num_samples - dropped
        while left > 0 and self._unretired:
            group, trained_at = self._unretired.popleft()
            group.window.boundary_s = group.num_samples * (self.loop.now - trained_at)
            self._window.add(group.window)
            left -= group.num_samples

    # ---- the boundary ----

    def _boundary(self, boundary: Boundary) -> None:
        """The weight sync stalls the staying rollout engines (their KV is stale after it) and
        every member acknowledges once its own part is done: the broadcast, its role switch.
        (A boundary due while an evaluation runs comes once it is done: the step controller
        holds it.)"""
        now = self.loop.now
        sync_s = self._sync_s(boundary) if boundary.version > 0 else 0.0
        if sync_s > 0:
            for engine in self.pool.engines.values():
                engine.stall(now + sync_s)
                engine.kv.flush()
            self.controller.rollout.stalled(now, now + sync_s, len(self.pool.engines))
        for rank in boundary.members:
            src, dst = boundary.old_roles[rank], boundary.roles[rank]
            if src is not dst:
                self._spend({"role_switch": self.cost.role_switch_s(src, dst)})
            ready_at = now + max(sync_s, self.cost.role_switch_s(src, dst))
            self.loop.at(ready_at, self._on_ack, (rank, boundary.version))

    def _sync_s(self, boundary: Boundary) -> float:
        """The broadcast to every rollout rank after the boundary; a synchronous system's
        trainer then swaps its Actor out for the rollout engine and pays its framework's switch
        back to rollout (``colocate_switch_s``)."""
        targets = sum(1 for r in boundary.members if boundary.roles[r] is Role.ROLLOUT)
        sync_s = self.cost.weight_sync_s(targets, self.cross_node)
        if self.system.is_sync:
            return sync_s + self.swap_s + self.scenario.sim.colocate_switch_s
        return sync_s

    def _on_ack(self, payload: tuple[int, int]) -> None:
        rank, version = payload
        if self.controller.state.roles[rank] is Role.ROLLOUT and version > self.pool.version:
            self.pool.set_version(version)  # new turns start on the new weights
        self._apply(self.controller.boundary_acked(rank, version, self.loop.now))

    # ---- results ----

    def _spend(self, seconds: dict[str, float]) -> None:
        for key, value in seconds.items():
            self._device_s[key] = self._device_s.get(key, 0.0) + value

    def device_seconds(self, wall: float) -> dict[str, float]:
        """Every GPU-second of the run (N GPUs x ``wall``) by what it did; ``idle`` is the rest
        (docs/simulator.md, "Where the device-seconds go")."""
        engines = self.pool.all_engines()
        for engine in engines:
            engine.settle()
        by_group = self.pool.gpu_s_by_group
        out = dict.fromkeys(DEVICE_KEYS, 0.0)
        for group, seconds in by_group.items():
            key = ("rollout_eval" if group in self.pool.eval_groups else
                   "rollout_trained" if group in self._trained_groups else
                   "rollout_discarded" if group in self._dropped_groups else "rollout_unfinished")
            out[key] += seconds
        out["rollout_recompute"] = self.pool.recompute_s
        # the work of turns still running at the end is the unfinished groups' too
        busy = sum(e.decode_s + e.prefill_s for e in engines)
        out["rollout_unfinished"] += busy - sum(by_group.values()) - self.pool.recompute_s
        out["weight_sync"] = sum(e.sync_s for e in engines)
        for key, value in self._device_s.items():
            out[key] += value
        out["idle"] = self.scenario.sim.gpus * wall - sum(out.values())
        # what is left of float sums that cancel (a run with nothing unfinished) reads as zero
        tiny = 1e-9 * self.scenario.sim.gpus * max(wall, 1.0)
        return {k: 0.0 if abs(v) < tiny else v for k, v in out.items()}

    def _result(self) -> SimResult:
        c = self.controller
        records = c.ledger.records
        wall = records[-1].end_s if records else self.loop.now
        while self._unretired:  # the last step's: the run ends with it
            group, _ = self._unretired.popleft()
            self._window.add(group.window)
        query, hit = self.pool.kv_counters()
        decoded = sum(e.decoded_tokens for e in self.pool.all_engines())
        open_step = c.steps.current.tokens if c.steps.current is not None else 0
        in_flight = c.buffer.buffered_tokens + open_step + self.pool.finished_in_open_groups()
        policies: dict[str, object] = {"book": c.rollout.book, "tracker": c.tracker,
                                       "ctb" if self.system.uses_ctb else "request":
                                       c.rollout.policy}
        if c.ers is not None:
            policies["ers"] = c.ers
        return SimResult(
            system=self.system.label, scenario=self.scenario, wall_s=wall,
            device_s=self.device_seconds(wall),
            trained_tokens=c.ledger.trained_tokens, generated_tokens=self.pool.generated_tokens,
            discarded_tokens=c.buffer.discarded.tokens, in_flight_tokens=in_flight,
            decoded_tokens=decoded, goodput_tok_s=c.ledger.trained_tokens / wall if wall else 0.0,
            gen_tok_s=decoded / wall if wall else 0.0,
            kv_hit_rate=hit / query if query else 0.0, rwt_s=c.rollout.rwt.total,
            twt_s=sum(r.twt_s for r in records), num_events=self.loop.num_events,
            num_ctb_rounds=self.pool.num_rounds, steps=records, policies=policies,
            window=self._window, window_places=c.rollout.book.window.places)


DEVICE_KEYS = ("rollout_trained", "rollout_discarded", "rollout_eval", "rollout_unfinished",
               "rollout_recompute", "weight_sync", "ref", "actor", "swap",
               "colocate_switch", "role_switch", "idle")


@lru_cache(maxsize=8)
def stream_sampler(workload: str, seed: int, total_steps: int,
                   env_step: tuple[float, float] = (0.0, 0.0)) -> WorkloadSampler:
    return WorkloadSampler(workload, seed, total_steps, env_step)


@lru_cache(maxsize=1 << 16)
def training_group(workload: str, seed: int, total_steps: int, index: int, size: int,
                   batch: int, env_step: tuple[float, float]) -> tuple[TaskPlan, ...]:
    """Training group ``index`` of a task stream. A memo of a pure function (plans are frozen
    and a function of their arguments), so that the systems compared on one scenario draw the
    stream once: sampling is ~10% of a run."""
    sampler = stream_sampler(workload, seed, total_steps, env_step)
    return tuple(sampler.sample_group(f"g{index}", size, batch))

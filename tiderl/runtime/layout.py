"""The coordinator's layout half: which rank does what, and the post-update boundary.

Heartbeats and dead ranks, the RA2P mode of a step (from ERS's plan, or ``choose_mode`` without
ERS), ERS plans, and the ``SyncWeights`` boundary with its resend when a member died in it. A
mixin of :class:`tiderl.runtime.coordinator.Coordinator`, whose state it reads and updates.
"""

from __future__ import annotations

from msgspec.structs import replace as replace_struct

from tiderl.core.ers import ERSInput
from tiderl.core.ra2p import choose_mode, synthetic_ready_times
from tiderl.core.types import Mode, Ra2pTimings, Role, RoleChange
from tiderl.runtime import bus as b
from tiderl.runtime.groups import has_group
from tiderl.runtime.records import CoordinatorError, StepRun

TRAINER_ROLES = (Role.ACTOR, Role.REF)


class LayoutMixin:
    def _check_heartbeats(self) -> None:
        for rank in self.heartbeats.dead(self.now()):
            self._declare_dead(rank, "missed heartbeats")
        self._check_failed_boundaries()

    def _heartbeat_window(self) -> float:
        rt = self.profile.runtime
        return rt.heartbeat_s * (rt.heartbeat_misses + 1)

    def _check_failed_boundaries(self) -> None:
        """A failed broadcast goes out again without the member that died in it; one with
        every member alive past the heartbeat window is a real failure."""
        for version, (sent, deadline, error) in list(self.failed_boundaries.items()):
            if set(sent.members) & self.dead:
                del self.failed_boundaries[version]
                self._resend_boundary(sent)
            elif self.now() > deadline:
                raise CoordinatorError(f"the weight broadcast of version {version} failed with "
                                       f"every rank alive: {error}")

    def _declare_dead(self, rank: int, why: str) -> None:
        """A rollout rank's tasks go back to CTB (from scratch: their state died with it) and it
        leaves the broadcasts; a trainer rank's death stops the job."""
        if rank in self.dead:
            return
        self.dead.add(rank)
        self.event("rank_dead", rank=rank, role=self.roles[rank].value, why=why)
        if self.roles[rank] in TRAINER_ROLES or self.is_sync:
            raise CoordinatorError(f"trainer rank {rank} is gone ({why})")
        if rank in self.rollout_ready:
            self.rollout_ready.discard(rank)
            self.book.remove_rank(rank)
        for task_id, where in list(self.task_rank.items()):
            if where == rank and task_id in self.book.tasks:  # active or paused there
                self.carries[task_id] = None
                del self.task_rank[task_id]
                target = self.moves.pop(task_id, None)
                if target is not None:
                    self._move(task_id, target)
        self.roles[rank] = Role.IDLE
        self.syncing = {seq: r for seq, r in self.syncing.items() if r != rank}
        for seq in [q for q in self.boundary_sent if self._seq_rank.get(q) == rank]:
            del self.boundary_sent[seq]  # its answer will not come
        self._maybe_retire()
        self._maybe_start()

    def _step_layout(self) -> tuple[str, list[int], list[int]]:
        if self.is_sync:
            return "colocated", [], list(range(self.num_ranks))
        actors = [r for r, role in enumerate(self.roles) if role is Role.ACTOR]
        refs = [r for r, role in enumerate(self.roles) if role is Role.REF]
        if self.mode == "stream":
            return "vso", [], actors
        if self.mode == "async" or not refs:
            self.ra2p_mode = Mode.COLOCATED
            return "colocated", [], actors
        # ERS plans the layout and the mode together (its break-even is RA2P's cost model);
        # without ERS, RA2P chooses each step and a colocated step leaves the Ref ranks idle;
        # a held manual plan (tiderl rebalance) fixed both.
        if self.ers is None and not self.manual_hold:
            self.ra2p_mode = self._choose_mode(len(actors), len(refs))
        if self.ra2p_mode is Mode.DECOUPLED:
            return "decoupled", refs, actors
        return "colocated", [], actors

    def _choose_mode(self, num_actors: int, num_refs: int) -> Mode:
        """RA2P on the expected ready times (RAS now, the rest TPRM apart) and the measured
        per-micro-batch times of each layout (the other layout's until one is measured)."""
        config = self.profile.ra2p
        if config.mode != "auto":
            return Mode(config.mode)
        dec = self.timings.get("decoupled") or self.timings.get("colocated")
        col = self.timings.get("colocated") or dec
        if dec is None:
            return Mode.COLOCATED
        signals = self.tracker.signals(self.now())
        num_mbs = max(1, signals.ras, self._last_num_mbs())
        tprm = signals.tprm_s if signals.tprm_s is not None else self._mean_step_s() / num_mbs
        times = synthetic_ready_times(num_mbs, min(signals.ras, num_mbs), tprm)
        return choose_mode(times, dec, num_actors, config.max_aggregate, config,
                           colocated_timings=col)

    def _last_num_mbs(self) -> int:
        return self.records[-1]["num_micro_batches"] if self.records else 1

    def _mean_step_s(self) -> float:
        if not self.records:
            return 0.0
        return sum(r["step_s"] for r in self.records) / len(self.records)

    def _learn_timings(self, step: StepRun) -> None:
        stats = [d.stats for d in step.done.values()]

        def mean(key: str) -> float:
            values = [s[key] for s in stats if key in s]
            return sum(values) / len(values) if values else 0.0

        layout = "decoupled" if step.mode == "decoupled" else "colocated"
        self.timings[layout] = Ra2pTimings(mean("t_ref"), mean("t_act_f"), mean("t_act_b"),
                                           mean("t_swap"))

    # ---------------------------------------------------------------- ERS and the boundary

    def _plan_ers(self, is_launch: bool = False) -> None:
        assert self.ers is not None
        signals = self.tracker.signals(self.now())
        timings = self.timings.get("decoupled") or self.timings.get("colocated") or Ra2pTimings(
            0.0, 0.0, 0.0, 0.0)
        last = self.records[-1] if self.records else None
        idle = 0.0
        if last is not None and last["num_rollout"] and last["step_s"] > 0:
            idle = min(1.0, last["rwt_s"] / (last["num_rollout"] * last["step_s"]))
        inp = ERSInput(step=self.step, is_eval_step=self._is_eval_phase(), signals=signals,
                       step_duration_s=self._mean_step_s(), roles=tuple(self.roles),
                       mode=self.ra2p_mode, timings=timings,
                       num_micro_batches=max(1, self._last_num_mbs()), rollout_idle_frac=idle)
        plan = self.ers.plan(inp)
        self.last_plan_reason = plan.reason.value
        roles = self._planned_roles(plan.changes)
        refusal = self._layout_refusal(roles)
        if refusal is not None:
            self.event("plan_refused", reason=refusal, reason_plan=plan.reason.value)
            roles = list(self.roles)
        self.ra2p_mode = plan.mode
        if not is_launch:
            self.buffer.set_batch_size(self.step, plan.batch_size, self.now())
        self._boundary(roles=roles, reason=plan.reason.value)

    def _planned_roles(self, changes: tuple[RoleChange, ...]) -> list[Role]:
        roles = list(self.roles)
        for change in changes:
            roles[change.rank] = change.dst
        return roles

    def _layout_refusal(self, roles: list[Role]) -> str | None:
        """Why the runtime cannot run ``roles`` (an ERS or a manual plan), or None: its actor
        set has no process group, or the trainer backend cannot change its actor set."""
        actors = {r for r, role in enumerate(roles) if role is Role.ACTOR}
        old_actors = {r for r, role in enumerate(self.roles) if role is Role.ACTOR}
        if roles != self.roles and not has_group(actors, self.num_ranks):
            return f"no process group for actor set {sorted(actors)}"
        if actors != old_actors and self.profile.trainer.backend != "ddp":
            return f"trainer.backend {self.profile.trainer.backend} keeps its actor set"
        return None

    def _boundary(self, roles: list[Role] | None = None, reason: str | None = None,
                  checkpoint: bool = False) -> None:
        """Roles for the next step and the weight broadcast of the new version."""
        old = list(self.roles)
        new = roles if roles is not None else old
        old_actors = {r for r, role in enumerate(old) if role is Role.ACTOR or self.is_sync}
        new_actors = {r for r, role in enumerate(new) if role is Role.ACTOR or self.is_sync}
        keep = sorted(old_actors & new_actors)
        if not keep:
            raise CoordinatorError(f"a plan left no actor in place ({old} -> {new})")
        for rank, (src, dst) in enumerate(zip(old, new, strict=True)):
            if src is dst:
                continue
            self.event("role_change", rank=rank, src=src.value, dst=dst.value, step=self.step,
                       version=self.version, reason=reason)
            if src is Role.ROLLOUT and rank in self.rollout_ready:
                self.rollout_ready.discard(rank)
                for task_id in self.book.remove_rank(rank):
                    self.task_rank.pop(task_id, None)  # its carry comes back with TaskDetached
        self.roles = list(new)
        every = self.profile.trainer.checkpoint_every
        path = ""
        if checkpoint or (every and self.version % every == 0):
            path = str(self.run_dir / "checkpoints")
        members = [r for r in range(self.num_ranks) if r not in self.dead]
        self._send_boundary(b.SyncWeights(
            seq=0, version=self.version, src_rank=keep[0], roles=[r.value for r in new],
            members=members, joiners=sorted(new_actors - old_actors), checkpoint=path), old)

    def _send_boundary(self, sync: b.SyncWeights, old: list[Role]) -> None:
        self.boundary_old_roles = old
        for rank in sync.members:
            seq = self._next_seq()
            msg = replace_struct(sync, seq=seq)
            new = Role(sync.roles[rank])
            if new is Role.ROLLOUT and old[rank] is not Role.ROLLOUT:
                self.pending_rollout[seq] = rank
            if (new is Role.ROLLOUT or self.is_sync) and sync.version > 0:
                self.syncing[seq] = rank
            self.boundary_sent[seq] = msg
            self._seq_rank[seq] = rank
            self._send(rank, msg)

    def _resend_boundary(self, failed: b.SyncWeights) -> None:
        """Once per failed boundary: the same roles and version, the live members only."""
        members = [r for r in failed.members if r not in self.dead]
        if failed.version in self.resent_versions or not members:
            return
        self.resent_versions.add(failed.version)
        self.event("boundary_resent", version=failed.version, members=members)
        for seq in [s for s, m in self.boundary_sent.items() if m.version == failed.version]:
            del self.boundary_sent[seq]
            self.superseded.add(seq)
            self.syncing.pop(seq, None)
            self.pending_rollout.pop(seq, None)
        self.superseded.add(failed.seq)
        # the actors saved their checkpoint before the broadcast: not again
        self._send_boundary(replace_struct(failed, members=members, seq=0, checkpoint=""),
                            self.boundary_old_roles)

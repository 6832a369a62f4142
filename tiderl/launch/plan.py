"""The launch plan: profile -> the processes a job runs. Pure (no I/O), so it can be printed,
tested and, later, executed by the local or SSH executor.

    env service (unless env.url is set)   coordinator   rank 0 .. rank N-1 (one device each)

Initial roles: in mode ``sync`` every rank is one colocated set (it rolls out, then trains). In the
other modes ranks ``0..rollout_ranks-1`` start as rollout and the rest as trainer ranks: all actor
(Ref colocated) unless RA2P is pinned to ``decoupled``, which needs a dedicated ref rank. ERS may
move ranks from the first post-update boundary on.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiderl.core.types import Mode, Role
from tiderl.profile import Profile


@dataclass(frozen=True)
class ProcessSpec:
    name: str
    kind: str  # "env" | "coordinator" | "rank"
    host: str = "localhost"
    rank: int | None = None
    role: Role | None = None
    device: str | None = None
    threads: int | None = None


@dataclass(frozen=True)
class LaunchPlan:
    processes: tuple[ProcessSpec, ...]

    @property
    def ranks(self) -> tuple[ProcessSpec, ...]:
        return tuple(p for p in self.processes if p.kind == "rank")


def initial_roles(profile: Profile) -> list[Role]:
    rt = profile.runtime
    if rt.mode == "sync":
        return [Role.ROLLOUT] * rt.num_ranks
    num_trainer = rt.num_ranks - rt.rollout_ranks
    trainer = [Role.ACTOR] * num_trainer
    if profile.ra2p.mode == Mode.DECOUPLED.value and num_trainer >= 2:
        trainer[0] = Role.REF
    return [Role.ROLLOUT] * rt.rollout_ranks + trainer


def plan_local(profile: Profile) -> LaunchPlan:
    """Every process on this machine; rank r gets ``cuda:r`` on GPU profiles, else CPU threads."""
    rt = profile.runtime
    processes: list[ProcessSpec] = []
    if not profile.env.url:
        processes.append(ProcessSpec(name="env", kind="env"))
    processes.append(ProcessSpec(name="coordinator", kind="coordinator"))
    for rank, role in enumerate(initial_roles(profile)):
        device = f"cuda:{rank}" if rt.device == "cuda" else "cpu"
        threads = rt.threads_per_rank if rt.device == "cpu" else None
        processes.append(ProcessSpec(name=f"rank{rank}", kind="rank", rank=rank, role=role,
                                     device=device, threads=threads))
    return LaunchPlan(processes=tuple(processes))

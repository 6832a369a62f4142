"""The step cycle a profile asks the coordinator for: the profile's sections made into the
effective configuration of its system on this substrate."""

from __future__ import annotations

from tiderl.core.step_control import (
    LayoutLimits,
    StepControlConfig,
    Substrate,
    effective_config,
    effective_view,
)
from tiderl.core.system import System, SystemSpec
from tiderl.profile import Profile


def profile_step_config(profile: Profile) -> StepControlConfig:
    """The step cycle a profile asks the coordinator for (``runtime.system`` names the system),
    made by :func:`tiderl.core.step_control.effective_config` on this substrate: each rollout
    rank's engine holds ``engine.kv_cache_tokens``; without a KL term (``trainer.kl_beta`` 0) no
    step runs a Ref pass; the world's process groups and the trainer backend limit layouts; CPU
    ranks that roll out in their own process (the embedded engine), not pinned
    (``runtime.cpu_affinity: spread``), share their cores: a server backend's engine is its
    own."""
    rt, trainer = profile.runtime, profile.trainer
    substrate = Substrate(
        kv_tokens=profile.engine.kv_cache_tokens, max_new_tokens=profile.engine.max_new_tokens,
        kv_block_tokens=profile.engine.block_size,
        has_kl=trainer.kl_beta != 0, checkpoint_every=rt.checkpoint_every,
        export_every=trainer.export_every, tensor_parallel=trainer.tensor_parallel,
        limits=LayoutLimits(grouped_ranks=rt.num_ranks,
                            fixed_actor_backend="megatron" if trainer.backend == "megatron"
                            else "",
                            sharded_actor_backend="fsdp2" if trainer.backend == "fsdp2"
                            else ""),
        shared_cores=rt.device == "cpu" and rt.cpu_affinity == "none"
        and profile.engine.backend == "embedded")
    return effective_config(SystemSpec(System.parse(rt.system)), profile.job, profile.ctb,
                            profile.ra2p, profile.ers, substrate)


def profile_effective_view(profile: Profile) -> dict[str, object]:
    """What the profile's system runs on this substrate (:func:`effective_view`)."""
    return effective_view(profile_step_config(profile), profile.ctb, profile.ra2p, profile.ers)

"""A profile as the simulator sees it: its ``sim`` section, the job's shape and the core
policies' sections, one :class:`~tiderl.sim.scenario.SimScenario` (what ``tiderl sim`` runs)."""

from __future__ import annotations

from tiderl.core.config import ConfigError
from tiderl.core.ctb import CTBConfig
from tiderl.profile import Profile, ProfileError
from tiderl.sim.scenario import SimScenario


def scenario_of(profile: Profile) -> SimScenario:
    """The profile's scenario. The simulator's request-level engines run
    ``sim.request_concurrency`` requests per GPU (the policy's ``ctb.request_concurrency``
    follows them): a profile that sets the latter otherwise is refused in one line rather
    than simulated with a value it did not ask for."""
    asked, default = profile.ctb.request_concurrency, CTBConfig().request_concurrency
    if asked not in (default, profile.sim.request_concurrency):
        raise ProfileError(str(ConfigError(
            "ctb.request_concurrency", f"{asked}: the simulated engines run "
            f"sim.request_concurrency ({profile.sim.request_concurrency}) requests per GPU; "
            "set that instead")))
    return SimScenario(sim=profile.sim, job=profile.job, ctb=profile.ctb, ra2p=profile.ra2p,
                       ers=profile.ers)

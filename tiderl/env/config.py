"""Environment section of a profile."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from tiderl.core.config import (
    ConfigError,
    require,
    require_choice,
    require_non_negative,
    require_positive,
)
from tiderl.core.quote import short
from tiderl.core.segments import ImageWindow
from tiderl.serving.limits import ConnectionLimits

BUILTIN_ENVS = ("guess", "shop", "household", "calc", "gui")
LATENCY_KINDS = ("none", "fixed", "lognormal")


@dataclass(frozen=True)
class LatencyConfig:
    """Simulated environment time: none, a fixed delay, or lognormal with a median and sigma."""

    kind: str = "none"
    median_s: float = 0.0
    sigma: float = 0.0

    def __post_init__(self) -> None:
        require_choice(self.kind, LATENCY_KINDS, "kind")
        require_non_negative(self.median_s, "median_s")
        require_non_negative(self.sigma, "sigma")
        if self.kind != "none":
            require(self.median_s > 0, "median_s", f"expected > 0 for kind {short(self.kind)}")


@dataclass(frozen=True)
class AgentConfig:
    """One agent of ``env.agents``: exactly one of ``entry`` and ``command``."""

    entry: str = ""  # package.module:function, an async function (task, client) -> reward
    command: str = ""  # a command line (split as a shell would, run without one)

    def __post_init__(self) -> None:
        require(bool(self.entry) != bool(self.command), "entry",
                "expected exactly one of entry (package.module:function) and command")
        if self.entry:
            module, sep, name = self.entry.partition(":")
            require(bool(sep and module and name), "entry",
                    f"expected package.module:function, got {short(self.entry)}")
        else:
            try:
                argv = shlex.split(self.command)
            except ValueError as exc:
                raise ConfigError("command", f"cannot split {short(self.command)}: {exc}") \
                    from None
            require(bool(argv), "command", "expected a command line")


def _is_env_name(name: str) -> bool:
    """A built-in, a gymnasium or verifiers env (``gym:...``, ``verifiers:...``) or a dotted
    path (``pkg.mod:Class``)."""
    return name in BUILTIN_ENVS or name.startswith("gym:") or ":" in name or "." in name


@dataclass(frozen=True)
class EnvConfig:
    envs: list[str] = field(default_factory=lambda: ["guess"])
    url: str = ""  # empty: in-process environments (the embedded default)
    tasks: dict[str, str] = field(default_factory=dict)  # env name -> task text ("1 16")
    # env -> constructor kwargs (a verifiers env: its load_environment's)
    options: dict[str, dict[str, bool | int | float | str]] = field(default_factory=dict)
    max_turns: int = 20
    max_sessions: int = 256
    idle_ttl_s: float = 600.0
    request_timeout_s: float = 30.0  # one attempt of a rank's call to the service
    call_deadline_s: float = 60.0  # one call with its retries: past it the task fails
    step_latency: LatencyConfig = field(default_factory=LatencyConfig)
    start_latency: LatencyConfig = field(default_factory=LatencyConfig)
    # screenshots in a context: on reaching ``limit``, the newest ``keep`` stay and a new
    # training segment starts (paper App. C.2: 10 and 5; tiderl.core.segments)
    image_window: ImageWindow = field(default_factory=ImageWindow)
    # the service's bounds on a request's arrival and a client's connections
    connections: ConnectionLimits = field(default_factory=ConnectionLimits)
    # agents written against the OpenAI / Anthropic API, by name (tiderl.env.agents): listed
    # in ``envs`` like environments; each task's agent gets this long, from its start to its end
    agents: dict[str, AgentConfig] = field(default_factory=dict)
    agent_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        require(bool(self.envs), "envs", "expected at least one environment")
        if not self.url:
            for i, name in enumerate(self.envs):
                require(name in self.agents or _is_env_name(name), f"envs[{i}]",
                        f"expected a built-in environment ({', '.join(BUILTIN_ENVS)}), "
                        "gym:ENV_ID, verifiers:ENV_ID, a dotted path to an Environment "
                        f"subclass (module:Class) or an agent of env.agents, got {short(name)}")
        for section in ("tasks", "options"):
            for name in getattr(self, section):
                require(name in self.envs, f"{section}.{name}",
                        f"expected one of the envs ({', '.join(self.envs)})")
        require_positive(self.max_turns, "max_turns")
        require_positive(self.max_sessions, "max_sessions")
        require_positive(self.idle_ttl_s, "idle_ttl_s")
        require_positive(self.request_timeout_s, "request_timeout_s")
        require_positive(self.call_deadline_s, "call_deadline_s")
        require_positive(self.agent_timeout_s, "agent_timeout_s")
        for name in self.agents:
            require(name in self.envs, f"agents.{name}",
                    f"an agent runs only when env.envs lists it ({', '.join(self.envs)})")

"""Profiles: YAML files validated into typed config dataclasses, with ``--set`` overrides.

Each section's dataclass lives beside its component (``tiderl/engine/config.py``, ...; the
runtime's in :mod:`tiderl.profile.sections`) and checks its own values; this module maps YAML
onto those types and names the full key path in each error:

    profiles/x.yaml: ctb.weights.eval: expected float, got 'high'

The ``job`` section is the job's shape (:class:`tiderl.core.job.JobShape`), read by the runtime
and the simulator alike. Keys that moved are still read under their old names
(:mod:`tiderl.profile.aliases`).
"""

from __future__ import annotations

import copy
import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import yaml

from tiderl.core.config import ConfigError, require
from tiderl.core.ctb import CTBConfig
from tiderl.core.ers import ERSConfig
from tiderl.core.job import JobShape
from tiderl.core.quote import cut, short
from tiderl.core.ra2p import RA2PConfig
from tiderl.core.system import System
from tiderl.engine.config import EngineConfig
from tiderl.env.config import EnvConfig
from tiderl.models.config import ModelConfig
from tiderl.profile.aliases import SAMPLE_ALIASES, Samples, move_old_keys, new_key, to_groups
from tiderl.profile.sections import LoggingConfig, ReportConfig, RuntimeConfig
from tiderl.sim.config import SimConfig
from tiderl.trainer.config import TrainerConfig

DEFAULT_PROFILE = "local"
_REPO_PROFILES = Path(__file__).resolve().parents[2] / "profiles"


@dataclass(frozen=True)
class Profile:
    """A whole job's configuration: its shape, then one section per component."""

    job: JobShape = field(default_factory=JobShape)
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    ctb: CTBConfig = field(default_factory=CTBConfig)
    ra2p: RA2PConfig = field(default_factory=RA2PConfig)
    ers: ERSConfig = field(default_factory=ERSConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    sim: SimConfig = field(default_factory=SimConfig)

    def __post_init__(self) -> None:
        engine = self.engine
        if engine.urls:
            n = self.runtime.num_ranks
            require(len(engine.urls) == n, "engine.urls",
                    f"expected one server URL per rank (runtime.num_ranks {n}), "
                    f"got {len(engine.urls)}")
        if engine.backend in ("vllm", "sglang"):
            require(bool(self.model.path), "model.path",
                    f"engine.backend {engine.backend} serves an HF folder: set model.path "
                    "(tiderl model init makes one)")
            # vLLM has a CPU backend (`make vllm-cpu` builds it); SGLang's servers need GPUs
            require(engine.backend == "vllm" or bool(engine.urls)
                    or self.runtime.device == "cuda", "runtime.device",
                    f"engine.backend {engine.backend} starts its servers on GPUs: set "
                    "runtime.device=cuda (or attach running servers with engine.urls)")
        require(self.trainer.backend != "megatron" or self.runtime.device == "cuda",
                "runtime.device", "trainer.backend megatron runs on GPUs only (megatron-core's "
                "forward needs CUDA): set runtime.device=cuda, or use ddp or fsdp2")
        tp, rt = self.trainer.tensor_parallel, self.runtime
        require(not rt.replay or engine.backend == "embedded", "runtime.replay",
                f"a replay rolls out nothing and starts no engine server: set "
                f"engine.backend=embedded (it is {engine.backend})")
        if tp > 1:  # megatron's TP groups are blocks of consecutive ranks: actors fill blocks
            for name in ("num_ranks", "rollout_ranks"):
                require(getattr(rt, name) % tp == 0, f"runtime.{name}",
                        f"expected a multiple of trainer.tensor_parallel ({tp}), "
                        f"got {getattr(rt, name)}")
            require(self.ra2p.placement == "colocated" or rt.system != "tiderl",
                    "ra2p.placement",
                    "trainer.tensor_parallel > 1 runs the Ref beside its actors: set "
                    "ra2p.placement=colocated (a Ref rank of its own would need a TP group)")


class ProfileError(ConfigError):
    """A profile that cannot be used; the message is one line naming the source and key (a
    ConfigError whose key is already in the message, so a caller catches both as one)."""

    def __init__(self, message: str):
        super().__init__("", message)


# --------------------------------------------------------------------------- public API


def resolve_profile_path(name: str) -> Path:
    """A profile by path, or by name (``local``, ``sim/fig8``) in ./profiles/ or the source
    checkout's profiles/."""
    path = Path(name)
    if _path_is(path, Path.is_file):
        return path
    if path.suffix in (".yaml", ".yml"):
        raise ProfileError(f"{cut(name)}: no such profile file")
    candidates = list(dict.fromkeys(  # an absolute name is the same path under either folder
        [Path("profiles") / f"{name}.yaml", _REPO_PROFILES / f"{name}.yaml"]))
    for candidate in candidates:
        if _path_is(candidate, Path.is_file):
            return candidate
    if _path_is(path, Path.is_dir):
        raise ProfileError(f"{cut(name)}: a folder, not a profile file (give a YAML file or a "
                           "profile name)")
    raise ProfileError(f"profile {short(name)} not found "
                       f"(looked for {', '.join(cut(str(c)) for c in candidates)})")


def _path_is(path: Path, kind: typing.Callable[[Path], bool]) -> bool:
    """``kind(path)`` (``Path.is_file``, ``Path.is_dir``); False for a name the system refuses
    (too long for a file name)."""
    try:
        return kind(path)
    except OSError:
        return False


def load_profile(name: str = DEFAULT_PROFILE, overrides: typing.Sequence[str] = ()) -> Profile:
    """Load a profile file and apply ``key.path=value`` overrides, validating both."""
    path = resolve_profile_path(name)
    data = _read_yaml(path)
    try:
        move_old_keys(data)
    except ConfigError as err:
        raise ProfileError(f"{path}: {err}") from None
    build_profile(data, source=str(path))  # errors in the file itself name the file
    for item in overrides:
        _apply_override(data, item)
    return build_profile(data, source="--set" if overrides else str(path))


def build_profile(data: dict[str, Any], source: str = "<profile>") -> Profile:
    try:
        data = copy.deepcopy(data)
        move_old_keys(data)
        to_groups(data)
        _check_rank_split(data)
        return _build(Profile, data, "")
    except ConfigError as err:
        raise ProfileError(f"{source}: {err}") from None


def profile_to_dict(profile: Profile) -> dict[str, Any]:
    """Plain data (str enums as values) for printing or JSON."""
    return _plain(dataclasses.asdict(profile))


def _check_rank_split(data: Any) -> None:
    """Say in a user's terms why runtime's ranks cannot split into rollout and trainer ranks,
    naming the key to change (RuntimeConfig's own check, which stays for configs built in code,
    only names rollout_ranks: ``expected 1..0``). Values of the wrong type are left to it."""
    runtime = data.get("runtime") if isinstance(data, dict) else None
    if not isinstance(runtime, dict):
        return
    defaults = RuntimeConfig()
    num_ranks = runtime.get("num_ranks", defaults.num_ranks)
    rollout = runtime.get("rollout_ranks", defaults.rollout_ranks)
    try:
        system = System.parse(str(runtime.get("system", defaults.system))).value
    except ConfigError:
        return
    if type(num_ranks) is not int or type(rollout) is not int or num_ranks < 1:
        return
    if system == System.SYNC.value:
        require(rollout == num_ranks, "runtime.rollout_ranks",
                f"system sync rolls out and trains on every rank: set runtime.rollout_ranks="
                f"{num_ranks} (runtime.num_ranks), got {rollout}")
        return
    require(num_ranks >= 2, "runtime.num_ranks",
            f"1 rank cannot split into rollout and trainer ranks: system {system} needs at least "
            "2, e.g. runtime.num_ranks=2 with runtime.rollout_ranks=1")
    span = "=1" if num_ranks == 2 else f" to 1..{num_ranks - 1}"
    fix = f"set runtime.rollout_ranks{span} (the other ranks train)"
    require(rollout < num_ranks, "runtime.rollout_ranks",
            f"{rollout} rollout ranks of runtime.num_ranks={num_ranks} leave no trainer rank: "
            f"{fix}")
    require(rollout >= 1, "runtime.rollout_ranks",
            f"a job needs at least 1 rollout rank, got {rollout}: {fix}")


# --------------------------------------------------------------------------- YAML and overrides


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except (UnicodeDecodeError, yaml.reader.ReaderError):  # not UTF-8, or control characters
        raise ProfileError(f"{path}: not a YAML text file (it holds bytes that are not text)"
                           ) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or "cannot parse"
        raise ProfileError(f"{path}: invalid YAML{where}: {problem}") from None
    except OSError as err:
        raise ProfileError(f"{path}: {err.strerror}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ProfileError(f"{path}: expected a mapping of sections, got {_type_name(data)}")
    return data


def _apply_override(data: dict[str, Any], item: str) -> None:
    """Set ``a.b.c=value`` into ``data``; the value is parsed as YAML unless the key is a string."""
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise ProfileError(f"--set {cut(item)}: expected key=value, e.g. ctb.budget_fraction=0.8")
    old, key = key, new_key(key)
    parts = key.split(".")
    tp: Any = Profile
    node = data
    for depth, part in enumerate(parts):
        known = _fields(tp) if dataclasses.is_dataclass(tp) else None
        if known is None or part not in known:
            where = ".".join(parts[: depth + 1])
            listed = (f"known: {', '.join(known)}" if known is not None
                      else f"{'.'.join(parts[:depth])} is a value, not a section")
            raise ProfileError(f"--set {cut(key)}: unknown key {short(where)} ({listed})")
        tp = known[part]
        if depth < len(parts) - 1:
            child = node.get(part)
            node = node.setdefault(part, {}) if not isinstance(child, dict) else child
    value = raw if tp is str else _parse_scalar(raw, key)
    node[parts[-1]] = Samples(value) if old in SAMPLE_ALIASES and type(value) is int else value


def _parse_scalar(raw: str, key: str) -> Any:
    try:
        return yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError:
        raise ProfileError(f"--set {key}: cannot parse value {short(raw)}") from None


# --------------------------------------------------------------------------- typed conversion


def _fields(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def _build(cls: type, data: Any, key: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(key, f"expected a mapping, got {_describe(data)}")
    known = _fields(cls)
    for name in data:
        if name not in known:
            raise ConfigError(_join(key, cut(str(name))),
                              f"unknown key (known: {', '.join(known)})")
    kwargs = {name: _convert(known[name], value, _join(key, name)) for name, value in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError as err:
        raise err.under(key) if key else err from None


def _convert(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key)
    if origin in (typing.Union, types.UnionType):
        return _convert_union(typing.get_args(tp), value, key)
    if origin is list:
        (item,) = typing.get_args(tp)
        _expect(isinstance(value, list), key, "list", value)
        return [_convert(item, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        key_tp, val_tp = typing.get_args(tp)
        _expect(isinstance(value, dict), key, "mapping", value)
        return {_convert(key_tp, k, key): _convert(val_tp, v, _join(key, cut(str(k))))
                for k, v in value.items()}
    if origin is typing.Literal:
        choices = typing.get_args(tp)
        require(value in choices, key, f"expected one of {choices}, got {short(value)}")
        return value
    if isinstance(tp, type) and issubclass(tp, Enum):
        choices = tuple(m.value for m in tp)
        require(value in choices, key, f"expected one of {choices}, got {short(value)}")
        return tp(value)
    return _convert_scalar(tp, value, key)


def _convert_union(args: tuple[Any, ...], value: Any, key: str) -> Any:
    if value is None and type(None) in args:
        return None
    errors = []
    for arg in (a for a in args if a is not type(None)):
        try:
            return _convert(arg, value, key)
        except ConfigError as err:
            errors.append(err.message)
    raise ConfigError(key, " or ".join(errors))


MAX_INT = 2**63 - 1  # msgpack's and JSON readers' int64
_EXPONENT = re.compile(r"[-+]?\d+(\.\d*)?[eE][-+]?\d+")


def _convert_scalar(tp: Any, value: Any, key: str) -> Any:
    if tp is bool:
        _expect(isinstance(value, bool), key, "bool", value)
    elif tp is int:
        _expect(isinstance(value, int) and not isinstance(value, bool), key, "int", value)
        require(-MAX_INT - 1 <= value <= MAX_INT, key,
                f"expected an int from {-MAX_INT - 1} to {MAX_INT} (what job.json and the "
                f"bus carry), got {short(value)}")
    elif tp is float:
        if isinstance(value, str) and _EXPONENT.fullmatch(value):
            return float(value)  # YAML 1.1 reads 1e-2 (no dot) as a string
        _expect(isinstance(value, (int, float)) and not isinstance(value, bool), key, "float",
                value)
        return float(value)
    elif tp is str:
        _expect(isinstance(value, str), key, "str", value)
    elif tp is Any:
        return value
    else:
        raise ConfigError(key, f"unsupported config type {tp!r}")
    return value


def _expect(ok: bool, key: str, expected: str, value: Any) -> None:
    if not ok:
        raise ConfigError(key, f"expected {expected}, got {_describe(value)}")


def _describe(value: Any) -> str:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return short(value)
    return _type_name(value)


def _type_name(value: Any) -> str:
    return {dict: "a mapping", list: "a list"}.get(type(value), type(value).__name__)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _plain(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value

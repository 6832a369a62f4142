"""Old key paths a user may still type, in a profile file or after ``--set``: each names a key
that moved. A file's old keys move to their new place when it is read; an override of an old
key sets the new one. The batch bounds once given in samples (``ers.batch_ideal``) become
groups of ``job.group_size`` once the whole profile is known, and must be whole groups.

A key given under both its old and its new name in one file is refused in one line, as is a
sample count that is not a multiple of the group size.
"""

from __future__ import annotations

from typing import Any

from tiderl.core.config import ConfigError, require
from tiderl.core.job import JobShape

ALIASES: dict[str, str] = {
    "runtime.mode": "runtime.system",
    "ra2p.mode": "ra2p.placement",
    **{f"runtime.{k}": f"job.{k}" for k in ("steps", "group_size", "max_staleness",
                                             "eval_every", "eval_groups")},
    **{f"sim.{k}": f"job.{k}" for k in ("steps", "group_size", "batch_groups",
                                         "batch_min_groups", "max_staleness", "eval_every",
                                         "eval_groups", "eval_group_size")},
}
SAMPLE_ALIASES: dict[str, str] = {"ers.batch_ideal": "job.batch_groups",
                                  "ers.batch_min": "job.batch_min_groups"}


class Samples(int):
    """A batch bound given in samples (under its old key), turned into groups at build."""


def new_key(key: str) -> str:
    """The key ``key`` names now (itself unless it moved)."""
    return ALIASES.get(key) or SAMPLE_ALIASES.get(key) or key


def move_old_keys(data: dict[str, Any]) -> None:
    """Move every old key of ``data`` (a profile file's mapping) to its new place."""
    for old in (*ALIASES, *SAMPLE_ALIASES):
        section, name = old.split(".")
        node = data.get(section)
        if not isinstance(node, dict) or name not in node:
            continue
        value = node.pop(name)
        if not node:
            del data[section]
        new = new_key(old)
        new_section, new_name = new.split(".")
        target = data.setdefault(new_section, {})
        if not isinstance(target, dict):
            raise ConfigError(new_section, "expected a mapping")
        if new_name in target:
            raise ConfigError(old, f"is the old name of {new}, which is set too: keep one")
        target[new_name] = Samples(value) if old in SAMPLE_ALIASES and type(value) is int \
            else value


def to_groups(data: dict[str, Any]) -> None:
    """The batch bounds given in samples, as groups of the profile's ``job.group_size``."""
    job = data.get("job")
    if not isinstance(job, dict):
        return
    group_size = job.get("group_size", JobShape().group_size)
    for name in ("batch_groups", "batch_min_groups"):
        value = job.get(name)
        if isinstance(value, Samples) and type(group_size) is int and group_size > 0:
            old = next(k for k, v in SAMPLE_ALIASES.items() if v == f"job.{name}")
            require(value % group_size == 0, old,
                    f"expected a multiple of job.group_size ({group_size}), got {int(value)}")
            job[name] = int(value) // group_size

"""Validation helpers shared by every typed config dataclass.

A config dataclass validates itself in ``__post_init__`` and raises :class:`ConfigError` naming the
field; the profile loader prefixes the section path, so a user sees ``ctb.weights.eval: ...``.
"""

from __future__ import annotations

from tiderl.core.quote import short


class ConfigError(ValueError):
    """An invalid configuration value; ``key`` is the dotted path below the object that raised."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}" if key else message)
        self.key = key
        self.message = message

    def under(self, prefix: str) -> ConfigError:
        """The same error, seen from the object that holds this one under ``prefix``."""
        return ConfigError(f"{prefix}.{self.key}" if self.key else prefix, self.message)


def require(condition: bool, key: str, message: str) -> None:
    if not condition:
        raise ConfigError(key, message)


def require_positive(value: float, key: str) -> None:
    require(value > 0, key, f"expected a positive number, got {short(value)}")


def require_non_negative(value: float, key: str) -> None:
    require(value >= 0, key, f"expected a number >= 0, got {short(value)}")


def require_fraction(value: float, key: str) -> None:
    require(0.0 <= value <= 1.0, key, f"expected a number in [0, 1], got {short(value)}")


def require_int(value: object, key: str, minimum: int) -> None:
    """An int (not a bool) of at least ``minimum``; for configs built in code, not from YAML."""
    is_int = isinstance(value, int) and not isinstance(value, bool)
    require(is_int and value >= minimum, key,
            f"expected an integer >= {minimum}, got {short(value)}")


def require_choice(value: object, choices: tuple[object, ...], key: str) -> None:
    require(value in choices, key,
            f"expected one of {', '.join(map(str, choices))}, got {short(value)}")

"""The environment registry: a name -> a fresh :class:`~tiderl.env.base.Environment`.

:func:`make_env` builds one by name: a built-in (:data:`ENV_NAMES`), ``gym:ENV_ID`` or
``gym:module:factory`` (a gymnasium env with text actions, see
:mod:`tiderl.env.gym_adapter`), ``verifiers:ENV_ID`` or ``verifiers:module:factory`` (a
verifiers multi-turn environment, see :mod:`tiderl.env.verifiers_adapter`), or a dotted path
``package.module:ClassName`` / ``package.module.ClassName`` naming a subclass of
:class:`Environment` (such as a :class:`tiderl.env.tools.ToolEnvironment`).

The built-ins and the adapters import the contract (:mod:`tiderl.env.base`), never this module;
it imports them: a built-in by its path, an adapter when a name asks for it.
"""

from __future__ import annotations

import importlib
from typing import Any

from tiderl.core.quote import short
from tiderl.env.base import Environment, UnknownEnvironment

ENV_NAMES: tuple[str, ...] = ("guess", "shop", "household", "calc", "gui")

_BUILTIN_PATHS = {
    "guess": "tiderl.env.guess:GuessEnv",
    "shop": "tiderl.env.shop:ShopEnv",
    "household": "tiderl.env.household:HouseholdEnv",
    "calc": "tiderl.env.calc:CalcEnv",
    "gui": "tiderl.env.gui:GuiEnv",
}


def _load_object(path: str) -> Any:
    """``package.module:attr`` or ``package.module.attr`` → the object."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise UnknownEnvironment(f"unknown environment {short(path)}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UnknownEnvironment(f"unknown environment {short(path)}: {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError as exc:
        raise UnknownEnvironment(f"unknown environment {short(path)}: no {short(attr)} in "
                                 f"{module_name}") from exc


def make_env(name: str, *, max_turns: int = 20, options: dict[str, Any] | None = None
             ) -> Environment:
    """Build a fresh environment (no episode yet) from a registry name or dotted path;
    ``options`` are its constructor's keyword arguments (``env.options`` of a profile)."""
    if name.startswith("gym:"):
        from tiderl.env.gym_adapter import make_gym_env

        if options:
            raise UnknownEnvironment(f"{name}: gymnasium environments take no options")
        return make_gym_env(name[len("gym:"):], max_turns=max_turns)
    if name.startswith("verifiers:"):
        from tiderl.env.verifiers_adapter import make_verifiers_env

        return make_verifiers_env(name[len("verifiers:"):], max_turns=max_turns,
                                  options=options)
    path = _BUILTIN_PATHS.get(name)
    if path is None and "." not in name and ":" not in name:
        raise UnknownEnvironment(
            f"unknown environment {short(name)}; expected one of {', '.join(ENV_NAMES)}, "
            "gym:ENV_ID, gym:module:factory, verifiers:ENV_ID, verifiers:module:factory or a "
            "dotted path to an Environment subclass")
    cls = _load_object(path or name)
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise UnknownEnvironment(f"{short(name)} is not a subclass of tiderl.env.base.Environment")
    try:
        return cls(max_turns=max_turns, **(options or {}))
    except TypeError as exc:  # an option the environment does not have
        raise UnknownEnvironment(f"{name}: bad options {options}: {exc}") from None

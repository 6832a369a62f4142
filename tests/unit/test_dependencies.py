"""Every third-party module imported under tiderl/ is declared in pyproject.toml: one imported
when its module is (at module level, not under ``try`` or ``if``) in ``[project] dependencies``,
which is all `make run` installs; one imported late or guarded (an optional backend) there or in
an extra other than ``dev``, which only `make test` installs. Every one the tests import is in
the dependencies or the dev extra. An extra may name others (``tiderl[logging,gym]``): it holds
theirs too. Import names map to distributions through the installed packages' metadata (``yaml``
is PyYAML); a module not installed here is looked up by its own name (``flash_attn`` is
flash-attn)."""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[2]
LOCAL = ("tiderl", "tests", "bench", "tools")  # the repository's own packages
LATE = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Try, ast.If)  # import not run, or guarded


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_names(requirements: list[str]) -> set[str]:
    return {_normalize(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", r).group()) for r in requirements}


def _imports(node: ast.AST, is_eager: bool = True) -> Iterator[tuple[str, bool, int]]:
    """(top-level module, is_eager, line) of every import under ``node``, with
    ``importlib.import_module("name")`` as a late one."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import):
            for alias in child.names:
                yield alias.name.split(".")[0], is_eager, child.lineno
        elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
            yield child.module.split(".")[0], is_eager, child.lineno
        elif (isinstance(child, ast.Call) and ast.unparse(child.func).endswith("import_module")
              and child.args and isinstance(child.args[0], ast.Constant)
              and isinstance(child.args[0].value, str)):
            yield child.args[0].value.split(".")[0], False, child.lineno
        yield from _imports(child, is_eager and not isinstance(child, LATE))


@functools.cache  # one scan of each folder per session (a few seconds each)
def third_party_imports(folder: str = "tiderl") -> dict[str, list[tuple[str, bool]]]:
    """{module: [(file:line, is_eager)]} over ``folder``; in tests, ``pytest.importorskip("x")``
    is a late import of x."""
    found: dict[str, list[tuple[str, bool]]] = {}
    for path in sorted((ROOT / folder).rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for module, is_eager, line in [*_imports(tree), *_skipped_unless(tree)]:
            if module not in sys.stdlib_module_names and module not in LOCAL:
                where = f"{path.relative_to(ROOT)}:{line}"
                found.setdefault(module, []).append((where, is_eager))
    return found


def _skipped_unless(tree: ast.AST) -> Iterator[tuple[str, bool, int]]:
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and ast.unparse(node.func).endswith("importorskip")
                and node.args and isinstance(node.args[0], ast.Constant)):
            yield node.args[0].value.split(".")[0], False, node.lineno


@functools.cache
def _installed() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def distributions(module: str) -> set[str]:
    names = _installed().get(module) or [module]
    return {_normalize(name) for name in names}


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def extras() -> dict[str, set[str]]:
    """Each extra's requirement names, an extra that names others (``tiderl[a,b]``) with
    theirs."""
    raw = _project().get("optional-dependencies", {})

    def names(extra: str, seen: frozenset[str]) -> set[str]:
        out: set[str] = set()
        for requirement in raw[extra]:
            named = re.match(r"tiderl\[([^\]]+)\]", requirement)
            if named is None:
                out |= _requirement_names([requirement])
                continue
            for other in (e.strip() for e in named.group(1).split(",")):
                assert other in raw and other not in seen, f"{extra}: tiderl[{other}]"
                out |= names(other, seen | {other})
        return out
    return {extra: names(extra, frozenset({extra})) for extra in raw}


def declared() -> tuple[set[str], set[str]]:
    """(the dependencies, the dependencies and every extra but dev)."""
    required = _requirement_names(_project()["dependencies"])
    optional = set().union(*(names for extra, names in extras().items() if extra != "dev"))
    return required, required | optional


def test_the_scan_sees_the_imports_it_is_about():
    found = third_party_imports()
    assert ("tiderl/engine/server.py", True) in {(w.split(":")[0], e) for w, e in found["pydantic"]}
    assert all(not is_eager for _, is_eager in found["flash_attn"])  # under try
    assert "gymnasium" in found  # importlib.import_module("gymnasium")
    assert distributions("yaml") == {"pyyaml"} and distributions("zmq") == {"pyzmq"}


def test_every_module_imported_at_import_time_is_a_dependency():
    required, _ = declared()
    missing = {module: [w for w, is_eager in sites if is_eager]
               for module, sites in third_party_imports().items()
               if any(is_eager for _, is_eager in sites) and not distributions(module) & required}
    assert not missing, f"imported at module level, not in [project] dependencies: {missing}"


def test_every_late_or_guarded_import_is_declared():
    _, anywhere = declared()
    missing = {module: [w for w, _ in sites] for module, sites in third_party_imports().items()
               if not distributions(module) & anywhere}
    assert not missing, f"imported, declared neither in dependencies nor in an extra: {missing}"


def test_an_extra_that_names_others_holds_their_requirements():
    every = extras()
    assert every["logging"] == {"tensorboard", "wandb"}
    assert every["logging"] | every["gym"] | every["megatron"] <= every["dev"]
    assert "tiderl" not in set().union(*every.values())


def test_make_test_installs_every_module_the_tests_import():
    """`make test` installs the dependencies and the dev extra: a test never fails, or skips, for
    a module that only another extra (or nothing) would bring."""
    required, _ = declared()
    installed = required | extras()["dev"]
    missing = {module: [w for w, _ in sites]
               for module, sites in third_party_imports("tests").items()
               if not distributions(module) & installed}
    assert not missing, f"imported by tests, in neither the dependencies nor dev: {missing}"

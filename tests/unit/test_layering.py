"""Imports point downwards and go round no circle (DESIGN.md section 2), read from the source.

Every module under tiderl/ is parsed with ``ast``; each import statement, at module level, in a
function or under ``if TYPE_CHECKING:``, is an edge from the importing module to the imported
one (``from tiderl.x import name`` to ``tiderl.x.name`` where that is a module, else to
``tiderl.x``; relative imports resolved). A module's layer is its first name under ``tiderl``,
and the layers stand in this order (:data:`LAYERS`, highest first):

    cli
    launch
    runtime
    profile                 the module tiderl/profile.py
    engine    trainer
    models    examples      (examples: agents written against the API, above the env they use)
    env       sim       examples    (examples: agents written against the API, env's users)
    tiderl    auth          the package root (its version string), the HTTP tokens,
              serving       what the HTTP servers share (connection bounds, uvicorn) and the
              ports         ports picked to listen on: they import only core (auth its
                            error-line bound), and env, engine, trainer and launch use them;
                            below env, and not core, which does no I/O (auth reads key files)
    core

A module may import its own layer's package and any lower layer; never a higher one, nor the
other package of its own layer. No chain of imports comes back to where it started.
"""

from __future__ import annotations

import ast
import functools
from collections import deque
from collections.abc import Container, Iterator, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

LAYERS: tuple[tuple[str, ...], ...] = (  # lowest first
    ("core",),
    ("tiderl", "auth", "serving", "ports"),
    ("env", "sim"),
    ("models", "examples"),
    ("engine", "trainer"),
    ("profile",),
    ("runtime",),
    ("launch",),
    ("cli",),
)
LEVEL = {part: level for level, parts in enumerate(LAYERS) for part in parts}

Graph = Mapping[str, set[str]]


def module_paths(package: Path) -> dict[str, Path]:
    """{dotted module name: file} of every module under ``package`` (a package is its
    ``__init__``)."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imported_modules(tree: ast.AST, module: str, is_package: bool,
                     modules: Container[str]) -> Iterator[str]:
    """The tiderl modules ``tree`` (the source of ``module``) imports anywhere in its body."""
    package = (module if is_package else module.rpartition(".")[0]).split(".")
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names
                        if alias.name.split(".")[0] == "tiderl")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # from . import x: this package; from .. import x: its parent
                parts = package[:len(package) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            if base.split(".")[0] != "tiderl":
                continue
            for alias in node.names:
                name = f"{base}.{alias.name}"
                yield name if name in modules else base


def import_graph(package: Path) -> dict[str, set[str]]:
    """{module: the modules it imports} over ``package`` (a module importing itself is no
    edge)."""
    paths = module_paths(package)
    graph = {}
    for module, path in paths.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        graph[module] = set(imported_modules(tree, module, is_package, paths)) - {module}
    return graph


@functools.cache
def project_graph() -> dict[str, set[str]]:
    return import_graph(ROOT / "tiderl")


def layer(module: str) -> str:
    """``tiderl.runtime.bus.keys`` -> ``runtime``; the package root is ``tiderl``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def unplaced(graph: Graph) -> list[str]:
    return sorted(m for m in {*graph, *set().union(*graph.values())} if layer(m) not in LEVEL)


def upward_imports(graph: Graph) -> list[str]:
    """``a -> b`` for each import of a higher layer."""
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                  if LEVEL[layer(b)] > LEVEL[layer(a)])


def sibling_imports(graph: Graph) -> list[str]:
    """``a -> b`` for each import of the other package of the same layer (env and sim, engine
    and trainer)."""
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                  if layer(a) != layer(b) and LEVEL[layer(b)] == LEVEL[layer(a)])


def strongly_connected(graph: Graph) -> list[list[str]]:
    """Tarjan's components of more than one module, each sorted, in order of their first
    module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(start: str) -> None:  # iterative: an import chain may be deep
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while (member := stack.pop()) != node:
                        component.append(member)
                        on_stack.discard(member)
                    on_stack.discard(node)
                    component.append(node)
                    if len(component) > 1:
                        components.append(sorted(component))
            elif target not in index:
                index[target] = low[target] = len(index)
                stack.append(target)
                on_stack.add(target)
                work.append((target, iter(sorted(graph.get(target, ())))))
            elif target in on_stack:
                low[node] = min(low[node], index[target])

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(components)


def shortest_cycle(graph: Graph, component: list[str]) -> list[str]:
    """The shortest import chain from the component's first module back to itself."""
    start, members = component[0], set(component)
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for target in sorted(graph.get(node, ())):
            if target == start:
                chain = [node]
                while chain[-1] != start:
                    chain.append(came_from[chain[-1]])
                return [*reversed(chain), start]
            if target in members and target not in came_from:
                came_from[target] = node
                queue.append(target)
    raise AssertionError(f"{component} is no strongly connected component")


def circles(graph: Graph) -> list[str]:
    """One line per import circle: a shortest cycle through it, and every module caught in it
    when there are more."""
    lines = []
    for component in strongly_connected(graph):
        cycle = shortest_cycle(graph, component)
        line = " -> ".join(cycle)
        if len(component) > len(cycle) - 1:
            line += f"  (with {', '.join(m for m in component if m not in cycle)})"
        lines.append(line)
    return lines


# The checker, on graphs made by hand: it finds what it is for.

def test_the_checker_flags_an_upward_import_a_sibling_import_and_a_circle():
    graph = {
        "tiderl.core.types": {"tiderl.env.base"},  # upward
        "tiderl.env.base": {"tiderl.env.registry", "tiderl.core.types"},
        "tiderl.env.registry": {"tiderl.env.gym", "tiderl.auth"},
        "tiderl.env.gym": {"tiderl.env.base"},  # base -> registry -> gym -> base
        "tiderl.sim.runner": {"tiderl.env.gym", "tiderl.core.types"},  # sibling
        "tiderl.auth": set(),
    }
    assert upward_imports(graph) == ["tiderl.core.types -> tiderl.env.base"]
    assert sibling_imports(graph) == ["tiderl.sim.runner -> tiderl.env.gym"]
    assert strongly_connected(graph) == [["tiderl.core.types", "tiderl.env.base",
                                          "tiderl.env.gym", "tiderl.env.registry"]]
    assert circles(graph) == [
        "tiderl.core.types -> tiderl.env.base -> tiderl.core.types"
        "  (with tiderl.env.gym, tiderl.env.registry)"]
    del graph["tiderl.core.types"]
    assert upward_imports(graph) == [] and circles(graph) == [
        "tiderl.env.base -> tiderl.env.registry -> tiderl.env.gym -> tiderl.env.base"]
    assert unplaced({"tiderl.extra.x": {"tiderl.core.types"}, "tiderl.core.types": set()}) == [
        "tiderl.extra.x"]


def test_the_checker_reads_every_kind_of_import(tmp_path):
    files = {
        "tiderl/__init__.py": "",
        "tiderl/core/__init__.py": "",
        "tiderl/core/types.py": "",
        "tiderl/env/__init__.py": "from . import base\n",
        "tiderl/env/base.py": ("from typing import TYPE_CHECKING\n"
                               "import json\n"
                               "from .protocol import Message\n"
                               "if TYPE_CHECKING:\n"
                               "    from tiderl.env.registry import make_env\n"),
        "tiderl/env/protocol.py": "import tiderl.core.types as types\nfrom ..core import *\n",
        "tiderl/env/registry.py": ("def make_env():\n"
                                   "    from tiderl.env import base, protocol\n"
                                   "    from tiderl import __version__\n"),
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert import_graph(tmp_path / "tiderl") == {
        "tiderl": set(),
        "tiderl.core": set(),
        "tiderl.core.types": set(),
        "tiderl.env": {"tiderl.env.base"},
        "tiderl.env.base": {"tiderl.env.protocol", "tiderl.env.registry"},
        "tiderl.env.protocol": {"tiderl.core.types", "tiderl.core"},
        "tiderl.env.registry": {"tiderl.env.base", "tiderl.env.protocol", "tiderl"},
    }


# The project.

def test_the_project_graph_holds_the_project():
    graph = project_graph()
    assert len(graph) > 150 and sum(map(len, graph.values())) > 500
    assert "tiderl.core.types" in graph["tiderl.env.config"] | graph["tiderl.engine.request"]
    assert "tiderl.runtime.bus" in graph["tiderl.runtime.__main__"]  # a package, in a function


def test_every_module_has_a_layer():
    assert unplaced(project_graph()) == []


def test_no_module_imports_a_higher_layer():
    found = upward_imports(project_graph())
    assert not found, "upward imports:\n" + "\n".join(found)


def test_no_package_imports_the_other_of_its_layer():
    found = sibling_imports(project_graph())
    assert not found, "imports between packages of one layer:\n" + "\n".join(found)


def test_no_import_circles():
    found = circles(project_graph())
    assert not found, f"{len(found)} import circles:\n" + "\n".join(found)

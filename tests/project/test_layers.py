"""The engine core is its own layer: no import cycles, and nothing in core imports above it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import headrace as hr
from headrace.core import Iterator

SRC = Path(hr.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(path: Path) -> set[str]:
    """headrace modules ``path`` imports when run, lazily or not (not under TYPE_CHECKING)."""
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("headrace"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("headrace"))
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(path): path for path in SRC.rglob("*.py")}
    # the C extensions, by their stubs: modules that import nothing of headrace
    extensions = {_module_name(path) for path in SRC.rglob("*.pyi")}
    graph: dict[str, set[str]] = {name: set() for name in extensions}
    for name, path in modules.items():
        targets = set()
        for imported in _runtime_imports(path):
            # "from headrace.core import X" depends on the package's __init__
            while imported not in modules and imported not in extensions and "." in imported:
                imported = imported.rsplit(".", 1)[0]
            if (imported in modules or imported in extensions) and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def _package_parents(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """A package's __init__ importing its own submodules is not a cycle with them."""
    return {
        name: {t for t in targets if not t.startswith(name + ".")}
        for name, targets in graph.items()
    }


def test_no_import_cycles_even_through_lazy_imports() -> None:
    assert _cycles(_package_parents(_graph())) == []


def _top(module: str) -> str:
    """The top-level package or module of headrace that ``module`` belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "headrace"


def _with_package_inits(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Importing ``a.b.c`` runs ``a.b``'s ``__init__`` first: an edge to it too.

    The root package is left out: importing any module runs it, by design.
    """
    modules = set(graph)
    out: dict[str, set[str]] = {}
    for name, targets in graph.items():
        edges = set(targets)
        for target in targets:
            parts = target.split(".")
            for k in range(2, len(parts)):
                package = ".".join(parts[:k])
                if package in modules and not name.startswith(package + ".") and package != name:
                    edges.add(package)
        out[name] = edges
    return out


#: Every top-level package and module of headrace, by layer: a module imports only from
#: its own layer and below (lazily or not). A new package must be placed here.
RANKS = {
    "_errors": 0, "_structure": 0, "_closing": 0, "_warn": 0, "_moved": 0, "_stateful": 0,
    "io": 1,
    "_memory": 2,
    "_options": 3,
    "core": 4,
    "image": 5, "_workers": 5,
    "_transforms": 6, "_sources": 6, "writers": 6, "saved": 6, "_persist": 6,
    "profiling": 7, "_rewrite": 7, "_distribute": 7,
    "adapters": 8,
    "_dataset": 9, "keras": 9,
    "headrace": 10, "_csv": 10, "_served": 10, "_wire": 10, "tf_compat": 10,
    "_tools": 10, "ray": 10,
    "cli": 11, "testing": 11,
}



def test_every_package_has_a_rank_and_imports_go_down() -> None:
    graph = _graph()
    assert {_top(name) for name in graph} <= set(RANKS), "place the new package in RANKS"
    upward = {
        (_top(name), _top(target), name, target)
        for name, targets in graph.items()
        for target in targets
        if RANKS[_top(target)] > RANKS[_top(name)]
    }
    assert not upward, sorted(upward)


def test_no_import_cycles_counting_package_inits() -> None:
    """``core.run`` importing ``profiling.stats`` ran ``profiling/__init__``, which imports
    doctor and lint, which import core: a cycle the test above does not see."""
    assert _cycles(_with_package_inits(_graph())) == []


def test_core_imports_nothing_above_it() -> None:
    above = (
        "headrace._transforms", "headrace._sources", "headrace._dataset", "headrace.writers",
        "headrace._persist",
    )
    for name, targets in _graph().items():
        if name.startswith("headrace.core"):
            assert not [t for t in targets if t.startswith(above)], name


def test_a_stage_cannot_override_next() -> None:
    with pytest.raises(TypeError, match="implements pull"):

        class _Bad(Iterator):  # pyright: ignore
            def __next__(self) -> int:
                return 1


#: A Buffer's counters, and a budget's: only memory/ reads them.
_COUNTERS = {"held", "limit", "minimum", "max_element", "overdrawn", "peak", "elements"}
_BUDGET_COUNTERS = {"used", "total"}


def _counter_reads(path: Path) -> list[str]:
    """``account.held``-like reads and writes in ``path``: an attribute named after a
    counter on an expression whose last name says account, buffer or budget."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        owner = ast.unparse(node.value).rsplit(".", 1)[-1].lower()
        if (node.attr in _COUNTERS and ("account" in owner or "buffer" in owner)) or (
            node.attr in _BUDGET_COUNTERS | _COUNTERS and "budget" in owner
        ):
            found.append(f"{path.relative_to(SRC)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_outside_memory_reads_a_buffers_counters() -> None:
    """Stages ask their buffer (share(), room(), fits()...) and book through its verbs and
    the in-flight ledger: the booking rules live in memory/ alone (issue 23)."""
    reads = [
        read
        for path in sorted(SRC.rglob("*.py"))
        if path.parent.name != "_memory"
        for read in _counter_reads(path)
    ]
    assert reads == []


def _is_module(name: str) -> bool:
    """Whether the dotted ``headrace...`` name is a module or package (a C extension too)."""
    path = SRC.parent.joinpath(*name.split("."))
    if not path.parent.is_dir():
        return False
    return path.is_dir() or any(path.parent.glob(path.name + ".*"))


def _private_reaches(path: Path, me: str | None = None) -> list[str]:
    """Where ``path`` reaches a ``_private`` name of another headrace module.

    A leading underscore on a module's name marks it internal to its package, which
    its siblings may import; on a name inside a module it marks it internal to that
    module, which no other module may import (``from m import _x``) or read (``m._x``).
    """
    me = me or _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    modules: dict[str, str] = {}  # local name -> the headrace module it names
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            if not base.startswith("headrace"):
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if _is_module(full):
                    modules[alias.asname or alias.name] = full
                elif alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{me}:{node.lineno}: from {base} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("headrace"):
                    local = alias.asname or alias.name.split(".")[0]
                    modules[local] = alias.name if alias.asname else local
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            continue
        chain, value = [], node.value
        while isinstance(value, ast.Attribute):
            chain.append(value.attr)
            value = value.value
        if not (isinstance(value, ast.Name) and value.id in modules):
            continue
        owner = ".".join([modules[value.id], *reversed(chain)])
        if _is_module(owner) and not _is_module(f"{owner}.{node.attr}") and owner != me:
            found.append(f"{me}:{node.lineno}: {owner}.{node.attr}")
    return found


def test_no_module_reaches_another_modules_private_names() -> None:
    found = [hit for path in sorted(SRC.rglob("*.py")) for hit in _private_reaches(path)]
    assert found == []


def test_the_private_name_check_sees_each_form(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"  # read as if it were headrace/_transforms/probe.py
    probe.write_text(
        "import headrace._transforms.map\n"
        "from headrace.io import streams\n"
        "from headrace.io import _example_wire\n"  # a private module: its package's own
        "from headrace._transforms.map import _MapIterator\n"
        "from .map import _apply_chunk\n"
        "streams._helper\n"
        "headrace._transforms.map._TARGET_CALL_SECONDS\n"
        "_example_wire.__name__\n"
    )
    found = _private_reaches(probe, "headrace._transforms.probe")
    assert [hit.split(": ", 1)[1] for hit in found] == [
        "from headrace._transforms.map import _MapIterator",
        "from headrace._transforms.map import _apply_chunk",
        "headrace.io.streams._helper",
        "headrace._transforms.map._TARGET_CALL_SECONDS",
    ]

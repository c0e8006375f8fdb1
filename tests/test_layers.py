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
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for imported in _runtime_imports(path):
            # "from headrace.core import X" depends on the package's __init__
            while imported not in modules and "." in imported:
                imported = imported.rsplit(".", 1)[0]
            if imported in modules and imported != name:
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


def test_core_imports_nothing_above_it() -> None:
    above = (
        "headrace.transforms", "headrace.sources", "headrace.dataset", "headrace.writers",
        "headrace.persist",
    )
    for name, targets in _graph().items():
        if name.startswith("headrace.core"):
            assert not [t for t in targets if t.startswith(above)], name


def test_a_stage_cannot_override_next() -> None:
    with pytest.raises(TypeError, match="implements pull"):

        class _Bad(Iterator):  # pyright: ignore
            def __next__(self) -> int:
                return 1

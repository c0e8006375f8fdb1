"""Stable identities of user functions, for pipeline fingerprints and stage names."""

from __future__ import annotations

import functools
import hashlib
import types
from collections.abc import Callable
from typing import Any

import numpy as np

from headrace.core.node import Node

__all__ = ["function_fingerprint", "function_name"]


def function_name(fn: Callable[..., Any]) -> str:
    """A stable name for a user function, for fingerprints and stage names."""
    module = getattr(fn, "__module__", None) or ""
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{module}.{name}" if module else name


def function_fingerprint(fn: Any) -> str:
    """A digest of what a user function computes, the same in every process.

    A state saved from ``map(lambda x: x + 1)`` must not restore into
    ``map(lambda x: x * 1000)``: both are ``<lambda>``, so the name alone
    cannot tell them apart. The digest covers the bytecode (``co_code``, its
    constants recursively, the names it uses), default arguments and the values
    of closure cells; callable objects (``functools.partial``, instances with
    ``__call__``) are described by their function and their attributes. Simple
    values (numbers, strings, bytes, NumPy scalars and dtypes, and containers of
    them) count by value; others by type (arrays by dtype and shape, datasets by
    their fingerprint). Nothing depends on ``id()``, hash randomization, file
    paths or line numbers, so a checkpoint restores in a new process, and
    after an edit that only moves code around.
    """
    return hashlib.sha256(_Describer().describe(fn, 0).encode()).hexdigest()[:16]


_SIMPLE = (type(None), bool, int, float, complex, str, bytes, type(Ellipsis), np.generic, np.dtype)


class _Describer:
    """Stable text for :func:`function_fingerprint`, bounded in depth and in total work
    (a closure over a large object graph costs a few thousand steps, not a walk of it)."""

    MAX_DEPTH = 6
    MAX_ITEMS = 256  # a longer container counts by type and length only
    MAX_STEPS = 20_000  # past this, values count by type only

    def __init__(self) -> None:
        self.active: set[int] = set()  # ids being described: a cycle counts by type
        self.steps = 0

    def describe(self, value: Any, depth: int) -> str:
        self.steps += 1
        if isinstance(value, _SIMPLE):
            return repr(value)
        kind = f"{type(value).__module__}.{type(value).__qualname__}"
        if depth > self.MAX_DEPTH or self.steps > self.MAX_STEPS or id(value) in self.active:
            return kind
        if isinstance(value, np.ndarray):
            return f"{kind}({value.dtype},{value.shape})"
        if isinstance(value, type):
            return f"class {value.__module__}.{value.__qualname__}"
        if isinstance(value, types.ModuleType):
            return f"module {value.__name__}"
        if isinstance(value, (types.BuiltinFunctionType, types.BuiltinMethodType)):
            owner = getattr(value, "__self__", None)
            bound = owner is not None and not isinstance(owner, types.ModuleType)
            prefix = f"{type(owner).__qualname__}." if bound else ""
            return f"builtin {getattr(value, '__module__', '')}.{prefix}{value.__qualname__}"
        node = value if isinstance(value, Node) else getattr(value, "_node", None)
        if isinstance(node, Node):  # a Dataset captured by a function (zip, interleave)
            return f"dataset {node.fingerprint()}"
        self.active.add(id(value))
        try:
            return self._compound(value, kind, depth + 1)
        finally:
            self.active.discard(id(value))

    def _compound(self, value: Any, kind: str, depth: int) -> str:
        def each(items: Any) -> str:
            return ",".join(self.describe(item, depth) for item in items)

        if isinstance(value, (tuple, list, set, frozenset, dict)) and len(value) > self.MAX_ITEMS:
            return f"{kind}[{len(value)}]"
        if isinstance(value, (tuple, list)):
            return f"{kind}({each(value)})"
        if isinstance(value, (set, frozenset)):  # sorted: iteration order follows the hash seed
            return f"{kind}({','.join(sorted(self.describe(v, depth) for v in value))})"
        if isinstance(value, dict):
            pairs = (f"{self.describe(k, depth)}:{self.describe(v, depth)}" for k, v in value.items())
            return f"{kind}({','.join(sorted(pairs))})"
        if isinstance(value, types.CodeType):
            return (
                f"code({value.co_name};{value.co_argcount};{value.co_kwonlyargcount};"
                f"{value.co_code.hex()};{each(value.co_consts)};{','.join(value.co_names)};"
                f"{','.join(value.co_varnames)})"
            )
        if isinstance(value, types.FunctionType):
            return (
                f"function {value.__module__}.{value.__qualname__}("
                f"{self.describe(value.__code__, depth)};{each(_cell_values(value))};"
                f"{self.describe(value.__defaults__, depth)};"
                f"{self.describe(value.__kwdefaults__, depth)})"
            )
        if isinstance(value, types.MethodType):
            return f"method({each((value.__func__, value.__self__))})"
        if isinstance(value, functools.partial):
            return f"partial({each((value.func, value.args, value.keywords))})"
        # any other object: its class, what calling it runs, and its attributes
        call = next(
            (cls.__dict__["__call__"] for cls in type(value).__mro__ if "__call__" in cls.__dict__),
            None,
        )
        fields = dict(getattr(value, "__dict__", None) or {})
        for cls in type(value).__mro__:
            slots = getattr(cls, "__slots__", ())
            for name in [slots] if isinstance(slots, str) else slots:
                if hasattr(value, name):
                    fields[name] = getattr(value, name)
        code = self.describe(call, depth) if isinstance(call, types.FunctionType) else ""
        name = getattr(value, "__qualname__", None) or getattr(value, "__name__", None)
        named = name if isinstance(name, str) else ""  # e.g. NumPy's ufuncs: add, multiply
        return f"object {kind} {named}({code};{self.describe(fields, depth)})"


def _cell_values(fn: types.FunctionType) -> list[Any]:
    """The values of ``fn``'s closure cells (a cell not assigned yet counts as a marker)."""
    values: list[Any] = []
    for cell in fn.__closure__ or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:  # the enclosing function has not assigned it yet
            values.append("<unassigned cell>")
    return values

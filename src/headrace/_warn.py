"""Warnings that point at the user's line (internal).

A hazard headrace finds while a pipeline runs (a shuffle shrunk to fit, a cache left
partial) is raised many frames below the user's code, at a depth that depends on the
pipeline; a fixed ``stacklevel`` names some headrace file instead. :func:`warn_user`
attributes the warning to the innermost frame outside headrace (and outside Python's
import machinery): the line of the user's ``for``, ``next`` or ``import``. On a
headrace thread (a prefetch reading ahead) no user frame exists; the warning then
names the line that raised it.
"""

from __future__ import annotations

import importlib
import os
import sys
import sysconfig
import threading
import warnings
from collections.abc import Callable
from types import FrameType
from typing import Any

__all__ = ["deprecated_attributes", "warn_deprecated", "warn_user"]

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_THREADING = os.path.abspath(threading.__file__)
#: Where installed libraries and the standard library live: not the user's code (a
#: Keras callback's warning names the user's ``fit``, not Keras's loop).
_LIBRARIES = tuple(sorted({os.path.abspath(path) + os.sep for key in ("stdlib", "platstdlib",
                                                                      "purelib", "platlib")
                           if (path := sysconfig.get_paths().get(key))}))


def _headrace(name: str) -> bool:
    return name.startswith(_PACKAGE) or name.startswith("<frozen")


def warn_user(message: str, category: type[Warning]) -> None:
    """``warnings.warn(message, category)`` as if raised on the user's line."""
    caller = sys._getframe(1)
    outside: FrameType | None = None  # the first frame outside headrace
    frame: FrameType | None = caller
    while frame is not None:
        name = frame.f_code.co_filename
        if not _headrace(name):
            if outside is None:
                outside = frame
            if not os.path.abspath(name).startswith(_LIBRARIES):
                break
        frame = frame.f_back
    chosen = frame or outside
    if chosen is None or os.path.abspath(chosen.f_code.co_filename) == _THREADING:
        chosen = caller  # a headrace thread: no user line to name
    module_globals = chosen.f_globals
    registry = module_globals.setdefault("__warningregistry__", {})
    warnings.warn_explicit(message, category, chosen.f_code.co_filename, chosen.f_lineno,
                           module=module_globals.get("__name__", "<unknown>"),
                           registry=registry)


def warn_deprecated(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn that ``old`` is deprecated in favour of ``new`` (internal).

    A :class:`DeprecationWarning`, so that it shows in tests and in ``__main__`` and
    nowhere else by default; ``stacklevel=3`` names the line that called the
    deprecated function (this helper is one frame, the function another).
    """
    warnings.warn(f"{old} is deprecated and will be removed; use {new} instead",
                  DeprecationWarning, stacklevel=stacklevel)


def deprecated_attributes(module: str,
                          moved: dict[str, tuple[str, str]]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for names kept importable only with a warning (internal).

    ``moved`` maps each deprecated name to ``(where it now lives as "module:attribute",
    what to write instead)``. The name is looked up on each access, not cached in the
    module's globals, so every use warns (``from m import name`` included: it goes
    through ``__getattr__``); the replacement is imported only when asked for, so a
    deprecated name cannot make ``import headrace`` heavier.
    """

    def __getattr__(name: str) -> Any:
        if name not in moved:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        target, instead = moved[name]
        # ``from package import name`` asks twice: importlib's fromlist check, then the
        # import statement itself; only the second warns, so each use warns once.
        asker = sys._getframe(1)
        if not (asker.f_code.co_name == "_handle_fromlist"
                and asker.f_globals.get("__name__") == "importlib._bootstrap"):
            warn_deprecated(f"{module}.{name}", instead)
        where, _, attribute = target.partition(":")
        return getattr(importlib.import_module(where), attribute)

    return __getattr__

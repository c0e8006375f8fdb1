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

import os
import sys
import sysconfig
import threading
import warnings
from types import FrameType

__all__ = ["warn_user"]

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

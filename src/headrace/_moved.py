"""Old import paths of headrace's internal modules, importable with a warning (internal).

headrace's implementation lives in underscored packages and modules
(``headrace._transforms``, ``headrace._dataset``, ...); code that imported the old
names (``headrace.transforms.map``) keeps working: :class:`MovedFinder`, first on
``sys.meta_path``, answers an old name with the module under its new name, the same
object (so classes, ``isinstance`` and monkeypatching are shared), and warns once per
module with a :class:`DeprecationWarning` that names the new path. It is first so that
the path finder, which would find the new files under the old name through the
package's ``__path__``, never loads a second copy.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType

__all__ = ["MOVED", "MovedFinder", "install", "moved_attribute"]

#: Old module path -> new module path; the submodules of a package follow it.
MOVED = {
    "headrace.transforms": "headrace._transforms",
    "headrace.memory": "headrace._memory",
    "headrace.persist": "headrace._persist",
    "headrace.sources": "headrace._sources",
    "headrace.workers": "headrace._workers",
    "headrace.csv": "headrace._csv",
    "headrace.tools": "headrace._tools",
    "headrace.dataset": "headrace._dataset",
    "headrace.served": "headrace._served",
    "headrace.distribute": "headrace._distribute",
    "headrace.options": "headrace._options",
    "headrace.errors": "headrace._errors",
    "headrace.structure": "headrace._structure",
}


def new_name(fullname: str) -> str | None:
    """The new path of ``fullname`` if it is (under) a moved module, else None."""
    for old, new in MOVED.items():
        if fullname == old or fullname.startswith(old + "."):
            return new + fullname[len(old):]
    return None


class _Alias(importlib.abc.Loader):
    """Loads an old name as the module already known under its new one."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # the import system has just set the old name's spec on the shared module:
        # give it back its own, which reload and multiprocessing's spawn rely on
        module.__spec__ = self.spec


class MovedFinder(importlib.abc.MetaPathFinder):
    """Finds the old names of moved modules (see the module docstring)."""

    def find_spec(self, fullname: str, path: object = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        new = new_name(fullname)
        if new is None:
            return None
        real = importlib.util.find_spec(new)
        if real is None:
            return None
        warnings.warn(
            f"{fullname} is internal to headrace and moved to {new}; import the public "
            "names from headrace (see the API reference) instead",
            DeprecationWarning, stacklevel=2,
        )
        return importlib.util.spec_from_loader(
            fullname, _Alias(new), is_package=real.submodule_search_locations is not None
        )


def install() -> None:
    """Put :class:`MovedFinder` first on ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, MovedFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedFinder())


def moved_attribute(name: str) -> ModuleType:
    """``headrace.transforms`` as an attribute: the moved module, with the same warning."""
    new = MOVED.get(f"headrace.{name}")
    if new is None:
        raise AttributeError(f"module 'headrace' has no attribute {name!r}")
    warnings.warn(
        f"headrace.{name} is internal to headrace and moved to {new}; use the public "
        "names of headrace (see the API reference) instead",
        DeprecationWarning, stacklevel=2,
    )
    return importlib.import_module(new)

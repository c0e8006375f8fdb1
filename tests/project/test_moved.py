"""The old paths of headrace's internal modules still import, with a warning."""

from __future__ import annotations

import importlib
import pickle
import sys

import pytest

import headrace as hr
from headrace._moved import MOVED


def _forget(name: str) -> None:
    """Drop the old name (the alias, not the module) so that using it warns again."""
    for key in [key for key in sys.modules if key == name or key.startswith(name + ".")]:
        del sys.modules[key]
    leaf = name.removeprefix("headrace.")
    if "." not in leaf:  # importing it bound it on headrace as well
        vars(hr).pop(leaf, None)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_imports_the_same_module_with_a_warning(old: str) -> None:
    _forget(old)
    new = MOVED[old]
    with pytest.warns(DeprecationWarning, match=rf"{old} is internal to headrace and moved to {new}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert module.__spec__.name == new and module.__name__ == new


def test_a_submodule_under_an_old_package_path_is_the_same_object() -> None:
    _forget("headrace.transforms")
    with pytest.warns(DeprecationWarning, match="headrace._transforms.map"):
        from headrace.transforms.map import MapNode as OldMapNode
    from headrace._transforms.map import MapNode

    assert OldMapNode is MapNode
    assert sys.modules["headrace.transforms.map"] is sys.modules["headrace._transforms.map"]
    node = hr.Dataset.range(3).map(lambda x: x + 1).node
    assert isinstance(node, OldMapNode)


def test_the_old_name_as_an_attribute_and_a_missing_name() -> None:
    _forget("headrace.memory")
    with pytest.warns(DeprecationWarning, match="headrace._memory"):
        assert hr.memory is importlib.import_module("headrace._memory")  # type: ignore[attr-defined]
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        hr.nothing_here  # type: ignore[attr-defined]  # noqa: B018
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("headrace.transforms.nothing_here")


def test_pickles_name_the_new_paths() -> None:
    options = hr.Options(memory_budget="8MiB")
    assert b"headrace._options" in pickle.dumps(options)
    assert pickle.loads(pickle.dumps(options)) == options

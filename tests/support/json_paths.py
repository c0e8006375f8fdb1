"""Every path to a field of a JSON value: what the tamper generators draw edits from."""

from __future__ import annotations

from typing import Any


def field_paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path to a field (dict key or list index) inside ``value``."""
    found: list[tuple[Any, ...]] = []
    if isinstance(value, dict):
        for key, item in value.items():
            found.append((*prefix, key))
            found += field_paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found.append((*prefix, index))
            found += field_paths(item, (*prefix, index))
    return found

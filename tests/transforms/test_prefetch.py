"""``prefetch``: outputs, orders and errors a user relies on."""

from __future__ import annotations

from transform_cases import ints

import headrace as hr


def test_prefetch_autotune(source) -> None:
    assert ints(source(100).prefetch(hr.AUTOTUNE)) == list(range(100))
    assert ints(source(100).prefetch(3)) == list(range(100))

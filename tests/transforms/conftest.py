"""The ``source`` fixture: each transformation test runs over an indexed and a streaming source."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from transform_cases import streaming

import headrace as hr


@pytest.fixture(params=["indexed", "streaming"])
def source(request: pytest.FixtureRequest) -> Callable[[int], hr.Dataset]:
    def make(n: int) -> hr.Dataset:
        return hr.Dataset.range(n) if request.param == "indexed" else streaming(list(range(n)))

    return make

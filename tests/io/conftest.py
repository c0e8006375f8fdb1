"""Fixtures for the format tests: run a test once on the C path and once on pure Python."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from headrace.io import _native

# The suite runs with --import-mode=importlib, which puts no test directory on sys.path;
# the shared Hypothesis strategies module (io_format_strategies.py) lives here.
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(params=["native", "pure"])
def implementation(request: pytest.FixtureRequest) -> Iterator[str]:
    """Switch the C extension on or off for one test; the C run fails if it is not built."""
    use_native = request.param == "native"
    if use_native:
        assert _native._loaded_extension is not None, (
            "the C extension headrace.io._hrio is not built: run "
            "`python setup.py build_ext --inplace` or `pip install -e .`"
        )
    previous = _native.set_native_enabled(use_native)
    try:
        yield request.param
    finally:
        _native.set_native_enabled(previous)

"""Shared fixtures: every test runs with warnings about shrinking visible but not fatal."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import pytest


@pytest.fixture
def no_thread_leak() -> Iterator[None]:
    """Fail if a test leaves headrace threads running after its iterators are gone."""
    before = {t.ident for t in threading.enumerate()}
    yield
    gc.collect()
    for _ in range(200):
        leaked = [
            t for t in threading.enumerate()
            if t.ident not in before and t.name.startswith("headrace")
        ]
        if not leaked:
            return
        threading.Event().wait(0.01)
        gc.collect()
    raise AssertionError(f"threads left running: {[t.name for t in leaked]}")

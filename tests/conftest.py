"""Shared fixtures: every test runs with warnings about shrinking visible but not fatal."""

from __future__ import annotations

import gc
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from headrace.io.filepool import PooledStream

# The suite runs with --import-mode=importlib, which puts no test folder on sys.path. The
# modules the tests share (fuzz_pipelines, process_fns, tf_compare, ...) live in
# tests/support; worker processes started from a test import them by name from there.
SUPPORT = Path(__file__).parent / "support"
sys.path.insert(0, str(SUPPORT))

# No per-example deadline anywhere: on a loaded 2-core machine running two test
# processes, a preempted example takes longer than Hypothesis's 200 ms without
# anything being wrong (pytest-timeout still bounds each test).
settings.register_profile("headrace", deadline=None)
settings.load_profile("headrace")


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


class DescriptorCounter:
    """Counts, exactly or over, the descriptors headrace's file streams hold: every
    ``os.open`` and ``os.close`` of :mod:`headrace.io.streams` goes through it.

    Sampling ``/proc/self/fd`` from a watcher thread cannot prove a cap while other
    threads open and close files: the listing is not atomic, and a number freed by the
    listing's own descriptor can be reused by a data file and counted twice. This counter
    sees the system calls themselves, independently of the pool's own bookkeeping. It
    counts a descriptor from just before its open until just after its close, so it may
    over-count for an instant but never under-counts: a peak within a cap proves it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.current = 0
        self.peak = 0

    def _add(self, delta: int) -> None:
        with self._lock:
            self.current += delta
            self.peak = max(self.peak, self.current)

    def open(self, path: str, flags: int, *args: int) -> int:
        self._add(1)
        try:
            return os.open(path, flags, *args)
        except BaseException:
            self._add(-1)
            raise

    def close(self, descriptor: int) -> None:
        try:
            os.close(descriptor)
        finally:
            self._add(-1)

    def __getattr__(self, name: str) -> object:  # every other os function, unchanged
        return getattr(os, name)


@pytest.fixture
def stream_descriptors(monkeypatch: pytest.MonkeyPatch) -> DescriptorCounter:
    """Route headrace.io.streams' ``os`` through a :class:`DescriptorCounter`."""
    import headrace.io.streams as streams_module

    counter = DescriptorCounter()
    monkeypatch.setattr(streams_module, "os", counter)
    return counter


@pytest.fixture
def bytes_read(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Decompressed bytes read from pooled streams (one counter for the whole test)."""
    total = [0]
    original = PooledStream.read

    def counting(self: PooledStream, size: int = -1, /) -> bytes:
        data = original(self, size)
        total[0] += len(data)
        return data

    monkeypatch.setattr(PooledStream, "read", counting)
    return total

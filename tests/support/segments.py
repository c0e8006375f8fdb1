"""This test process's shared-memory segments, for tests that check none is left."""

from __future__ import annotations

import gc
import os
import time

from headrace._workers import shm


def segments_now() -> list[str]:
    """The segments this process owns at this moment."""
    return [n for n in os.listdir(shm.SHM_DIR) if n.startswith(f"headrace-{os.getpid()}-")]


def own_segments(settle_s: float = 2.0) -> list[str]:
    """The segments this process still owns once those being released are gone.

    A pool unlinks its segments from its own thread, and an iterator an earlier test
    dropped lets its pool go when the collector runs: both can take a moment in a test
    process that other tests share. A segment that stays past ``settle_s`` is a leak.
    """
    deadline = time.monotonic() + settle_s
    while True:
        gc.collect()
        left = segments_now()
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)

"""Garbage collection inside a booking may close another pipeline: no deadlock.

Pipelines without an explicit budget share the default budget's lock. Collection
can run at any allocation inside a booking (holding that lock) and finalize an
abandoned iterator, whose close takes the lock again on the same thread.
"""

from __future__ import annotations

import threading

import headrace as hr


def test_closing_an_iterator_while_the_shared_budget_lock_is_held_does_not_deadlock() -> None:
    abandoned = iter(hr.Dataset.range(100).shuffle(10, seed=0))
    running = iter(hr.Dataset.range(100).shuffle(10, seed=1))
    next(abandoned), next(running)
    assert abandoned.context.budget.lock is running.context.budget.lock  # the default's
    done = threading.Event()

    def finalize_inside_a_booking() -> None:
        with running.context.budget.lock:  # as a booking holds it when gc strikes
            abandoned.close()
        done.set()

    thread = threading.Thread(target=finalize_inside_a_booking, daemon=True)
    thread.start()
    thread.join(10)
    assert done.is_set(), "closing under the held budget lock deadlocked"
    assert sum(1 for _ in running) == 99

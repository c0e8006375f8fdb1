"""Clean shutdown (G6): close, context managers, abandoned iterators, worker errors."""

from __future__ import annotations

import gc
import threading
import traceback

import numpy as np
import pytest

import headrace as hr
from headrace.core.run import default_budget, join_abandoned


def busy_pipeline() -> hr.Dataset:
    return (
        hr.Dataset.range(10_000)
        .map(lambda x: np.full(256, x), num_parallel_calls=2)
        .prefetch(8)
        .shuffle(64)
        .batch(4)
        .prefetch(hr.AUTOTUNE)
    )


def headrace_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("headrace")]


def test_hundreds_of_abandoned_iterators_are_freed(no_thread_leak) -> None:
    # what other tests' live datasets keep booked there (a complete cache() lives as
    # long as its dataset) is not these iterators' to return
    gc.collect()  # earlier tests' abandoned iterators close (on threads of their own)
    assert join_abandoned()  # before the baseline is read, not after
    before = default_budget().used
    dataset = busy_pipeline()
    for _ in range(300):
        iterator = iter(dataset)
        next(iterator)
        del iterator  # a `break` out of a loop, or Keras making a new iterator per epoch
    gc.collect()
    assert join_abandoned()  # each close runs on a thread of its own (see _close_abandoned)
    assert default_budget().used == before


def test_break_out_of_for_loop_frees_everything(no_thread_leak) -> None:
    gc.collect()  # earlier tests' abandoned iterators close (on threads of their own)
    assert join_abandoned()  # before the baseline is read, not after
    before = default_budget().used
    for _ in range(20):
        for batch in busy_pipeline():
            assert batch.shape == (4, 256)
            break
    gc.collect()
    assert join_abandoned()  # each close runs on a thread of its own (see _close_abandoned)
    assert default_budget().used == before


def test_close_stops_threads_at_once() -> None:
    iterator = iter(busy_pipeline())
    next(iterator)
    assert headrace_threads()
    iterator.close()
    gc.collect()
    for _ in range(100):
        if not [t for t in headrace_threads() if t.is_alive() and "prefetch" in t.name]:
            break
        threading.Event().wait(0.01)
    assert not [t for t in headrace_threads() if "prefetch" in t.name]


def test_context_manager_closes() -> None:
    with iter(hr.Dataset.range(5).prefetch(2)) as iterator:
        assert int(next(iterator)) == 0
    with pytest.raises(hr.IteratorClosedError):
        next(iterator)


def test_exception_in_a_prefetch_thread_reaches_the_consumer_with_its_traceback() -> None:
    def fail(x):
        if x == 3:
            raise ValueError("bad element 3")
        return x

    with pytest.raises(ValueError, match="bad element 3") as info:
        list(hr.Dataset.range(10).map(fail).prefetch(4))
    # held by the prefetch until its turn: the frames come as text (they would keep the
    # elements in them alive), with the line that raised
    shown = "".join(traceback.format_exception(info.value))
    assert 'in fail\n    raise ValueError("bad element 3")' in shown


def test_end_of_sequence_repeats() -> None:
    iterator = iter(hr.Dataset.range(2).prefetch(1))
    assert len(list(iterator)) == 2
    with pytest.raises(StopIteration):
        next(iterator)
    with pytest.raises(StopIteration):
        next(iterator)


def test_collecting_an_iterator_inside_a_booking_does_not_deadlock() -> None:
    """Garbage collection runs finalizers inside whatever allocation triggers it: here,
    while this thread holds the budget lock that the dropped iterator's close needs
    (pipelines on the default budget share one). It hung; now the close runs apart."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        import gc
        import headrace as hr
        from headrace.core.run import default_budget, join_abandoned

        iterator = iter(hr.Dataset.range(1000).map(lambda x: x, num_parallel_calls=2))
        next(iterator)
        iterator.cycle = iterator  # only the cycle collector frees it
        del iterator
        with default_budget().lock:  # as in the middle of a booking
            gc.collect()
        assert join_abandoned()
        assert default_budget().used == 0
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "ok", done.stderr

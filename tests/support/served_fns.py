"""Producer and consumer programs for the served-dataset tests: module level, so that
processes started with spawn/forkserver can import them (``tests`` is put on ``sys.path``).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np

import headrace as hr

#: Elements of this many int64 values (64 KiB): above shm.OUT_OF_BAND_BYTES, so every
#: element's array travels through a shared-memory segment.
WIDTH = 8192


def as_array(x: Any) -> Any:
    return np.full(WIDTH, x, dtype=np.int64)


def slow_after(first: int, x: Any) -> Any:
    """``as_array(x)``, after sleeping 30 s for elements past ``first`` (a stuck producer)."""
    if int(x) > first:
        time.sleep(30)
    return as_array(x)


def ranged(n: int) -> hr.Dataset:
    return hr.Dataset.range(n).map(as_array)


def value(element: Any) -> int:
    """The number an element of :func:`ranged` carries (checking every value agrees)."""
    array = np.asarray(element)
    assert array.shape == (WIDTH,) and (array == array[0]).all()
    return int(array[0])


def consume(
    address: str, index: int, authkey: bytes, out: str, kill_after: int | None = None
) -> None:
    """Read consumer ``index``'s part, writing each value to ``out`` (a JSON line each) as
    it comes; with ``kill_after``, SIGKILL itself after that many elements."""
    with hr.connect(address, index, authkey=authkey) as part, open(out, "w") as sink:
        for count, element in enumerate(part, 1):
            sink.write(json.dumps(value(element)) + "\n")
            sink.flush()
            if kill_after is not None and count >= kill_after:
                os.kill(os.getpid(), signal.SIGKILL)


def produce(address: str, consumers: int, n: int, authkey: bytes, stuck_after: int) -> None:
    """Serve ``range(n)`` as arrays (stuck after ``stuck_after``) until killed."""
    import functools

    dataset = hr.Dataset.range(n).map(functools.partial(slow_after, stuck_after))
    with hr.serve(dataset, consumers, address, authkey=authkey):
        while True:
            time.sleep(1)


def record_array(record: Any) -> Any:
    """A TFRecord's bytes padded into an array large enough for shared memory."""
    out = np.zeros(WIDTH, dtype=np.uint8)
    data = bytes(record)
    out[: len(data)] = np.frombuffer(data, np.uint8)
    out[-1] = len(data)
    return out


def consume_records(address: str, index: int, authkey: bytes, out: str) -> None:
    """Read consumer ``index``'s part of :func:`record_array` elements into ``out`` (JSON)."""
    with hr.connect(address, index, authkey=authkey) as part:
        got = [bytes(e[: int(e[-1])]).decode() for e in part]
    with open(out, "w") as sink:
        json.dump(got, sink)


def shard_of(n: int, i: Any) -> hr.Dataset:
    """Shard ``i`` of ``range(n)`` (every third element from the i-th) as arrays: the
    inner pipeline of a producer's process interleave."""
    return hr.Dataset.range(int(i), n, 3).map(as_array)


def sized(x: Any, nbytes: int = 64 << 10, grow_at: int = 1 << 62) -> Any:
    """Element ``x`` as an array of ``nbytes`` (8x from element ``grow_at`` on), carrying
    ``x`` in its first 8 bytes; every third one a view of an array 4x its size."""
    size = nbytes * (8 if int(x) >= grow_at else 1)
    if int(x) % 3 == 2:
        row = np.zeros(size * 4, np.uint8)[size : 2 * size]
    else:
        row = np.zeros(size, np.uint8)
    row[:8] = np.frombuffer(np.int64(int(x)).tobytes(), np.uint8)
    return row


def number(element: Any) -> int:
    """The ``x`` a :func:`sized` element carries."""
    return int(np.frombuffer(np.asarray(element)[:8].tobytes(), np.int64)[0])


def charged() -> int:
    """This process's RssAnon + RssShmem (what the measured bound of G1 counts)."""
    from fuzz_pipelines import _self_charged  # (tests/ is on sys.path, as for this module)

    return _self_charged()


def exit_code(proc: Any, timeout: float = 60.0) -> int | None:
    """``proc``'s exit code once it has ended, or None where it cannot be known.

    A process started by the forkserver learns its exit code from the forkserver.
    Under load that server can fail and close the status pipes of the children
    it started (CPython gh-140867, seen once in CI here): ``exitcode`` is then 255
    at once, whatever the child does. That case waits until the child is gone
    and returns None; the caller then judges the child by what it wrote.
    """
    from headrace._workers.processes import _STATUS_LOST, _wait_ended

    ended = _wait_ended(proc, time.monotonic() + timeout)  # (the pool's own judgement)
    code: int | None = proc.exitcode
    return None if ended and code == _STATUS_LOST else code


def consume_until(
    address: str, index: int, authkey: bytes, state_in: str, out: str, stop: int, die: bool
) -> None:
    """One life of a consumer: connect (resuming from the state in ``state_in``, if that
    file exists), read up to ``stop`` elements of its part, then write what it read, its
    state and its memory growth (RssAnon + RssShmem) to ``out``; then close or, with
    ``die``, SIGKILL itself without closing anything."""
    state = json.loads(Path(state_in).read_text()) if os.path.exists(state_in) else None
    start = peak = charged()
    got: list[int] = []
    part = hr.connect(address, index, authkey=authkey, state=state)
    ended, refused = True, None
    try:
        for element in part:
            got.append(number(element))
            del element
            peak = max(peak, charged())
            if len(got) >= stop:
                ended = False
                break
    except hr.MemoryBudgetError as error:  # its part of the budget cannot hold the pipeline
        refused = str(error)
    result = {"values": got, "state": None if refused else part.get_state(), "ended": ended,
              "growth": peak - start, "refused": refused}
    Path(out).write_text(json.dumps(result))
    if die:
        os.kill(os.getpid(), signal.SIGKILL)
    part.close()


def half_of(dataset: hr.Dataset, i: Any) -> hr.Dataset:
    """Half ``i`` of ``dataset`` (its elements ``i, i + 2, ...``): an inner pipeline that
    re-reads a served stream inside a process interleave's worker."""
    return dataset.shard(2, int(i))

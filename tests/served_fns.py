"""Producer and consumer programs for the served-dataset tests: module level, so that
processes started with spawn/forkserver can import them (``tests`` is put on ``sys.path``).
"""

from __future__ import annotations

import json
import os
import signal
import time
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

"""Functions for process-worker tests: module-level, so worker processes can unpickle them.

(Importable as ``process_fns`` once the tests directory is on ``sys.path``; a function
defined in a test module imported by pytest's importlib mode is not.)
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

import numpy as np


class Failing(Exception):
    """Raised by :func:`fail_on` for the chosen elements."""


def square(x: Any) -> Any:
    return x * x


def as_list(x: Any) -> Any:
    """A list of two components (tf.data makes it a tuple)."""
    return [x, x * 10]


def fail_on(bad: frozenset[int], x: Any) -> Any:
    """``x * 10``, or :class:`Failing` for the elements in ``bad``."""
    if int(x) in bad:
        raise Failing(f"bad element {int(x)}")
    return x * 10


def python_work(x: Any, loops: int = 20_000) -> Any:
    """Pure-Python work holding the GIL (about 1 ms for 20,000 loops here)."""
    total = 0
    for i in range(loops):
        total += i ^ int(x)
    return x


def sleepy(x: Any) -> Any:
    time.sleep(0.002)  # releases the GIL
    return x


def slow_on_multiples(every: int, x: Any) -> int:
    """``x``, 5 ms late where ``every`` divides it: calls end out of their order."""
    time.sleep(0.005 if int(x) % every == 0 else 0.0002)
    return int(x)


def slow_at(slow: int, seconds: float, x: Any) -> int:
    """``x``, ``seconds`` late for element ``slow``: the others pass it out of order."""
    if int(x) == slow:
        time.sleep(seconds)
    return int(x)


class SlowToLoad:
    """Takes ``seconds`` to unpickle: a worker holding one in its function is that long
    starting (before it says it is ready)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __reduce__(self) -> Any:
        return _load_slowly, (self.seconds,)


def _load_slowly(seconds: float) -> SlowToLoad:
    time.sleep(seconds)
    return SlowToLoad(seconds)


def value_with(extra: Any, x: Any) -> int:
    """``x``; ``extra`` travels with the function."""
    return int(x)


def row_array(x: Any, size: int = 100_000) -> Any:
    return {"x": np.full(size, int(x), np.float32), "i": x, "name": f"row {int(x)}"}


def block_forever(x: Any) -> Any:
    if int(x) == 3:
        time.sleep(3600)
    return x


def die_on(x: Any, target: int = 5) -> Any:
    if int(x) == target:
        os._exit(3)
    return x


def pid_of(x: Any) -> Any:
    return os.getpid()


def huge(x: Any, nbytes: int) -> Any:
    """A large array that costs no RAM until written (calloc'd pages)."""
    array = np.zeros(nbytes, np.uint8)
    array[-1] = int(x) + 1
    return array


def zeros_of(x: Any) -> Any:
    """``x`` zero bytes: outputs of the size asked for."""
    return np.zeros(int(x), np.uint8)


def lookup(table: Any, x: Any) -> Any:
    return len(table[int(x) % len(table)])


def record_bytes(x: Any, nbytes: int = 1 << 20) -> Any:
    """A ``bytes`` record of ``nbytes`` (what a TFRecord reader or ``tobytes`` gives)."""
    return bytes([int(x) % 251]) * nbytes


def same(x: Any) -> Any:
    return x


def shard_dataset(i: Any, sizes: tuple[int, ...] = (5, 0, 3, 7), bad: int = -1) -> Any:
    """An inner dataset for interleave tests: ``sizes[i % len]`` elements ``i * 100 + j``;
    element ``bad`` (if it is one of them) raises :class:`Failing` in its place."""
    import headrace as hr

    count = sizes[int(i) % len(sizes)]
    ds = hr.Dataset.range(int(i) * 100, int(i) * 100 + count)
    return ds.map(functools.partial(fail_on_value, bad))


def shard_or_no_dataset(
    i: Any, sizes: tuple[int, ...] = (5, 0, 3, 7), bad: int = -1, unbuilt: tuple[int, ...] = ()
) -> Any:
    """:func:`shard_dataset`, except that for the inputs in ``unbuilt`` the dataset cannot
    be built: the interleave function raises :class:`Failing` itself."""
    if int(i) in unbuilt:
        raise Failing(f"no dataset for {int(i)}")
    return shard_dataset(i, sizes, bad)


def fail_on_value(bad: int, x: Any) -> Any:
    if int(x) == bad:
        raise Failing(f"bad element {int(x)}")
    return x


def shard_arrays(i: Any, rows: int = 20, width: int = 5_000) -> Any:
    """An inner dataset of ``rows`` float64 rows (40 KB each) made in the worker."""
    import headrace as hr

    base = np.arange(rows * width, dtype=np.float64).reshape(rows, width) + int(i) * 1e6
    return hr.Dataset.from_tensor_slices(base)


def example_batches(path: Any, batch: int = 7) -> Any:
    """One TFRecord shard of Examples (``x`` float32[4], ``y`` int64, ``id`` bytes),
    batched and parsed: benchmark 2's inner pipeline, small."""
    import headrace as hr
    from headrace.io.example import FixedLenFeature

    spec = {
        "x": FixedLenFeature((4,), np.float32),
        "y": FixedLenFeature((), np.int64),
        "id": FixedLenFeature((), bytes),
    }
    return hr.TFRecordDataset(os.fsdecode(path)).batch(batch).parse_examples(spec)


def big_rows(i: Any, kib: int = 1024, count: int = 3) -> Any:
    """An inner dataset of ``count`` arrays of ``kib`` KiB (an interleave's slot contents)."""
    import headrace as hr

    return hr.Dataset.range(count).map(functools.partial(_row_of, int(i), kib * 1024))


def _row_of(i: int, nbytes: int, j: Any) -> Any:
    return np.full(nbytes, i, np.uint8)


def sized_shard(
    i: Any, lengths: tuple[int, ...], nbytes: int, grow_at: int, inner: str = "plain"
) -> Any:
    """An inner dataset of random shape for checkpoint generators: ``lengths[i % len]``
    elements of shard ``i``, arrays of ``nbytes`` that grow 8x from element ``grow_at``
    on (mid-stream), every third one a view of a larger array; ``inner`` adds a stage
    inside the worker's pipeline: ``"shuffle"`` (its RNG state travels in the slot's
    checkpoint) or ``"prefetch"`` (its buffer is dropped and re-read on restore)."""
    import headrace as hr

    count = lengths[int(i) % len(lengths)]
    ds = hr.Dataset.range(count).map(
        functools.partial(_sized_row, int(i), nbytes, grow_at),
        output_signature=hr.TensorSpec((None,), np.uint8),
    )
    if inner == "shuffle":
        ds = ds.shuffle(3, seed=int(i))
    elif inner == "prefetch":
        ds = ds.prefetch(2)
    return ds


def _sized_row(shard: int, nbytes: int, grow_at: int, j: Any) -> Any:
    size = nbytes * (8 if int(j) >= grow_at else 1)
    if int(j) % 3 == 2:  # a view of the middle of an array four times its size
        big = np.full(size * 4, shard, np.uint8)
        row = big[size : 2 * size]
    else:
        row = np.full(size, shard, np.uint8)
    row[:1] = int(j) % 251
    return row


def half_of(dataset: Any, i: Any) -> Any:
    """Half ``i`` of ``dataset`` (elements ``i, i + 2, ...``): an inner pipeline made from a
    pickled dataset, in the worker process that reads the slot."""
    return dataset.shard(2, int(i))


class Unsendable:
    """An output that cannot be pickled back from a worker (a lock, an open socket...)."""

    def __reduce__(self) -> Any:
        raise TypeError("Unsendable cannot be pickled")


def faulty(plan: tuple[tuple[int, str], ...], markers: str, size: int, x: Any) -> Any:
    """``np.full(size, x)``, or the fault ``plan`` names for element value ``x``:

    ``raise`` (:class:`Failing`), ``kill_once`` (SIGKILL this worker the first time,
    a marker file in ``markers`` remembers it), ``kill_always`` (SIGKILL every time),
    ``unsendable`` (an output that cannot be pickled). ``oracle_faulty`` is what a
    fault-free run gives for the same plan."""
    import signal

    kind = dict(plan).get(int(x))
    time.sleep(0.0005)  # chunks of a few elements: a kill hits a chunk in flight
    if kind == "raise":
        raise Failing(f"bad element {int(x)}")
    if kind == "kill_once":
        marker = os.path.join(markers, f"killed-{int(x)}")
        if not os.path.exists(marker):
            with open(marker, "w"):
                pass
            os.kill(os.getpid(), signal.SIGKILL)
    if kind == "kill_always":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "unsendable":
        return Unsendable()
    return np.full(size, int(x), np.int64)


def oracle_faulty(plan: tuple[tuple[int, str], ...], size: int, x: Any) -> Any:
    """What :func:`faulty` must amount to: kills once are invisible, an element that
    kills every worker and an unsendable output are that element's WorkerError."""
    import headrace as hr

    kind = dict(plan).get(int(x))
    if kind == "raise":
        raise Failing(f"bad element {int(x)}")
    if kind in ("kill_always", "unsendable"):
        raise hr.WorkerError(f"element {int(x)}: {kind}")
    return np.full(size, int(x), np.int64)


def jump_output(at: int, small: int, large: int, seconds: float, x: Any) -> Any:
    """An array of ``small`` bytes for ``x < at``, of ``large`` bytes from there on (a
    regime jump after many quick elements); each element takes ``seconds`` (busy)."""
    if seconds:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass
    out = np.empty(small if int(x) < at else large, np.uint8)
    out.fill(int(x) % 251)
    return out


def sized_output(plan: dict[int, tuple[int, str]], x: Any) -> Any:
    """An array of ``plan[x][0]`` bytes filled with ``x % 251``, or the fault ``plan[x][1]``
    names: ``kill`` (SIGKILL this worker once: the first time ``x`` runs in a worker whose
    parent pid is not in the plan's marker), ``raise`` (:class:`Failing`), ``unsendable``."""
    import signal

    nbytes, fault = plan[int(x)]
    if fault == "raise":
        raise Failing(f"bad element {int(x)}")
    if fault == "unsendable":
        return Unsendable()
    if fault.startswith("kill:"):  # kill:<marker file>: once
        marker = fault[len("kill:"):]
        if not os.path.exists(marker):
            with open(marker, "w"):
                pass
            os.kill(os.getpid(), signal.SIGKILL)
    out = np.empty(nbytes, np.uint8)
    out.fill(int(x) % 251)
    return out


def giant_at(at: int, nbytes: int, x: Any) -> Any:
    """A small array, except an array of ``nbytes`` (its pages touched) for ``x == at``."""
    if int(x) == at:
        return np.ones(nbytes, np.uint8)
    return np.full(16, int(x), np.int64)


def varied_output(seed: int, x: Any) -> Any:
    """An output whose structure differs element to element (drawn from ``seed`` and the
    element): strings, bytes, arrays of several dtypes, small and large, nested in
    tuples, lists and dicts, some objects met more than once in the same output."""
    import random

    rng = random.Random(seed * 1_000_003 + int(x))

    def leaf(depth: int) -> Any:
        kind = rng.randrange(8 if depth < 3 else 5)
        if kind == 0:
            return f"s{rng.randrange(1 << 20)}"
        if kind == 1:
            return bytes([rng.randrange(256)]) * rng.choice([1, 100, 70_000])
        if kind == 2:
            dtype = rng.choice(["u1", "i4", "f8", "<U3", "bool"])
            return np.arange(rng.choice([1, 7, 50_000]) % 400_000).astype(dtype)
        if kind == 3:
            return rng.choice([None, True, 3, -2.5, 1 << 70])
        if kind == 4:
            return np.dtype(rng.choice(["u1", "i4", "f8"]))
        items = [leaf(depth + 1) for _ in range(rng.randrange(1, 4))]
        items += [items[rng.randrange(len(items))]]  # one object met twice
        if kind == 5:
            return tuple(items)
        if kind == 6:
            return items
        return {f"k{i}": item for i, item in enumerate(items)}

    return leaf(0)


def worker_only_class_on(bad: frozenset[int], x: Any) -> Any:
    """For the elements in ``bad``, an instance of a class from a module that exists
    only in the worker process (the parent cannot rebuild it); ``x`` for the others."""
    import sys
    import types

    if int(x) not in bad:
        return x
    module = sys.modules.get("headrace_test_only_in_worker")
    if module is None:
        module = types.ModuleType("headrace_test_only_in_worker")
        exec("class Thing:\n    pass\n", module.__dict__)
        sys.modules[module.__name__] = module
    return module.Thing()


def record_batches(batch: int, path: Any) -> Any:
    """One TFRecord shard's raw records in batches of ``batch``."""
    import headrace as hr

    return hr.TFRecordDataset(os.fsdecode(path)).batch(batch)


class PayloadError(ValueError):
    """An error that carries data (the rows it refused), as a user's error may."""

    def __init__(self, i: int, payload: Any) -> None:
        super().__init__(f"bad row {i}")
        self.payload = payload


def payload_error(every: int, nbytes: int, seconds: float, x: Any) -> Any:
    """``float(x)`` for every ``every``-th element, after ``seconds`` (so that the errors
    raised meanwhile wait for their turn); for the others a :class:`PayloadError`
    carrying an array of ``nbytes`` filled with ``x``."""
    i = int(x)
    if i % every == 0:
        time.sleep(seconds)
        return np.float64(i)
    raise PayloadError(i, np.full(nbytes // 8, i, np.float64))


def nested_every(every: int, depth: int, x: Any) -> Any:
    """``[x]`` for most elements; every ``every``-th one nested ``depth`` lists deep."""
    i = int(x)
    value: Any = [np.int64(i)]
    if i % every == 0:
        for _ in range(depth):
            value = [value]
    return value


def unpicklable_on(bad: int, x: Any) -> Any:
    """``x``, except for ``bad``: a dict holding a lock, which cannot be pickled."""
    import threading

    return {"lock": threading.Lock()} if int(x) == bad else x


def shard_unpicklable_at(bad: int, i: Any) -> Any:
    """An inner dataset of 7 elements ``i * 100 + j``; ``bad`` cannot be pickled."""
    import headrace as hr

    ds = hr.Dataset.range(int(i) * 100, int(i) * 100 + 7)
    return ds.map(functools.partial(unpicklable_on, bad))


def string_element(kind: str, wrap: str, i: Any) -> Any:
    """Element ``i`` of one kind holding strings (bytes with a trailing NUL, non-ASCII
    str), with its scalar strings as they are (``wrap="plain"``), as 0-d object arrays
    (``"array"``) or through ``tf_compat.constant`` (``"constant"``: str encoded, as
    TensorFlow does). The batch tests compare a wrapped pipeline with its plain twin."""
    i = int(i)

    def text(value: bytes | str) -> Any:
        if wrap == "array":
            return np.array(value, dtype=object)
        if wrap == "constant":
            from headrace import tf_compat

            return tf_compat.constant(value)
        return value.encode() if wrap == "plain-encoded" and isinstance(value, str) else value

    raw = b"s%d\x00" % i
    if kind == "bytes":
        return text(raw)
    if kind == "str":
        return text(f"\u00e9{i}")
    if kind == "tuple":
        return (np.int64(i), text(raw), np.float32(i / 2))
    if kind == "dict":
        return {"id": np.int64(i), "text": text(f"t{i}"), "raw": text(raw)}
    if kind == "vector":  # a 1-D object array beside a scalar: only the scalar is wrapped
        return (np.array([raw, b"v"], dtype=object), text(raw))
    raise ValueError(f"string_element: unknown kind {kind!r}")


def filled_kib(kib: int, x: Any) -> Any:
    """``kib`` KiB of float32, every value ``x``: a kept output shows if a later one overwrote it."""
    return np.full(kib * 256, float(x), np.float32)


def scratch_sum(kib: int, x: Any) -> int:
    """Fill and sum a fresh ``kib`` KiB temporary (an image's decode buffer): a small output."""
    scratch = np.empty(kib * 256, np.float32)
    scratch.fill(float(x))
    return int(scratch[0]) + int(scratch.size)


def fixed_from_bytes(kib: int, record: Any) -> Any:
    """``kib`` KiB of float32 whatever the input's size (a JPEG decoded to a fixed size),
    every value the input's length: each output shows which input it came from."""
    return np.full(kib * 256, float(len(record)), np.float32)


def gated_filled(kib: int, gate: str, x: Any) -> Any:
    """:func:`filled_kib`, where a negative ``x`` (its value is then ``-x``) first waits
    until the file ``gate`` exists: a call that runs until the test lets it end."""
    if x < 0:
        deadline = time.monotonic() + 60
        while not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.005)
        x = -x
    return np.full(kib * 256, float(x), np.float32)


def slow_filled(kib: int, seconds: float, x: Any) -> Any:
    """:func:`filled_kib` after ``seconds`` of sleep when ``x`` is negative (its value
    is then ``-x``): a call that is still running while the consumer acts."""
    if x < 0:
        time.sleep(seconds)
        x = -x
    return np.full(kib * 256, float(x), np.float32)


def len_after(seconds: float, x: Any) -> int:
    """``len(x)``, after ``seconds``: a call still running when the next one is sent."""
    time.sleep(seconds)
    return len(x)

"""Caches, snapshots and saves are keyed by what the data *is*, not its shape.

A generator draws an input (an array source, an array a map's closure captures, a
module-level array a map function reads directly, through a helper or as a lambda, a
memory-mapped ``.npy`` file, a TFRecord file), runs it through ``cache(filename)``
or ``snapshot(path)``, changes the input in a random way that keeps every shape and
dtype (one element; a file rewritten with the same size, its mtime kept or not, as
``cp -p`` and ``rsync -t`` keep it), and runs an equal pipeline
over the new input through the same cache. The oracle is the uncached pipeline over
the new input: a cache must never serve the old data. A cache data file swapped for
another pipeline's (same size) is refused with DataLossError naming it.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import headrace as hr
from headrace.io.tfrecord.writer import write_tfrecord
from headrace.testing import assert_elements_equal

SOURCES = [
    "slices",
    "closure",
    "global",
    "global_helper",
    "global_lambda",
    "npy",
    "tfrecord",
    "tfrecord_parallel",
    "list_files",
]
SINKS = ["cache", "snapshot", "snapshot_gzip"]


def _values(seed: int, rows: int, dtype: str) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 1000, size=(rows, 3)).astype(dtype)


def _changed(values: np.ndarray[Any, Any], seed: int) -> np.ndarray[Any, Any]:
    """``values`` with one element changed: same shape, same dtype, same byte size."""
    rng = np.random.default_rng(seed)
    out = values.copy()
    index = tuple(int(rng.integers(0, n)) for n in out.shape)
    out[index] = out[index] + 1 + int(rng.integers(0, 5))
    return out


_TABLE: np.ndarray[Any, Any] = np.zeros((0, 3))  # the module-level table "global" reads


def _global_lookup(i: Any) -> Any:
    return _TABLE[i]


def _via_helper(i: Any) -> Any:
    return _global_lookup(i)


_global_lambda = lambda i: _TABLE[i]  # noqa: E731 - a module-level lambda is the case


def _pipeline(kind: str, values: np.ndarray[Any, Any], work: Path, keep_mtime: bool = False) -> hr.Dataset:
    """A pipeline reading ``values`` through source ``kind`` (files written under ``work``;
    written again with the same size when the values change, the old mtime restored
    where ``keep_mtime``)."""
    global _TABLE
    if kind.startswith("global"):
        _TABLE = values  # the same functions, a new value of the global they read
        fn = {"global": _global_lookup, "global_helper": _via_helper}.get(kind, _global_lambda)
        return hr.Dataset.range(len(values)).map(fn)
    if kind == "slices":
        return hr.Dataset.from_tensor_slices(values)
    if kind == "closure":
        table = values

        def lookup(i: Any) -> Any:
            return table[i]

        return hr.Dataset.range(len(values)).map(lookup)
    if kind == "npy":
        path = work / "input.npy"
        _rewrite(path, lambda p: np.save(p, values), keep_mtime)
        return hr.Dataset.from_npy(path)
    if kind == "tfrecord":
        path = work / "input.tfrecord"
        _rewrite(path, lambda p: write_tfrecord(str(p), [row.tobytes() for row in values]), keep_mtime)
        return hr.TFRecordDataset(str(path))
    # files opened inside an interleave: keyed by the identities of the listed files
    paths = [work / f"part-{i}.tfrecord" for i in range(2)]
    for i, path in enumerate(paths):
        rows = [row.tobytes() for row in values[i::2]]
        _rewrite(path, lambda p, rows=rows: write_tfrecord(str(p), rows), keep_mtime)
    if kind == "tfrecord_parallel":
        return hr.TFRecordDataset([str(p) for p in paths], num_parallel_reads=2)
    return hr.Dataset.list_files(str(work / "part-*.tfrecord"), shuffle=False).interleave(
        hr.TFRecordDataset, cycle_length=2
    )


def _rewrite(path: Path, write: Callable[[Path], None], keep_mtime: bool = False) -> None:
    """Write the file in place (same inode where it existed), as a user regenerating
    it would; at least a clock tick after the last write, as any real rewrite is.
    With ``keep_mtime``, the old times are restored, as ``cp -p`` or ``rsync -t`` do."""
    if path.exists():
        before = path.stat()
        temp = path.with_suffix(".new" + path.suffix)
        write(temp)
        data = temp.read_bytes()
        temp.unlink()
        if data == path.read_bytes():
            return  # unchanged (the oracle's pipeline): leave the file and its mtime alone
        time.sleep(0.02)
        path.write_bytes(data)  # same file, same size, new bytes
        if keep_mtime:
            os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    else:
        write(path)


def _cached(ds: hr.Dataset, sink: str, where: Path) -> hr.Dataset:
    if sink == "cache":
        return ds.cache(str(where / "c"))
    if sink == "snapshot":
        return ds.snapshot(str(where / "snap"))
    return ds.snapshot(str(where / "snap"), compression="GZIP")


def _elements(ds: hr.Dataset) -> list[Any]:
    return list(ds.as_numpy_iterator())


@settings(max_examples=36, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    source=st.sampled_from(SOURCES),
    sink=st.sampled_from(SINKS),
    rows=st.integers(1, 40),
    dtype=st.sampled_from(["int64", "float32", "uint8"]),
    seed=st.integers(0, 2**16),
    keep_mtime=st.booleans(),
)
def test_a_changed_input_never_reads_the_old_cache(
    tmp_path_factory: pytest.TempPathFactory,
    source: str,
    sink: str,
    rows: int,
    dtype: str,
    seed: int,
    keep_mtime: bool,
) -> None:
    work = tmp_path_factory.mktemp("content")
    old = _values(seed, rows, dtype)
    new = _changed(old, seed + 1)
    first = _elements(_cached(_pipeline(source, old, work), sink, work))
    for got, want in zip(first, _elements(_pipeline(source, old, work)), strict=True):
        assert_elements_equal(got, want)
    # an equal pipeline over the changed input, through the same cache path
    again = _cached(_pipeline(source, new, work, keep_mtime), sink, work)
    oracle = _elements(_pipeline(source, new, work))
    with _logged("headrace") as records:
        got = _elements(again)
    if sink == "cache":  # the cache made for the old input is rebuilt, and the log says so
        assert any("cache" in record.getMessage() for record in records), records
    assert len(got) == len(oracle)
    for index, (a, b) in enumerate(zip(got, oracle, strict=True)):
        assert_elements_equal(a, b, where=f"element {index} after the input changed")


class _logged:
    """The records logged under ``name`` (INFO and up) while the block runs."""

    def __init__(self, name: str) -> None:
        import logging

        self.logger = logging.getLogger(name)
        self.records: list[Any] = []
        self.handler = logging.Handler(logging.INFO)
        self.handler.emit = self.records.append  # type: ignore[method-assign]
        self.level = self.logger.level

    def __enter__(self) -> list[Any]:
        import logging

        self.logger.addHandler(self.handler)
        self.logger.setLevel(logging.INFO)
        return self.records

    def __exit__(self, *args: object) -> None:
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.level)


_CALLS: list[int] = []


def test_an_unchanged_input_reads_the_cache_and_hashes_once(tmp_path: Path) -> None:
    values = _values(0, 50, "int64")
    calls = _CALLS
    calls.clear()
    ds = hr.Dataset.from_tensor_slices(values)

    def seen(x: Any) -> Any:
        _CALLS.append(1)  # a global: counted without becoming part of the closure
        return x

    cached = ds.map(seen).snapshot(str(tmp_path / "s"))
    assert len(_elements(cached)) == 50
    assert len(_elements(cached)) == 50 and len(calls) == 50  # the second pass read the file
    rebuilt = hr.Dataset.from_tensor_slices(values.copy()).map(seen).snapshot(str(tmp_path / "s"))
    assert len(_elements(rebuilt)) == 50 and len(calls) == 50  # equal content: same snapshot


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sink=st.sampled_from(SINKS),
    rows=st.integers(2, 40),
    seed=st.integers(0, 2**16),
)
def test_a_data_file_of_another_cache_is_refused_naming_it(
    tmp_path_factory: pytest.TempPathFactory, sink: str, rows: int, seed: int
) -> None:
    """Two pipelines whose data differ in one element (so their cache files have the
    same size); one's data file copied over the other's (index too) is refused before
    any element of it is served."""
    work = tmp_path_factory.mktemp("swap")
    old = _values(seed, rows, "int64")
    new = _changed(old, seed + 1)
    (work / "a").mkdir()
    (work / "b").mkdir()
    a = _cached(hr.Dataset.from_tensor_slices(old), sink, work / "a")
    b = _cached(hr.Dataset.from_tensor_slices(new), sink, work / "b")
    _elements(a)
    _elements(b)
    (data_a,) = (work / "a").rglob("*.hrcache")
    (data_b,) = (work / "b").rglob("*.hrcache")
    # (compressed, the one changed element may change the size: then old headraces
    # refused the file too, by its size)
    assume(data_a.stat().st_size == data_b.stat().st_size)
    shutil.copyfile(data_b, data_a)
    shutil.copyfile(str(data_b) + ".hrx", str(data_a) + ".hrx")
    served: list[Any] = []
    with pytest.raises(hr.DataLossError, match=str(data_a)):
        for element in a.as_numpy_iterator():
            served.append(element)
    # whatever came before the refusal is the right data
    for got, want in zip(served, old, strict=False):
        assert_elements_equal(got, want)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("reads", ["attribute", "function"])
@pytest.mark.parametrize("store", ["cache", "snapshot"])
def test_another_modules_global_changed_never_reads_the_old_cache(
    tmp_path: Path, seed: int, reads: str, store: str,
) -> None:
    """A map reads a table and a scale that live in another module, as ``module.TABLE``
    or through ``module.lookup(i)``; one of them changes (in place, or rebound): the
    cache is the uncached pipeline's new values (it served the old ones)."""
    import importlib
    import inspect
    import random
    import sys

    rng = random.Random(seed)
    name = f"headrace_test_content_module_{seed}_{reads}_{store}"
    (tmp_path / f"{name}.py").write_text(
        "import numpy as np\nTABLE = np.arange(10.0)\nSCALE = 1.0\n"
        "def lookup(i):\n    return TABLE[int(i) % 10] * SCALE\n")
    sys.path.insert(0, str(tmp_path))
    try:
        module = importlib.import_module(name)

        def fn(i: Any) -> Any:  # the module in a closure's cell
            if reads == "function":
                return module.lookup(i)
            return module.TABLE[int(i) % 10] * module.SCALE

        if rng.random() < 0.5:  # the module a global of the function's own module
            namespace: dict[str, Any] = {"module": module, "reads": reads, "Any": Any}
            exec(compile(inspect.getsource(fn).replace("        ", "", 1).replace(
                "\n        ", "\n"), "<fn>", "exec"), namespace)
            fn = namespace["fn"]

        where = str(tmp_path / store)

        def run() -> list[float]:
            ds = hr.Dataset.range(10).map(fn)
            ds = ds.cache(where) if store == "cache" else ds.snapshot(where)
            return [float(x) for x in ds]

        assert run() == [float(i) for i in range(10)]
        if rng.random() < 0.5:
            module.TABLE[rng.randrange(10)] += 100.0
        else:
            module.SCALE = rng.choice([2.0, 3.0])
        assert run() == [float(module.lookup(i)) for i in range(10)]
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(name, None)

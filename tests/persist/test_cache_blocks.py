"""cache(filename) read in runs of records and batched column by column: every element
structure a generator makes (arrays of many dtypes and shapes, NumPy and Python scalars,
bytes/str/objects, None, ragged arrays, dicts, tuples, namedtuples) gives, through
``cache(file)`` and ``cache(file).batch(n)``, exactly what the uncached pipeline gives
(the oracle); checkpoints restore at every step; a corrupted, truncated or substituted
file is an error naming the file and the byte offset."""

from __future__ import annotations

import collections
import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import headrace as hr
from headrace._persist import records as records_module
from headrace.io._native import set_native_enabled
from headrace.testing import assert_checkpoint_roundtrip

Point = collections.namedtuple("Point", ["u", "v"])

#: Array dtypes the generator draws from (a big-endian one and times included).
_DTYPES = ["i1", "u2", "<i4", ">i4", "<i8", "f2", "<f4", ">f8", "c8", "?", "<m8[s]", "<M8[ms]"]


def _leaf_maker(rng: np.random.Generator, fixed: bool) -> Callable[[np.random.Generator, int], Any]:
    """One leaf's maker (element rng, element index -> value); ``fixed``: only leaves of
    one size in every element (what the column-by-column path decodes)."""
    kinds = ["array", "npscalar", "int", "float", "bool", "complex"]
    if not fixed:
        kinds += ["bytes", "str", "none", "strings", "ragged", "bigint", "list"]
    kind = kinds[int(rng.integers(len(kinds)))]
    dtype = np.dtype(_DTYPES[int(rng.integers(len(_DTYPES)))])
    shape = tuple(int(d) for d in rng.integers(0, 4, size=int(rng.integers(0, 3))))
    if kind == "array" and rng.random() < 0.15:
        shape = (1100,)  # records past the scanner's size: checked one CRC call each

    def values(r: np.random.Generator, count: int) -> np.ndarray[Any, Any]:
        raw = r.integers(-100, 100, size=count)
        if dtype.kind == "?" or dtype.kind == "b":
            return (raw > 0).astype(dtype)
        return raw.astype(dtype)

    if kind == "array":
        return lambda r, i: values(r, int(np.prod(shape, dtype=np.int64))).reshape(shape)
    if kind == "npscalar":
        return lambda r, i: values(r, 1)[0]
    if kind == "int":
        return lambda r, i: int(r.integers(-(1 << 62), 1 << 62))
    if kind == "float":
        return lambda r, i: float(r.standard_normal())
    if kind == "bool":
        return lambda r, i: bool(r.random() < 0.5)
    if kind == "complex":
        return lambda r, i: complex(r.standard_normal(), r.standard_normal())
    if kind == "bytes":
        return lambda r, i: bytes(r.integers(0, 256, size=int(r.integers(0, 6)), dtype=np.uint8))
    if kind == "str":
        return lambda r, i: "é" * int(r.integers(0, 4)) + str(i)
    if kind == "none":
        return lambda r, i: None
    if kind == "strings":
        return lambda r, i: np.array([str(i), "x" * int(r.integers(0, 3))], dtype=object)
    if kind == "bigint":
        return lambda r, i: (1 << 70) + i
    if kind == "list":
        return lambda r, i: [i, i + 1]
    return lambda r, i: np.arange(i % 4, dtype=np.int32)  # ragged


def _structure_maker(
    rng: np.random.Generator, fixed: bool, depth: int = 0
) -> Callable[[np.random.Generator, int], Any]:
    roll = rng.random() if depth < 2 else 1.0
    if roll < 0.3:  # a dict, keys in insertion order (not sorted)
        keys = [f"k{j}{'z' * (3 - j)}" for j in rng.permutation(int(rng.integers(1, 4)))]
        parts = [_structure_maker(rng, fixed, depth + 1) for _ in keys]
        return lambda r, i: {key: part(r, i) for key, part in zip(keys, parts, strict=True)}
    if roll < 0.45:
        parts = [_structure_maker(rng, fixed, depth + 1) for _ in range(int(rng.integers(1, 4)))]
        return lambda r, i: tuple(part(r, i) for part in parts)
    if roll < 0.55:
        u, v = _structure_maker(rng, fixed, depth + 1), _structure_maker(rng, fixed, depth + 1)
        return lambda r, i: Point(u(r, i), v(r, i))
    return _leaf_maker(rng, fixed)


def _element_fn(seed: int, fixed: bool) -> Callable[[Any], Any]:
    make = _structure_maker(np.random.default_rng(seed), fixed)

    def element(i: Any) -> Any:
        return make(np.random.default_rng([seed, int(i)]), int(i))

    return element


def _outcome(dataset: hr.Dataset) -> tuple[list[Any], BaseException | None]:
    """The elements of one pass, and the error that ended it (if one did): a pass that
    ends in an error leaves a partial cache, discarded with tf.data's warning."""
    got: list[Any] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with iter(dataset) as iterator:
                for element in iterator:
                    got.append(element)
        except Exception as error:  # (a batch of unlike elements: the batcher's own error)
            assert all("partial" in str(w.message) for w in caught), caught
            return got, error
    assert not caught, [str(w.message) for w in caught]
    return got, None


def _same(actual: Any, expected: Any, where: str) -> None:
    """Equal in type, structure, dtype, shape and value (dict order included)."""
    assert type(actual) is type(expected), f"{where}: {type(actual)} != {type(expected)}"
    if isinstance(expected, dict):
        assert list(actual) == list(expected), f"{where}: keys {list(actual)} != {list(expected)}"
        for key in expected:
            _same(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (tuple, list)):
        assert len(actual) == len(expected), where
        for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
            _same(a, e, f"{where}[{index}]")
    elif isinstance(expected, (np.ndarray, np.generic)):
        assert actual.dtype == expected.dtype and actual.dtype.str == expected.dtype.str, (
            f"{where}: dtype {actual.dtype.str} != {expected.dtype.str}"
        )
        assert np.shape(actual) == np.shape(expected), f"{where}: shape"
        if expected.dtype.hasobject:
            assert np.asarray(actual).tolist() == np.asarray(expected).tolist(), where
        else:
            assert np.array_equal(actual, expected), f"{where}: {actual!r:.200} != {expected!r:.200}"
    else:
        assert actual == expected, f"{where}: {actual!r:.80} != {expected!r:.80}"


def _same_outcome(actual: tuple[list[Any], Any], expected: tuple[list[Any], Any]) -> None:
    assert len(actual[0]) == len(expected[0])
    for index, (a, e) in enumerate(zip(actual[0], expected[0], strict=True)):
        _same(a, e, f"element {index}")
    if expected[1] is None:
        assert actual[1] is None, f"unexpected error {actual[1]!r}"
    else:
        assert type(actual[1]) is type(expected[1]) and str(actual[1]) == str(expected[1])


class _Columnar:
    """Counts the batches the cache served column by column (the fast path taken)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.batches = 0
        original = records_module.RecordReader.read_batch

        def spy(reader: Any, *args: Any, **kwargs: Any) -> Any:
            found = original(reader, *args, **kwargs)
            self.batches += found is not None
            return found

        monkeypatch.setattr(records_module.RecordReader, "read_batch", spy)


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed-size", "any"])
@pytest.mark.parametrize("seed", range(12))
def test_cached_batches_equal_the_uncached_pipeline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int, fixed: bool
) -> None:
    rng = np.random.default_rng(1000 + seed)
    count = int(rng.integers(1, 60))
    batch_size = int(rng.choice([1, 3, 7, 16, 64]))
    drop = bool(rng.random() < 0.3)
    budget = int(rng.choice([1 << 20, 64 << 20]))  # small: runs of a few records per read
    options = hr.Options(memory_budget=budget)
    source = hr.Dataset.range(count).map(_element_fn(seed, fixed)).with_options(options)
    prefix = str(tmp_path / "c")
    expected = _outcome(source.batch(batch_size, drop_remainder=drop))
    cached = source.cache(prefix).batch(batch_size, drop_remainder=drop)
    spy = _Columnar(monkeypatch)
    _same_outcome(_outcome(cached), expected)  # writing the cache
    assert spy.batches == 0
    assert os.path.exists(prefix + ".hrcache.json") == (expected[1] is None)
    _same_outcome(_outcome(cached), expected)  # reading it
    if fixed and expected[0] and expected[1] is None:
        assert spy.batches > 0  # (the column-by-column path was the one compared)
    elements = _outcome(source)
    _same_outcome(_outcome(source.cache(prefix)), elements)  # the cache alone
    _same_outcome(_outcome(source.cache(prefix)), elements)


@pytest.mark.parametrize("seed", range(4))
def test_cached_batches_restore_at_every_step(tmp_path: Path, seed: int) -> None:
    source = hr.Dataset.range(40).map(_element_fn(50 + seed, fixed=seed % 2 == 0))
    cached = source.cache(str(tmp_path / "c")).batch(6, drop_remainder=seed == 1)
    assert_checkpoint_roundtrip(cached)  # the first iterator writes; the rest read
    assert_checkpoint_roundtrip(cached.repeat(2))


def test_a_checkpoint_taken_while_writing_restores_into_the_columnar_reader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = hr.Dataset.range(30).map(lambda i: {"x": np.full(3, i, np.float32), "i": i})
    cached = source.cache(str(tmp_path / "c")).batch(4)
    writer = iter(cached)
    next(writer)
    next(writer)
    state = writer.get_state()
    rest = [batch["i"].tolist() for batch in writer]  # writes the rest: the cache is complete
    spy = _Columnar(monkeypatch)
    restored = iter(cached)
    restored.set_state(state)
    assert [batch["i"].tolist() for batch in restored] == rest
    assert spy.batches == len(rest)


@pytest.mark.parametrize(
    ("width", "odd", "columnar"), [(1, 5, 0), (2000, 40, 2)], ids=["scanned", "read-into-rows"]
)
def test_elements_that_change_skeleton_within_a_run_are_batched_one_by_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, width: int, odd: int, columnar: int
) -> None:
    # records of one size whose skeletons differ (another key of the same length)
    source = hr.Dataset.range(60).map(
        lambda i: {"a" if int(i) != odd else "b": np.full(width, i, np.int32)}
    )
    expected = _outcome(source.batch(16))
    cached = source.cache(str(tmp_path / "c")).batch(16)
    list(cached)
    spy = _Columnar(monkeypatch)
    _same_outcome(_outcome(cached), expected)
    assert spy.batches == columnar  # (before the odd one; one by one from there)


def test_cached_batches_are_booked_on_the_stages(tmp_path: Path) -> None:
    """A batch that cannot fit the batch stage's share is refused, naming the batch
    stage, before its columns are allocated — as the element-by-element batcher does."""
    source = hr.Dataset.range(64).map(lambda i: np.full(16 << 10, i, np.uint8))
    prefix = str(tmp_path / "c")
    list(source.cache(prefix))
    small = hr.Options(memory_budget=1 << 20)
    with pytest.raises(hr.MemoryBudgetError, match="batch"):
        list(source.cache(prefix).batch(64).with_options(small))
    with iter(source.cache(prefix).batch(4).with_options(small)) as reader:
        fits = list(reader)
        stages = {stage.name: stage for stage in reader.stats().stages}
    assert [int(batch[0, 0]) for batch in fits] == list(range(0, 64, 4))
    # records this large are read straight into the batch's rows from the first batch
    # on: the cache stage books only their frames and skeleton, never a record
    assert stages["cache"].peak < 16 << 10
    assert stages["batch"].peak >= 4 * (16 << 10)  # the batch books the rows read
    # read to the end: the cache stage holds only the manifest's CRCs (4 bytes a record;
    # records of one size need no index in memory), its read buffer already gone; the
    # batches left with the consumer
    assert (stages["cache"].held, stages["batch"].held) == (64 * 4, 0)


def _written(tmp_path: Path, values: Callable[[Any], Any], count: int = 200) -> tuple[hr.Dataset, str]:
    prefix = str(tmp_path / "c")
    cached = hr.Dataset.range(count).map(values).cache(prefix).batch(32)
    list(cached)
    return cached, prefix + ".hrcache"


def _touch_like(path: str, data: bytes) -> None:
    stat = os.stat(path)
    Path(path).write_bytes(data)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # bit rot: the mtime stays


@pytest.mark.parametrize("native", [True, False], ids=["c", "python"])
@pytest.mark.parametrize("width", [4, 2000], ids=["scanned", "one-crc-each"])
def test_a_corrupted_record_names_the_file_and_its_offset(
    tmp_path: Path, width: int, native: bool
) -> None:
    """The C run check and the NumPy one (no extension) stop at the same record."""
    previous = set_native_enabled(native)
    try:
        _corrupted_record_is_named(tmp_path, width)
    finally:
        set_native_enabled(previous)


def _corrupted_record_is_named(tmp_path: Path, width: int) -> None:
    cached, data = _written(tmp_path, lambda i: np.full(width, i, np.int32))
    raw = bytearray(Path(data).read_bytes())
    record = len(raw) // 200
    raw[record * 77 + 40] ^= 0x10  # inside the 78th record's payload
    _touch_like(data, bytes(raw))
    with pytest.raises(hr.DataLossError, match=f"offset {record * 77} in file {data}") as raised:
        list(cached)
    assert raised.value.path == data and raised.value.offset == record * 77


@pytest.mark.parametrize("width", [8, 1000], ids=["scanned", "read-into-rows"])
def test_a_file_truncated_under_an_open_reader_is_an_error_naming_it(
    tmp_path: Path, width: int
) -> None:
    cached, data = _written(tmp_path, lambda i: np.full(width, i, np.int64))
    reader = iter(cached)
    first = next(reader)
    assert first.tolist()[:2] == [[0] * width, [1] * width]
    size = os.path.getsize(data)
    os.truncate(data, size - size // 3)
    with pytest.raises(hr.DataLossError, match=f"in file {data}") as raised:
        list(reader)
    assert raised.value.path == data and raised.value.offset is not None
    assert raised.value.offset <= size - size // 3


def test_another_caches_data_file_is_refused_naming_the_record(tmp_path: Path) -> None:
    cached, data = _written(tmp_path / "a" if (tmp_path / "a").mkdir() is None else tmp_path,
                            lambda i: np.full(8, i, np.int64))
    other = tmp_path / "b"
    other.mkdir()
    _, other_data = _written(other, lambda i: np.full(8, 1000 + i, np.int64))
    shutil.copyfile(other_data, data)  # same size, same index: other values and CRCs
    shutil.copyfile(other_data + ".hrx", data + ".hrx")
    with pytest.raises(hr.DataLossError, match="record 0 at offset 0 is not the one") as raised:
        list(cached)
    assert raised.value.path == data and raised.value.offset == 0


def _batches_of(iterator: Iterator[Any]) -> list[list[int]]:
    return [batch.tolist() for batch in iterator]


def test_snapshot_reads_batches_column_by_column(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = hr.Dataset.range(50).map(lambda i: np.int64(i) * 3)
    snap = source.snapshot(str(tmp_path / "s"), compression=None).batch(8)
    first = _batches_of(iter(snap))
    spy = _Columnar(monkeypatch)
    assert _batches_of(iter(snap)) == first == _batches_of(iter(source.batch(8)))
    assert spy.batches == len(first)


def test_large_records_are_read_straight_into_the_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From the first batch on (the layout read from the first record's head), large
    records are read into the batch's rows with no buffer in between, so no read
    buffer is ever held beside a batch; the batches are the uncached pipeline's."""
    source = hr.Dataset.range(70).map(
        lambda i: (np.full((30, 50), i, np.float32), {"i": int(i), "z": np.zeros(0, np.int8)})
    )
    cached = source.cache(str(tmp_path / "c")).batch(16)
    list(cached)
    scattered = []
    original = records_module.RecordReader._scatter_batch

    def spy(reader: Any, *args: Any) -> Any:
        found = original(reader, *args)
        scattered.append(found is not None)
        return found

    monkeypatch.setattr(records_module.RecordReader, "_scatter_batch", spy)
    expected = _outcome(source.batch(16))
    _same_outcome(_outcome(cached), expected)
    assert scattered == [True] * 5  # every batch, the first too
    assert_checkpoint_roundtrip(cached, max_checkpoints=8)


def test_the_read_buffer_is_gone_once_the_file_is_read(tmp_path: Path) -> None:
    source = hr.Dataset.range(300).map(lambda i: {"x": np.full(4, i, np.float32), "y": i})
    prefix = str(tmp_path / "c")
    list(source.cache(prefix))
    with iter(source.cache(prefix).batch(64)) as reader:
        batches = list(reader)
        stages = {stage.name: stage for stage in reader.stats().stages}
    assert [batch["y"].tolist() for batch in batches] == [
        list(range(start, min(start + 64, 300))) for start in range(0, 300, 64)
    ]
    assert stages["cache"].peak > 300 * 4  # its CRCs, and the runs read
    assert (stages["cache"].held, stages["batch"].held) == (300 * 4, 0)


@pytest.mark.parametrize("width", [3, 1500], ids=["scanned", "read-into-rows"])
@pytest.mark.parametrize("seed", range(4))
def test_any_flipped_byte_is_an_error_naming_its_record(
    tmp_path: Path, width: int, seed: int
) -> None:
    """Wherever a byte of the file rots (frame, skeleton, data, CRC), the batches stop
    at an error naming the file and the offset of the record that holds it; no batch
    holding a changed value is ever handed out."""
    cached, data = _written(tmp_path, lambda i: {"v": np.full(width, i, np.int32), "i": i}, 120)
    raw = bytearray(Path(data).read_bytes())
    record = len(raw) // 120
    rng = np.random.default_rng(seed)
    where = int(rng.integers(len(raw)))
    raw[where] ^= 1 << int(rng.integers(8))
    _touch_like(data, bytes(raw))
    served: list[Any] = []
    with pytest.raises(hr.DataLossError, match=f"in file {data}") as raised:
        for batch in cached:
            served.append(batch)
    assert raised.value.path == data and raised.value.offset == where // record * record
    assert len(served) == where // record // 32  # the batches before the rotten record
    for number, batch in enumerate(served):
        rows = np.arange(number * 32, number * 32 + 32)
        assert batch["i"].tolist() == rows.tolist()
        assert np.array_equal(batch["v"], np.repeat(rows[:, None], width, axis=1))


class _LoadColumnar:
    """Counts the batches ``load`` served column by column."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from headrace._persist import saved

        self.batches = 0
        original = saved._LoadedAccess.read_batch

        def spy(access: Any, *args: Any, **kwargs: Any) -> Any:
            found = original(access, *args, **kwargs)
            self.batches += found is not None
            return found

        monkeypatch.setattr(saved._LoadedAccess, "read_batch", spy)


@pytest.mark.parametrize("sharded", [False, True], ids=["one-shard", "uneven-shards"])
@pytest.mark.parametrize("fixed", [True, False], ids=["fixed-size", "any"])
@pytest.mark.parametrize("seed", range(4))
def test_loaded_batches_equal_the_plain_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int, fixed: bool, sharded: bool
) -> None:
    """``load().batch(n)`` against the same batch made element by element (the reader's
    column-by-column route switched off) and against the saved pipeline itself."""
    from headrace._persist import saved

    rng = np.random.default_rng(2000 + seed)
    count = int(rng.integers(1, 50))
    batch_size = int(rng.choice([1, 4, 9, 32]))
    drop = bool(rng.random() < 0.3)
    source = hr.Dataset.range(count).map(_element_fn(300 + seed, fixed))
    path = str(tmp_path / "saved")
    if sharded:  # three shards of uneven sizes: the load's order interleaves them
        source = source.enumerate()
        source.save(path, shard_func=lambda i, x: int(i) % 3 if int(i) < 20 else 0)
    else:
        source.save(path)
    loaded = hr.Dataset.load(path).batch(batch_size, drop_remainder=drop)
    with monkeypatch.context() as off:
        off.setattr(saved._LoadedAccess, "read_batch", lambda *args, **kwargs: None)
        expected = _outcome(loaded)
    if not sharded:
        _same_outcome(expected, _outcome(source.batch(batch_size, drop_remainder=drop)))
    spy = _LoadColumnar(monkeypatch)
    _same_outcome(_outcome(loaded), expected)
    if fixed and expected[0] and expected[1] is None:
        assert spy.batches > 0
    if expected[1] is None:
        assert_checkpoint_roundtrip(loaded, max_checkpoints=6)


def test_a_corrupted_saved_record_names_the_file_and_its_offset(tmp_path: Path) -> None:
    path = tmp_path / "saved"
    hr.Dataset.range(100).map(lambda i: np.full(5, i, np.int64)).save(str(path))
    shard = sorted(path.glob("shard-*.tfrecord"))[0]
    records = hr.Dataset.load(str(path)).cardinality() // len(list(path.glob("shard-*.tfrecord")))
    raw = bytearray(shard.read_bytes())
    record = len(raw) // records
    raw[record * 21 + 30] ^= 0x04
    _touch_like(str(shard), bytes(raw))
    with pytest.raises(hr.DataLossError, match=f"offset {record * 21} in file") as raised:
        list(hr.Dataset.load(str(path)).batch(16))
    assert raised.value.offset == record * 21 and raised.value.path == str(shard)


@pytest.mark.parametrize("odd", [None, 37], ids=["alike", "another-key-at-37"])
def test_loaded_large_records_batch_one_copy_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, odd: int | None
) -> None:
    source = hr.Dataset.range(70).map(
        lambda i: {"a" if int(i) != odd else "b": np.full((40, 30), i, np.float32), "i": i}
    )
    path = str(tmp_path / "saved")
    from headrace._persist import saved

    with monkeypatch.context() as older:  # save refuses the odd element now: a save an
        older.setattr(saved.SpecCheck, "problem", lambda *args: "")  # older one wrote
        source.save(path)
    loaded = hr.Dataset.load(path).batch(16)

    with monkeypatch.context() as off:  # the plain batch (load refuses the odd element)
        off.setattr(saved._LoadedAccess, "read_batch", lambda *args, **kwargs: None)
        expected = _outcome(loaded)
    assert (expected[1] is None) == (odd is None)
    if odd is None:
        _same_outcome(expected, _outcome(source.batch(16)))
    spy = _LoadColumnar(monkeypatch)
    _same_outcome(_outcome(loaded), expected)
    assert spy.batches == (5 if odd is None else 2)  # (one by one from the odd one's batch)


def test_a_loaded_batch_of_large_records_needs_the_budget_the_plain_batch_does(
    tmp_path: Path,
) -> None:
    """Four 2.4 MB records batch under 12 MiB, as the plain batch does: the records are
    read into the batch a piece at a time, not all first (which needed 19 MiB, the
    outsider's a2). A batch that cannot fit is refused as a batch, and again at the
    next call, as the plain batch is (the stream ended after one refusal)."""
    rows = hr.Dataset.range(12).map(lambda i: np.full(300_000, int(i), np.float64))
    path = str(tmp_path / "saved")
    rows.save(path, num_shards=3)
    options = hr.Options(memory_budget="12MiB")
    loaded = [batch[:, 0].tolist() for batch in hr.Dataset.load(path).batch(4).with_options(options)]
    assert loaded == [[float(i) for i in range(k, k + 4)] for k in (0, 4, 8)]
    small = hr.Dataset.load(path).batch(8).with_options(hr.Options(memory_budget="12MiB"))
    with iter(small) as iterator:
        for _ in range(2):
            with pytest.raises(hr.MemoryBudgetError, match="a batch of 8 elements"):
                next(iterator)

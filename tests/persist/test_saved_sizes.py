"""A saved part whose records all have one framed size records it in the manifest
(``record_bytes``); ``load`` then computes that part's offsets instead of holding its
``.hrx`` index (8 bytes a record, 1.6 MB for 200,000 small records). Parts of mixed
sizes record 0 and are read through their index, as saves made before the field
existed are. A manifest whose ``record_bytes`` does not describe its part is refused
with a DataLossError naming the file, never read at wrong offsets."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import headrace as hr
from headrace._persist.records import EvenOffsets
from headrace._persist.saved import MANIFEST_NAME, PROGRESS_NAME
from headrace.testing import assert_checkpoint_roundtrip, assert_elements_equal


def fixed(n: int) -> hr.Dataset:
    """Elements of one encoded size (so every part's records share one framed size)."""
    return hr.Dataset.from_tensor_slices(
        {"x": np.arange(n * 4, dtype=np.float32).reshape(n, 4), "y": np.arange(n)}
    )


def manifest_of(path: Path) -> dict[str, Any]:
    manifest: dict[str, Any] = json.loads((path / MANIFEST_NAME).read_text())
    return manifest


def rewrite(path: Path, manifest: dict[str, Any]) -> None:
    (path / MANIFEST_NAME).write_text(json.dumps(manifest))


def parts(path: Path) -> list[Path]:
    return sorted(path.glob("shard-*.tfrecord"))


def assert_same(actual: list[Any], expected: list[Any]) -> None:
    assert len(actual) == len(expected)
    for k, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert_elements_equal(a, e, where=f"element {k}")


def test_one_size_parts_record_their_size_and_load_without_their_indexes(tmp_path: Path) -> None:
    ours, indexed = tmp_path / "ours", tmp_path / "indexed"
    ds = fixed(103)
    ds.save(str(ours), num_shards=3)
    ds.save(str(indexed), num_shards=3)
    manifest = manifest_of(ours)
    sizes = [size for shard in manifest["record_bytes"] for size in shard]
    counts = [count for shard in manifest["parts"] for count in shard]
    assert len(sizes) == 3 and len(set(sizes)) == 1 and sizes[0] > 0
    for part, count, size in zip(parts(ours), counts, sizes, strict=True):
        assert part.stat().st_size == count * size
    for index in ours.glob("*.hrx"):  # never read: removed, the save still loads
        index.unlink()
    old = manifest_of(indexed)  # the same save read through its indexes
    del old["record_bytes"]
    rewrite(indexed, old)

    loaded = hr.Dataset.load(str(ours))
    assert_same(list(loaded), list(ds))
    assert_same(list(loaded.batch(10)), list(ds.batch(10)))
    assert_same(list(loaded.batch(32, drop_remainder=True)), list(ds.batch(32, drop_remainder=True)))
    shuffled = [int(e["y"]) for e in loaded.global_shuffle(seed=3)]
    assert sorted(shuffled) == list(range(103)) and shuffled != list(range(103))
    assert shuffled == [int(e["y"]) for e in hr.Dataset.load(str(indexed)).global_shuffle(seed=3)]
    assert [int(e["y"]) for e in loaded.shard(4, 1)] == list(range(1, 103, 4))
    assert_checkpoint_roundtrip(loaded.global_shuffle(seed=3).batch(4), max_checkpoints=15)
    assert_checkpoint_roundtrip(loaded.batch(7), max_checkpoints=15)


def test_parts_of_mixed_sizes_record_zero_and_are_read_through_their_index(
    tmp_path: Path,
) -> None:
    # Round robin over 2 shards: shard 0 holds the even elements (all b"ab", one
    # size), shard 1 the odd ones (1 to 3 bytes).
    values = [b"ab" if i % 2 == 0 else b"a" * (1 + i % 3) for i in range(40)]
    ds = hr.Dataset.from_tensor_slices(values)
    ds.save(str(tmp_path), num_shards=2)
    sizes = manifest_of(tmp_path)["record_bytes"]
    assert sizes[0][0] > 0 and sizes[1] == [0]
    assert list(hr.Dataset.load(str(tmp_path))) == values
    mixed = tmp_path / "shard-00001-00000.tfrecord.hrx"
    mixed.unlink()  # the mixed part needs its index: its absence is named
    with pytest.raises(hr.DataLossError, match=f"no index file {mixed}"):
        list(hr.Dataset.load(str(tmp_path)))


def test_a_save_that_records_no_sizes_loads_as_before(tmp_path: Path) -> None:
    """Saves made before ``record_bytes`` existed (no such field): every part's index
    is loaded, and the elements come back as saved, one by one and batched."""
    ds = fixed(50)
    ds.save(str(tmp_path), num_shards=2)
    manifest = manifest_of(tmp_path)
    del manifest["record_bytes"]
    rewrite(tmp_path, manifest)
    assert_same(list(hr.Dataset.load(str(tmp_path))), list(ds))
    assert_same(list(hr.Dataset.load(str(tmp_path)).batch(8)), list(ds.batch(8)))
    (tmp_path / "shard-00000-00000.tfrecord.hrx").unlink()
    with pytest.raises(hr.DataLossError, match="no index file"):
        list(hr.Dataset.load(str(tmp_path)))


@pytest.mark.parametrize("change", [-1, 1, 100])
def test_a_record_size_the_part_is_not_made_of_is_refused_naming_the_part(
    tmp_path: Path, change: int
) -> None:
    fixed(20).save(str(tmp_path), num_shards=2)
    manifest = manifest_of(tmp_path)
    manifest["record_bytes"][1][0] += change
    rewrite(tmp_path, manifest)
    part = tmp_path / "shard-00001-00000.tfrecord"
    size, claimed = part.stat().st_size, manifest["record_bytes"][1][0]
    assert size == 10 * (claimed - change)
    with pytest.raises(
        hr.DataLossError,
        match=f"load: {part} holds {size} bytes where 10 records of {claimed} bytes",
    ):
        list(hr.Dataset.load(str(tmp_path)))


@pytest.mark.parametrize("read", ["one by one", "batched", "shuffled"])
def test_records_not_at_the_offsets_record_bytes_gives_are_a_data_loss_error(
    tmp_path: Path, read: str
) -> None:
    """A part of records of two sizes whose length is a whole number of records of a
    size claimed by an edited manifest: the size check passes, and each read record's
    framing does not — a DataLossError naming the file, no element served."""
    hr.Dataset.range(20).map(lambda i: np.zeros(int(i) % 2 * 2, np.uint8)).save(
        str(tmp_path), num_shards=1
    )
    (part,) = parts(tmp_path)
    manifest = manifest_of(tmp_path)
    assert manifest["record_bytes"] == [[0]]
    manifest["record_bytes"] = [[part.stat().st_size // 20]]
    assert part.stat().st_size % 20 == 0
    rewrite(tmp_path, manifest)
    loaded = hr.Dataset.load(str(tmp_path))
    pipeline = {
        "one by one": loaded,
        "batched": loaded.batch(4),
        "shuffled": loaded.global_shuffle(seed=1),
    }[read]
    got: list[Any] = []
    with pytest.raises(hr.DataLossError, match=f"in file {part}"):
        got.extend(pipeline)
    assert got == []


@pytest.mark.parametrize(
    "wrong", ["138", [[-1], [138]], [[1.5], [138]], [[True], [138]], [[138, 138], [138]],
              [[138]], [], {"0": [138]}, [["a"], [138]], [None, [138]]],
)
def test_a_malformed_record_bytes_is_a_data_loss_error_naming_the_manifest(
    tmp_path: Path, wrong: Any
) -> None:
    fixed(20).save(str(tmp_path), num_shards=2)
    manifest = manifest_of(tmp_path)
    manifest["record_bytes"] = wrong
    rewrite(tmp_path, manifest)
    with pytest.raises(hr.DataLossError, match="'record_bytes'") as raised:
        hr.Dataset.load(str(tmp_path))
    assert str(tmp_path / MANIFEST_NAME) in str(raised.value)


class Interrupted:
    """``range(100)`` as dicts, through a map that raises at element ``fail_at`` (the
    same function object resumed: the save's identity is unchanged); counts what it
    produced."""

    def __init__(self, fail_at: int) -> None:
        self.fail_at, self.produced = fail_at, 0

    def __call__(self, i: Any) -> Any:
        if int(i) == self.fail_at:
            raise RuntimeError("interrupted")
        self.produced += 1
        return {"x": np.full(2, i)}


ARGS = {"checkpoint_interval": 20}


def _interrupted_save(path: Path) -> tuple[hr.Dataset, Interrupted]:
    stop = Interrupted(55)
    ds = hr.Dataset.range(100).map(stop)
    with pytest.raises(RuntimeError, match="interrupted"):
        ds.save(str(path), checkpoint_args=ARGS, num_shards=3)
    stop.fail_at, stop.produced = -1, 0
    return ds, stop


def test_a_resumed_save_records_the_size_of_every_part(tmp_path: Path) -> None:
    ds, stop = _interrupted_save(tmp_path)
    ds.save(str(tmp_path), checkpoint_args=ARGS, num_shards=3)
    assert stop.produced == 60  # resumed from the checkpoint at 40
    manifest = manifest_of(tmp_path)
    sizes = manifest["record_bytes"]
    assert [len(shard) for shard in sizes] == [len(shard) for shard in manifest["parts"]]
    assert len({size for shard in sizes for size in shard}) == 1 and sizes[0][0] > 0
    for index in tmp_path.glob("*.hrx"):
        index.unlink()
    assert [int(e["x"][0]) for e in hr.Dataset.load(str(tmp_path))] == list(range(100))


def test_a_save_resumed_from_an_older_progress_file_reads_those_parts_by_index(
    tmp_path: Path,
) -> None:
    """A progress file an older headrace wrote records no sizes: the parts it lists are
    recorded as 0 (read through their indexes), the parts written after as their size."""
    ds, stop = _interrupted_save(tmp_path)
    progress = json.loads((tmp_path / PROGRESS_NAME).read_text())
    del progress["record_bytes"]
    (tmp_path / PROGRESS_NAME).write_text(json.dumps(progress))
    done = [len(shard) for shard in progress["parts"]]
    ds.save(str(tmp_path), checkpoint_args=ARGS, num_shards=3)
    assert stop.produced == 60
    sizes = manifest_of(tmp_path)["record_bytes"]
    for shard, before in zip(sizes, done, strict=True):
        assert before > 0 and len(shard) > before
        assert shard[:before] == [0] * before and all(size > 0 for size in shard[before:])
    assert [int(e["x"][0]) for e in hr.Dataset.load(str(tmp_path))] == list(range(100))


def test_reading_a_one_size_save_holds_no_index(tmp_path: Path) -> None:
    """Python's allocations while ``load().batch(1024)`` reads 100,000 small records:
    the two parts' indexes alone are 800 KB; what is read is a batch and a piece."""
    fixed(100_000).save(str(tmp_path), num_shards=2)
    assert sum(1 for _ in hr.Dataset.load(str(tmp_path)).batch(1024)) == 98  # warm
    tracemalloc.start()
    try:
        rows = sum(len(batch["y"]) for batch in hr.Dataset.load(str(tmp_path)).batch(1024))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert rows == 100_000
    assert peak < 400_000, peak


def test_even_offsets_answer_as_an_index_does() -> None:
    offsets = EvenOffsets(10, 5)
    expected = np.arange(5, dtype=np.uint64) * np.uint64(10)
    assert len(offsets) == 5 and offsets[0] == 0 and offsets[4] == 40 and offsets[-1] == 40
    assert offsets[np.int64(2)] == 20
    np.testing.assert_array_equal(offsets[1:4], expected[1:4])
    np.testing.assert_array_equal(offsets[::2], expected[::2])
    picked = offsets[np.array([4, 0, -2])]
    assert picked.dtype == np.uint64
    np.testing.assert_array_equal(picked, [40, 0, 30])
    assert offsets[np.array([], dtype=np.int64)].size == 0
    with pytest.raises(IndexError, match="record 5 of 5"):
        offsets[5]
    with pytest.raises(IndexError, match="record 7 of 5"):
        offsets[np.array([1, 7])]
    with pytest.raises(IndexError, match="record -6 of 5"):
        offsets[np.array([-6])]

"""Dataset.save / Dataset.load: exact round trips, tf.data's sharding and reading order,
random access (global_shuffle, resume), resumable writes, corruption, a full disk."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import headrace as hr
from headrace._persist.saved import MANIFEST_NAME, PROGRESS_NAME
from headrace.io import tfrecord as tfrecord_module
from headrace.testing import assert_checkpoint_roundtrip, assert_elements_equal


def rows(n: int) -> hr.Dataset:
    return hr.Dataset.range(n).map(
        lambda i: {"x": np.full(3, i, np.float32), "name": f"row {int(i)}", "raw": b"\x00" * int(i % 3)},
        output_signature={
            "x": hr.TensorSpec((3,), np.float32),
            "name": hr.TensorSpec((), str),
            "raw": hr.TensorSpec((), bytes),
        },
    )


def assert_same(actual: list[Any], expected: list[Any]) -> None:
    assert len(actual) == len(expected)
    for k, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert_elements_equal(a, e, where=f"element {k}")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    count=st.integers(0, 40),
    num_shards=st.integers(1, 5),
    compression=st.sampled_from([None, "GZIP", "ZLIB"]),
    modulo=st.one_of(st.none(), st.integers(1, 4)),
)
def test_load_of_save_gives_the_dataset_back(
    tmp_path_factory: pytest.TempPathFactory,
    count: int,
    num_shards: int,
    compression: str | None,
    modulo: int | None,
) -> None:
    path = tmp_path_factory.mktemp("saved")
    ds = rows(count)
    shard_func = None if modulo is None else (lambda e: int(e["x"][0]) % modulo)
    ds.save(path, shard_func=shard_func, compression=compression, num_shards=num_shards)
    loaded = hr.Dataset.load(path)
    assert loaded.element_spec == ds.element_spec
    got = list(loaded)
    if modulo is None:  # round robin + the default interleave: the saved order
        assert_same(got, list(ds))
    else:  # shards interleaved one at a time, as tf.data's default reader_func
        shards = [[e for e in ds if int(e["x"][0]) % modulo == s] for s in range(modulo)]
        expected = [shard[k] for k in range(count) for shard in shards if k < len(shard)]
        assert_same(got, expected)
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    assert manifest["elements"] == count


def test_loaded_uncompressed_dataset_is_random_access(tmp_path: Path) -> None:
    rows(50).save(tmp_path, num_shards=3)
    loaded = hr.Dataset.load(tmp_path)
    assert loaded.node.random_access() is not None and len(loaded) == 50
    shuffled = [int(e["x"][0]) for e in loaded.global_shuffle(seed=3)]
    assert sorted(shuffled) == list(range(50)) and shuffled != list(range(50))
    assert [int(e["x"][0]) for e in loaded.shard(4, 1)] == list(range(1, 50, 4))
    assert_checkpoint_roundtrip(loaded.global_shuffle(seed=3).batch(4), max_checkpoints=15)


def test_reader_func_gets_the_shards_as_a_dataset_of_datasets(tmp_path: Path) -> None:
    rows(10).save(tmp_path, shard_func=lambda e: int(e["x"][0]) % 2)
    loaded = hr.Dataset.load(
        tmp_path, reader_func=lambda shards: shards.interleave(lambda s: s, cycle_length=1)
    )
    assert [int(e["x"][0]) for e in loaded] == [0, 2, 4, 6, 8, 1, 3, 5, 7, 9]


def test_an_unfinished_save_is_not_loadable_and_says_why(tmp_path: Path) -> None:
    def boom(e: Any) -> Any:
        if int(e["x"][0]) == 30:
            raise RuntimeError("stop")
        return e

    with pytest.raises(RuntimeError):
        rows(60).map(boom).save(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"not a complete saved dataset.*no headrace-dataset\.json"):
        hr.Dataset.load(tmp_path)
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_save_resumes_from_its_last_checkpoint(tmp_path: Path) -> None:
    produced: list[int] = []
    fail_at = [55]

    def note(i: Any) -> Any:
        if int(i) == fail_at[0]:
            raise RuntimeError("interrupted")
        produced.append(int(i))
        return {"x": np.full(2, i)}

    ds = hr.Dataset.range(100).map(note)
    args = {"checkpoint_interval": 20}
    with pytest.raises(RuntimeError, match="interrupted"):
        ds.save(tmp_path, checkpoint_args=args, num_shards=3)
    assert (tmp_path / PROGRESS_NAME).exists()
    with pytest.raises(FileNotFoundError, match="save again"):
        hr.Dataset.load(tmp_path)
    produced.clear()
    fail_at[0] = -1
    ds.save(tmp_path, checkpoint_args=args, num_shards=3)
    assert produced == list(range(40, 100))  # resumed from the checkpoint at 40
    assert [int(e["x"][0]) for e in hr.Dataset.load(tmp_path)] == list(range(100))
    assert not (tmp_path / PROGRESS_NAME).exists()


def test_checkpoint_args_are_checked() -> None:
    with pytest.raises(hr.InvalidArgumentError, match="not supported"):
        rows(2).save("/tmp/never", checkpoint_args={"max_to_keep": 2})
    with pytest.raises(hr.InvalidArgumentError, match="checkpoint_interval"):
        rows(2).save("/tmp/never", checkpoint_args={"checkpoint_interval": 0})


def test_corrupt_shard_names_file_and_offset(tmp_path: Path) -> None:
    rows(600).save(tmp_path, num_shards=1)  # > 2 x 4 KiB: the middle is past the index check
    shard = tmp_path / "shard-00000-00000.tfrecord"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x55
    mtime = shard.stat().st_mtime_ns
    shard.write_bytes(bytes(raw))
    os.utime(shard, ns=(mtime, mtime))  # same size and mtime: only the CRC can tell
    with pytest.raises(hr.DataLossError, match=f"in file {shard}") as raised:
        list(hr.Dataset.load(tmp_path))
    assert raised.value.offset is not None


def test_full_disk_while_saving_is_a_clear_error_with_no_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(writer: Any, records: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tfrecord_module.TFRecordWriter, "write_many", full)
    with pytest.raises(OSError, match="save: no space left on the device writing shard") as raised:
        rows(30).save(tmp_path)
    assert raised.value.errno == errno.ENOSPC
    assert not (tmp_path / MANIFEST_NAME).exists()
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_elements_that_cannot_be_stored_are_refused_naming_the_component(tmp_path: Path) -> None:
    ds = hr.Dataset.range(3).map(lambda i: {"bad": {1, 2}})
    with pytest.raises(hr.ElementSpecError, match="'/bad' of type set"):
        ds.save(tmp_path)


def test_shard_func_must_return_a_non_negative_int(tmp_path: Path) -> None:
    with pytest.raises(hr.InvalidArgumentError, match="shard_func must return an int >= 0"):
        rows(3).save(tmp_path, shard_func=lambda e: -1)


@pytest.mark.parametrize("element", [None, (3, None), {"x": 1.5, "m": None}, (None, (b"a", None))])
def test_elements_holding_none_load_as_saved(tmp_path: Path, element: Any) -> None:
    """None is a component the element format stores (tf.data's NoneTensorSpec): what
    save wrote, load reads back (its manifest's spec once called itself corrupted)."""
    ds = hr.Dataset.from_tensors(element).repeat(3)
    ds.save(str(tmp_path / "saved"))
    assert list(hr.Dataset.load(str(tmp_path / "saved"))) == list(ds)


@pytest.mark.parametrize("shard", [4096, 1_000_000, (1 << 64) - 1])
def test_a_shard_id_past_the_limit_is_refused_before_any_file_is_made(
    tmp_path: Path, shard: int,
) -> None:
    """Each shard id up to the largest is a shard of its own: an id of a million made
    17,393 files for 20 elements (and went on), instead of a clear error."""
    out = tmp_path / "saved"
    ds = hr.Dataset.range(20)
    with pytest.raises(hr.InvalidArgumentError, match=rf"returned {shard} for element 3.*4095"):
        ds.save(str(out), shard_func=lambda x: np.uint64(shard) if int(x) == 3 else np.int64(0))
    assert len(list(out.rglob("*"))) < 10


@pytest.mark.parametrize(
    "change",
    [
        lambda i: np.int64(i),  # dtype
        lambda i: np.full(2, i, np.int32),  # rank
        lambda i: (np.int32(i),),  # structure
    ],
    ids=["dtype", "rank", "structure"],
)
@pytest.mark.parametrize("at", [1, 7])
def test_elements_that_change_spec_mid_stream_are_refused_by_save(
    tmp_path: Path, change: Any, at: int
) -> None:
    """A map whose outputs change dtype, rank or structure after ``at`` elements: save
    refuses the first that differs from the spec its manifest would record, naming it,
    and leaves no manifest. It wrote a save that load then refused (the outsider's a1)."""
    ds = hr.Dataset.range(12).map(lambda i: np.int32(i) if int(i) < at else change(i))
    with pytest.raises(hr._errors.ElementSpecError, match=f"save: element {at} does not match"):
        ds.save(str(tmp_path), num_shards=3)
    assert not (tmp_path / "headrace-dataset.json").exists()
    with pytest.raises(FileNotFoundError, match="not a complete saved dataset"):
        list(hr.Dataset.load(str(tmp_path)))

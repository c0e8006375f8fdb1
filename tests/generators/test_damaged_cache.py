"""A damaged record in a cache or snapshot file costs that record only (G5).

Generator: random elements (small records of one size, read as runs and batched column
by column; sizes that differ, read one by one; large records, read into the batch's rows
or each into a buffer of its own), random damage (a flipped bit anywhere in one to three
records: length, checksums, payload), random stages after the read (batch with and
without ``drop_remainder``, skip, take). Oracle: the same pipeline over the source
with those elements raising ``DataLossError``: every good record comes out where it
would, each damaged one raises once in its place (a batch drops the rows it gathered
and raises, as with any element's error), and the reading goes on after it. Before,
the records of a run before a damaged one never came out and ``next()`` raised the
same error forever.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import headrace as hr

END = "END"


def _element(kind: str, index: int) -> np.ndarray[Any, Any]:
    size = {"small": 24, "mixed": 8 + index % 7, "scatter": 1500, "large": 9000}[kind]
    return np.full(size, index, np.float32)


def _tail(dataset: hr.Dataset, rng: np.random.Generator,
          padded: bool) -> tuple[hr.Dataset, str]:
    """A skip or a take (2 cases in 3), then a batch (2 in 3): the column-by-column read
    passes both, so a damaged record must count in each as an element error does."""
    steps = []
    if rng.integers(3):
        count = int(rng.integers(0, 12))
        if rng.integers(2):
            dataset, step = dataset.skip(count), f"skip({count})"
        else:
            dataset, step = dataset.take(count), f"take({count})"
        steps.append(step)
    if rng.integers(3):  # (elements of several sizes: padded)
        size, whole = int(rng.integers(1, 9)), bool(rng.integers(2))
        dataset = (dataset.padded_batch(size, drop_remainder=whole) if padded
                   else dataset.batch(size, drop_remainder=whole))
        steps.append(f"batch({size}, drop_remainder={whole}, padded={padded})")
    return dataset, ".".join(steps) or "none"


def _outputs(dataset: hr.Dataset, limit: int) -> list[Any]:
    out: list[Any] = []
    iterator = iter(dataset)
    for _ in range(limit):
        try:
            value = np.asarray(next(iterator))
        except StopIteration:
            out.append(END)
            break
        except hr.DataLossError:
            out.append("DataLossError")
            continue
        out.append(value[..., 0].tolist())  # each element's index (its first value)
    return out


def _frames(data: bytes) -> list[tuple[int, int]]:
    """(offset, size) of each framed record of a cache file (back to back from 0)."""
    frames, at = [], 0
    while at < len(data):
        size = int.from_bytes(data[at : at + 8], "little") + 16
        frames.append((at, size))
        at += size
    return frames


@pytest.mark.parametrize("seed", range(60))
def test_a_damaged_record_costs_only_itself(tmp_path: Path, seed: int) -> None:
    rng = np.random.default_rng(seed)
    kind = ["small", "mixed", "scatter", "large"][seed % 4]
    count = int(rng.integers(4, 40 if kind in ("small", "mixed") else 16))
    snapshot = bool(rng.integers(2))

    def source() -> hr.Dataset:
        return hr.Dataset.range(count).map(lambda i: _element(kind, int(i)))

    if snapshot:
        written = source().snapshot(tmp_path / "snap", compression=None)
    else:
        written = source().cache(str(tmp_path / "c"))
    assert len(list(written)) == count
    (path,) = glob.glob(str(tmp_path / "**" / "*.hrcache"), recursive=True)
    data = bytearray(Path(path).read_bytes())
    frames = _frames(bytes(data))
    assert len(frames) == count
    damaged = sorted(rng.choice(count, size=int(rng.integers(1, min(3, count) + 1)),
                                replace=False).tolist())
    for record in damaged:
        offset, size = frames[record]
        where = offset + int(rng.integers(size))
        data[where] ^= 1 << int(rng.integers(8))
    os.chmod(path, 0o644)
    Path(path).write_bytes(bytes(data))

    def damaged_source(index: Any) -> np.ndarray[Any, Any]:
        if int(index) in damaged:
            raise hr.DataLossError(f"element {int(index)} is damaged")
        return _element(kind, int(index))

    read = (source().snapshot(tmp_path / "snap", compression=None) if snapshot
            else source().cache(str(tmp_path / "c")))
    tail_rng = np.random.default_rng(seed + 1000)
    ours, what = _tail(read, tail_rng, kind == "mixed")
    # (streamed, as the file is read: over random access, take and skip count an element
    # that raises as its position; streamed, as in tf.data, they count elements made)
    streamed = hr.Dataset.range(count).filter(lambda i: True).map(damaged_source)
    oracle, _ = _tail(streamed, np.random.default_rng(seed + 1000), kind == "mixed")
    limit = count + 8
    assert _outputs(ours, limit) == _outputs(oracle, limit), (kind, count, damaged, what,
                                                                snapshot)


def test_a_state_taken_after_a_damaged_record_resumes_after_it(tmp_path: Path) -> None:
    source = hr.Dataset.range(12).map(lambda i: np.full(24, i, np.float32))
    cached = source.cache(str(tmp_path / "c"))
    list(cached)
    path = str(tmp_path / "c.hrcache")
    data = bytearray(Path(path).read_bytes())
    offset, size = _frames(bytes(data))[5]
    data[offset + size // 2] ^= 4
    Path(path).write_bytes(bytes(data))
    iterator = iter(cached)
    assert [int(next(iterator)[0]) for _ in range(5)] == [0, 1, 2, 3, 4]
    with pytest.raises(hr.DataLossError, match=f"offset {offset} in file {path}"):
        next(iterator)
    state = iterator.get_state()
    assert int(next(iterator)[0]) == 6
    resumed = iter(cached)
    resumed.set_state(state)
    assert [int(row[0]) for row in resumed] == list(range(6, 12))


_SAVED_WIDTH = 20_000  # float32s a record of the save: 80 KB


def test_a_damaged_record_of_a_save_costs_only_itself(tmp_path: Path) -> None:
    """``load()``, read by a batch column by column: the same oracle, over random cases
    until 10 of them reached the stream. Records of 80 KB in one shard (a smaller shard
    is read whole when it opens); damage in a block that ``load`` samples when it opens
    is refused there, naming the file, which is fine and not counted."""
    streamed_cases = 0
    for seed in range(60):
        if streamed_cases == 10:
            break
        rng = np.random.default_rng(seed)
        count = int(rng.integers(16, 30))
        source = hr.Dataset.range(count).map(lambda i: np.full(_SAVED_WIDTH, i, np.float32))
        directory = tmp_path / f"saved-{seed}"
        source.save(str(directory), num_shards=1)
        (path,) = glob.glob(str(directory / "*.tfrecord"))
        data = bytearray(Path(path).read_bytes())
        frame = len(data) // count  # (records of one size: 12 B of head, 4 B of CRC)
        damaged = sorted(rng.choice(count, size=int(rng.integers(1, 4)),
                                    replace=False).tolist())
        for record in damaged:
            data[record * frame + 12 + int(rng.integers(frame - 16))] ^= 1 << int(rng.integers(8))
        Path(path).write_bytes(bytes(data))
        try:
            loaded = hr.Dataset.load(str(directory))
        except hr.DataLossError as error:
            assert path in str(error)
            continue
        streamed_cases += 1

        def damaged_source(index: Any, damaged: list[int] = damaged) -> np.ndarray[Any, Any]:
            if int(index) in damaged:
                raise hr.DataLossError(f"element {int(index)} is damaged")
            return np.full(_SAVED_WIDTH, int(index), np.float32)

        ours, what = _tail(loaded, np.random.default_rng(seed + 1000), False)
        # (a save is read by index: a skip or take counts positions, read or not, as
        # over any random-access source, the damaged element's too)
        addressed = hr.Dataset.range(count).map(damaged_source)
        oracle, _ = _tail(addressed, np.random.default_rng(seed + 1000), False)
        limit = count + 8
        assert _outputs(ours, limit) == _outputs(oracle, limit), (seed, count, damaged, what)
    assert streamed_cases == 10

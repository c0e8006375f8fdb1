"""Bad images in TFRecord shards: the error names the file, the record and its byte offset.

A generator writes random shards of JPEG and PNG records with a few bad ones at random
places — truncated at a random byte, a frame header that claims more rows than the
data holds, a "bomb" whose header declares more than ``max_pixels`` — and decodes
them with a drawn image op (whole decode, windowed decode, the fused random resized
crop, InceptionCrop), sequentially, on threads and in worker processes, on the C and
the Pillow paths. Each failure must come in its record's place, with
:func:`headrace._errors.element_origin` (and the note a user reads) naming exactly the
shard, the record's index in it and its byte offset; ``ignore_errors()`` must drop
exactly those records and nothing else, in order.
"""

from __future__ import annotations

import json
import re
import struct
import warnings
from pathlib import Path
from typing import Any

import image_fns
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from image_fns import PROVENANCE_MAX_PIXELS, PROVENANCE_OPS, encode, photo

import headrace as hr
import headrace.image as hi
from headrace._errors import Origin, element_origin
from headrace.core.state import seal
from headrace.io._native import set_native_enabled
from headrace.io.tfrecord.writer import write_tfrecord

_OVERHEAD = 16  # TFRecord framing bytes around each payload


def _lying(data: bytes, factor: int) -> bytes:
    """The JPEG with a frame header claiming ``factor`` times its rows."""
    out = bytearray(data)
    sof = out.index(b"\xff\xc0")
    (height,) = struct.unpack_from(">H", out, sof + 5)
    struct.pack_into(">H", out, sof + 5, min(height * factor, 65000))
    return bytes(out)


def _record(kind: str, draw: Any, seed: int) -> bytes:
    height, width = draw(st.integers(8, 48)), draw(st.integers(8, 48))
    image = photo(height, width, 3, seed)
    if kind == "png":
        return encode(image, "PNG")
    data = encode(image, "JPEG", quality=85)
    if kind == "truncated":
        return data[: draw(st.integers(4, len(data) - 3))]
    if kind == "lying":
        return _lying(data, draw(st.integers(4, 40)))
    if kind == "bomb":  # a real image, over max_pixels: refused from its header
        side = int(np.sqrt(PROVENANCE_MAX_PIXELS)) + draw(st.integers(1, 40))
        return encode(photo(side, side, 3, seed), draw(st.sampled_from(["JPEG", "PNG"])))
    return data


@st.composite
def shards(draw: Any) -> list[list[bytes]]:
    """1-3 shards of 1-8 records each, about one in five of them bad."""
    out = []
    for shard in range(draw(st.integers(1, 3))):
        kinds = draw(st.lists(
            st.sampled_from(["jpeg"] * 6 + ["png", "truncated", "lying", "bomb"]),
            min_size=1, max_size=8,
        ))
        out.append([_record(kind, draw, 100 * shard + i) for i, kind in enumerate(kinds)])
    return out


def _write(tmp: Path, content: list[list[bytes]]) -> list[str]:
    paths = []
    for number, records in enumerate(content):
        path = tmp / f"shard-{number:05d}.tfrecord"
        write_tfrecord(path, records)
        paths.append(str(path))
    return paths


def _expected(paths: list[str], content: list[list[bytes]], op: Any) -> tuple[
    list[Any], list[Origin]
]:
    """What decoding each record directly gives: the good outputs in order, and the
    origins (file, record, offset) of the records that raise."""
    outputs, bad = [], []
    for path, records in zip(paths, content, strict=True):
        offset = 0
        for number, record in enumerate(records):
            try:
                outputs.append(op(record))
            except ValueError:
                bad.append(Origin(path, number, offset))
            offset += len(record) + _OVERHEAD
    return outputs, bad


_run = image_fns.drain


def _same(got: list[Any], wanted: list[Any], ordered: bool) -> None:
    assert len(got) == len(wanted)
    if not ordered:  # a shuffle: the same outputs, each once
        def key(array: Any) -> tuple[Any, ...]:
            return (array.shape, array.tobytes())

        got, wanted = sorted(got, key=key), sorted(wanted, key=key)
    for output, expected in zip(got, wanted, strict=True):
        np.testing.assert_array_equal(output, expected)


def _check(
    paths: list[str], content: list[list[bytes]], op: Any, ds_of: Any, ordered: bool = True
) -> None:
    wanted, bad = _expected(paths, content, op)
    outputs, errors = _run(ds_of(False))
    origins = [element_origin(error) for error in errors]
    assert (origins if ordered else sorted(origins)) == bad  # type: ignore[type-var]
    if not ordered:
        by_origin = dict(zip(origins, errors, strict=True))
        errors = [by_origin[origin] for origin in bad]
    for error, origin in zip(errors, bad, strict=True):
        notes = " ".join(getattr(error, "__notes__", []))
        assert f"record {origin.record} (at byte offset {origin.offset}) of file {origin.path}" \
            in notes, notes
    _same(outputs, wanted, ordered)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kept, errors = _run(ds_of(True))
    assert not errors
    _same(kept, wanted, ordered)  # nothing else lost, nothing twice
    dropped = [str(w.message) for w in caught if "ignore_errors" in str(w.message)]
    assert len(dropped) == len(bad)
    if not ordered:
        dropped.sort(key=lambda m: bad.index(next(o for o in bad if _named(o, m))))
    for message, origin in zip(dropped, bad, strict=True):
        assert f"record {origin.record} (at byte offset {origin.offset}) of file " \
            f"{origin.path}" in message, message


def _named(origin: Origin, text: str) -> bool:
    return f"record {origin.record} (at byte offset {origin.offset}) of file {origin.path}" in text


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(content=shards(), op_name=st.sampled_from(sorted(PROVENANCE_OPS)),
       parallel=st.sampled_from([None, 1, 3]), native=st.booleans(),
       between=st.sampled_from(
           ["nothing", "pass-through stages", "shuffle", "interleave", "interleave+shuffle",
            "prefetch", "threaded interleave", "threaded interleave, any order",
            "threaded interleave+shuffle+prefetch", "batch, unbatch", "shuffle, batch, unbatch",
            "threaded interleave, any order+batch, prefetch, unbatch"]),
       seed=st.integers(0, 1000))
def test_bad_images_in_shards_name_file_record_and_offset(
    tmp_path_factory: pytest.TempPathFactory, content: list[list[bytes]], op_name: str,
    parallel: int | None, native: bool, between: str, seed: int,
) -> None:
    paths = _write(tmp_path_factory.mktemp("shards"), content)
    op = PROVENANCE_OPS[op_name]
    before = set_native_enabled(native)
    try:
        def ds_of(ignore: bool) -> hr.Dataset:
            if between.startswith("interleave"):  # files read in turn, as in the README
                ds = hr.Dataset.from_tensor_slices(paths).interleave(
                    hr.TFRecordDataset, cycle_length=2, block_length=2)
            elif between.startswith("threaded interleave"):  # slots read ahead on threads
                ds = hr.Dataset.from_tensor_slices(paths).interleave(
                    hr.TFRecordDataset, cycle_length=2, block_length=2, num_parallel_calls=2,
                    deterministic="any order" not in between)
            else:
                ds = hr.TFRecordDataset(paths)
            if between == "pass-through stages":
                ds = ds.filter(lambda r: len(r) > 0).take(10_000)
            elif "shuffle" in between:  # a buffer keeps each record's origin token
                ds = ds.shuffle(5, seed=seed)
            if "batch" in between:  # rows' origins: their batch's rows'
                ds = ds.batch(1 + seed % 4)
            if "prefetch" in between:  # a thread reads ahead of the map
                ds = ds.prefetch(1 + seed % 4)
            if "unbatch" in between:
                ds = ds.unbatch()
            ds = ds.map(op, num_parallel_calls=parallel)
            return ds.ignore_errors(log_warning=True) if ignore else ds

        _check(paths, content, op, ds_of,
               ordered=between in ("nothing", "pass-through stages", "prefetch", "batch, unbatch"))
    finally:
        set_native_enabled(before)


def _where(paths: list[str], content: list[list[bytes]]) -> dict[bytes, Origin]:
    """Each record's origin, by its bytes (the generator's records are distinct)."""
    where = {}
    for path, records in zip(paths, content, strict=True):
        offset = 0
        for number, record in enumerate(records):
            where[record] = Origin(path, number, offset)
            offset += len(record) + _OVERHEAD
    return where


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(content=shards(), op_name=st.sampled_from(sorted(PROVENANCE_OPS)),
       parallel=st.sampled_from([None, 2, "processes"]), mark=st.booleans(),
       before=st.sampled_from(["file", "shuffle", "prefetch", "threaded interleave, any order",
                               "threaded interleave+shuffle"]),
       batch_size=st.integers(1, 5), seed=st.integers(0, 1000))
def test_a_map_over_a_batch_names_the_batchs_records_or_the_failing_rows(
    tmp_path_factory: pytest.TempPathFactory, content: list[list[bytes]], op_name: str,
    parallel: int | str | None, mark: bool, before: str, batch_size: int, seed: int,
) -> None:
    """A function over a whole batch that fails: the origin is the batch's, every row's
    record in row order (consecutive ones read "records a-b of file X"); where the
    function says which row failed (``mark_batch_row``), exactly that row's record."""
    records = [record for shard in content for record in shard]
    assume(len(set(records)) == len(records))
    paths = _write(tmp_path_factory.mktemp("shards"), content)
    where = _where(paths, content)
    op = PROVENANCE_OPS[op_name]
    bad = {record for record in records if _fails(op, record)}
    if before.startswith("threaded interleave"):
        ds = hr.Dataset.from_tensor_slices(paths).interleave(
            hr.TFRecordDataset, cycle_length=2, num_parallel_calls=2,
            deterministic="any order" not in before)
    else:
        ds = hr.TFRecordDataset(paths)
    if "shuffle" in before:
        ds = ds.shuffle(4, seed=seed)
    if before == "prefetch":
        ds = ds.prefetch(2)
    batched = image_fns.BatchedOp(op_name, mark)
    ds = ds.batch(batch_size)
    ds = ds.map(batched) if parallel is None else ds.map(
        batched, num_parallel_calls=2, workers="processes" if parallel == "processes" else "threads")
    outputs, errors = _run(ds, ValueError)
    rows_out = sum(len(output) for output in outputs)
    named: set[bytes] = set()
    for error in errors:
        failed = error.failed_record  # type: ignore[attr-defined]
        assert failed in bad
        origin = element_origin(error)
        notes = " ".join(error.__notes__)
        assert origin is not None, notes
        if mark:
            assert origin == where[failed]
            assert re.search(rf"row \d+ of a batch of \d+, {re.escape(str(origin))}", notes)
        else:
            assert where[failed] in origin.rows and len(origin.rows) == origin.span
            assert str(origin) in notes
            ordered = before in ("file", "prefetch")
            if ordered:  # a slice of the records in file order, named as one range per file
                start = records.index(next(r for r in records if where[r] == origin.rows[0]))
                assert [where[r] for r in records[start:start + origin.span]] == list(origin.rows)
                if len({row.path for row in origin.rows}) == 1:
                    assert f"records {origin.record}-{origin.record + origin.span - 1}" in notes \
                        or origin.span == 1
            assert not named & {r for r in records if where[r] in origin.rows}
            named |= {r for r in records if where[r] in origin.rows}
    if not mark:  # the failed batches' rows and the delivered ones: every record, once
        assert bad <= named
        assert rows_out + len(named) == len(records)
    else:
        assert rows_out + len(errors) * batch_size >= len(records) - len(bad)


def _fails(op: Any, record: bytes) -> bool:
    try:
        op(record)
    except ValueError:
        return True
    return False


def _bad_jpeg_shards(tmp: Path, shards: int, per_shard: int, rng: np.random.Generator) -> tuple[
    list[str], list[list[bytes]]
]:
    """``shards`` shards of small JPEGs, one to three of them corrupt at random places
    (cut inside their headers: any decode of any crop window fails)."""
    content = [[image_fns.jpeg(20, 24, seed=100 * s + i) for i in range(per_shard)]
               for s in range(shards)]
    for _ in range(int(rng.integers(1, 4))):
        shard, record = int(rng.integers(shards)), int(rng.integers(per_shard))
        content[shard][record] = content[shard][record][: int(rng.integers(30, 150))]
    return _write(tmp, content), content


@pytest.mark.parametrize("seed", range(3))
def test_the_readme_image_pipeline_names_the_corrupt_jpegs_record(
    tmp_path: Path, seed: int
) -> None:
    """The README's worked example, exactly its shape: TFRecords of JPEGs -> interleave
    with read-ahead threads -> shuffle -> InceptionCrop in worker processes -> batch ->
    prefetch. A corrupt JPEG's error names its file, record and byte offset, though the
    slots' threads read ahead of the shuffle, the shuffle reorders and a process decodes."""
    rng = np.random.default_rng(seed)
    paths, content = _bad_jpeg_shards(tmp_path, 4, 12, rng)
    _, bad = _expected(paths, content, lambda r: image_fns.INCEPTION(0, r))
    assert bad
    files = hr.Dataset.list_files(str(tmp_path / "*.tfrecord"), shuffle=False)
    pipeline = (
        files.interleave(hr.TFRecordDataset, cycle_length=2, num_parallel_calls=2,
                         deterministic=bool(seed % 2))
        .shuffle(16, seed=seed)
        .enumerate()
        .map(image_fns.INCEPTION, num_parallel_calls=2, workers="processes")
        .ignore_errors(log_warning=True)  # (the training loop goes on past a bad image)
        .batch(8)
        .prefetch(2)
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches, errors = _run(pipeline)
    assert not errors
    assert sum(len(b) for b in batches) == 48 - len(bad)
    dropped = [str(w.message) for w in caught if "ignore_errors" in str(w.message)]
    assert sorted(bad) == sorted(o for o in bad for m in dropped if _named(o, m))
    # and raised, not dropped: element_origin says it, the note too
    unbatched = (
        files.interleave(hr.TFRecordDataset, cycle_length=2, num_parallel_calls=2,
                         deterministic=bool(seed % 2))
        .shuffle(16, seed=seed).enumerate()
        .map(image_fns.INCEPTION, num_parallel_calls=2, workers="processes")
        .prefetch(2)
    )
    outputs, errors = _run(unbatched)
    assert len(outputs) == 48 - len(bad)
    origins = [element_origin(error) for error in errors]
    assert sorted(origins) == sorted(bad)  # type: ignore[type-var]
    for error, origin in zip(errors, origins, strict=True):
        assert origin is not None and _named(origin, " ".join(error.__notes__))


@pytest.mark.parametrize("seed", range(2))
def test_the_readme_pipeline_with_a_columnar_parse_names_each_bad_record(
    tmp_path: Path, seed: int
) -> None:
    """The README's example as written: Examples of JPEGs -> auto_shard -> interleave
    with threads -> shuffle -> batch(16).parse_examples(spec).unbatch() -> enumerate ->
    InceptionCrop in processes -> batch -> prefetch. A corrupt JPEG names its Example's
    record through the batch, the parse and the unbatch; a record that is no Example
    makes the columnar parse fail on its batch, and the error names that record (the
    parser says which row), not only the batch."""
    from headrace.io.example import FixedLenFeature, serialize_example

    rng = np.random.default_rng(seed)
    content = [[serialize_example({"image": image_fns.jpeg(20, 24, seed=100 * s + i),
                                   "label": np.int64(i)}) for i in range(12)]
               for s in range(4)]
    jpeg_at = (int(rng.integers(4)), int(rng.integers(12)))
    content[jpeg_at[0]][jpeg_at[1]] = serialize_example(
        {"image": image_fns.jpeg(20, 24, seed=1)[:100], "label": np.int64(0)})
    while (junk_at := (int(rng.integers(4)), int(rng.integers(12)))) == jpeg_at:
        pass
    content[junk_at[0]][junk_at[1]] = b"\x0a\xff\xff not an Example"
    paths = _write(tmp_path, content)
    where = _where(paths, content)
    features = {"image": FixedLenFeature((), bytes), "label": FixedLenFeature((), np.int64)}
    files = hr.Dataset.list_files(str(tmp_path / "*.tfrecord"), shuffle=False)
    records = files.interleave(hr.TFRecordDataset, cycle_length=2, num_parallel_calls=2)
    pipeline = (
        hr.auto_shard(records, num_shards=1, index=0)
        .shuffle(32, seed=seed)
        .batch(16).parse_examples(features).unbatch()
        .enumerate()
        .map(image_fns.INCEPTION, num_parallel_calls=2, workers="processes")
        .prefetch(2)
    )
    outputs, errors = _run(pipeline, ValueError)
    by_type = {type(error).__name__: error for error in errors}
    assert sorted(by_type) == ["InvalidImageError", "ParseError"], errors
    bad_jpeg, bad_example = by_type["InvalidImageError"], by_type["ParseError"]
    assert element_origin(bad_jpeg) == where[content[jpeg_at[0]][jpeg_at[1]]]
    assert element_origin(bad_example) == where[content[junk_at[0]][junk_at[1]]]
    for error in errors:
        assert _named(element_origin(error), " ".join(error.__notes__))  # type: ignore[arg-type]
    assert re.search(r"raised in parse_examples on element \d+, row \d+ of a batch of 16, ",
                     " ".join(bad_example.__notes__))
    # the batch that failed to parse is lost whole (its other 15 rows too), nothing else
    assert len(outputs) == 48 - 16 - 1 or len(outputs) == 48 - 16  # (the JPEG may share it)


def test_an_autotune_interleave_keeps_origins_across_its_switch_to_threads(
    tmp_path: Path,
) -> None:
    """AUTOTUNE starts sequential and wraps every open slot in a read-ahead when its
    pulls wait (forced here mid-slot): origins before and after the switch are exact."""
    rng = np.random.default_rng(5)
    paths, content = _bad_jpeg_shards(tmp_path, 3, 10, rng)
    content[0][7] = content[0][7][:100]  # after the switch, in a slot opened before it
    content[2][1] = content[2][1][:100]  # before it
    paths = _write(tmp_path, content)
    _, bad = _expected(paths, content, image_fns.op_decode_jpeg)
    for parallel in (None, 2):
        ds = hr.Dataset.from_tensor_slices(paths).interleave(
            hr.TFRecordDataset, cycle_length=3, num_parallel_calls=hr.AUTOTUNE
        ).map(image_fns.op_decode_jpeg, num_parallel_calls=parallel)
        outputs, errors = [], []
        with iter(ds) as iterator:
            (interleave,) = [it for it in iterator._tree.walk() if it.stage == "interleave"]
            for step in range(40):
                if step == 9:
                    assert not interleave.threaded
                    interleave._start_threads()
                try:
                    outputs.append(next(iterator))
                except StopIteration:
                    break
                except hi.InvalidImageError as error:
                    errors.append(error)
        assert interleave.threaded
        assert len(outputs) + len(errors) == 30
        assert sorted(element_origin(e) for e in errors) == sorted(bad)  # type: ignore[type-var]


def test_inception_crop_after_enumerate_names_the_record(tmp_path: Path) -> None:
    good = [image_fns.jpeg(30, 40, seed=i) for i in range(5)]
    bad = good[2][:300]
    records = [good[0], good[1], bad, good[3], good[4]]
    paths = _write(tmp_path, [records[:2], records[2:]])
    for parallel in (None, 2):
        ds = hr.TFRecordDataset(paths).enumerate().map(
            image_fns.INCEPTION, num_parallel_calls=parallel)
        outputs, errors = _run(ds)
        assert len(outputs) == 4
        assert [element_origin(e) for e in errors] == [Origin(paths[1], 0, 0)]
        assert re.search(r"on element 2, record 0 \(at byte offset 0\) of file .*shard-00001",
                         " ".join(errors[0].__notes__))


@pytest.mark.parametrize("workers", ["processes"])
def test_bad_images_through_worker_processes_name_their_record(
    tmp_path: Path, workers: str
) -> None:
    rng = np.random.default_rng(3)
    content: list[list[bytes]] = []
    for shard in range(3):
        records = []
        for i in range(9):
            data = encode(photo(24, 32, 3, 10 * shard + i), "JPEG", quality=85)
            kind = rng.choice(["good"] * 5 + ["truncated", "lying", "bomb"])
            if kind == "truncated":
                data = data[: int(rng.integers(4, len(data) - 3))]
            elif kind == "lying":
                data = _lying(data, 20)
            elif kind == "bomb":
                data = encode(photo(300, 300, 3, i), "PNG")
            records.append(data)
        content.append(records)
    paths = _write(tmp_path, content)
    for op_name, interleaved in (("decode_image", False), ("random_resized_crop", True)):
        op = PROVENANCE_OPS[op_name]

        def ds_of(ignore: bool, op: Any = op, interleaved: bool = interleaved) -> hr.Dataset:
            if interleaved:
                ds = hr.Dataset.from_tensor_slices(paths).interleave(
                    hr.TFRecordDataset, cycle_length=3).shuffle(4, seed=2)
            else:
                ds = hr.TFRecordDataset(paths)
            ds = ds.map(op, num_parallel_calls=2, workers=workers)
            return ds.ignore_errors(log_warning=True) if ignore else ds

        _check(paths, content, op, ds_of, ordered=not interleaved)


def test_shuffled_indexed_shards_name_the_record(tmp_path: Path) -> None:
    """An indexed source shuffles indices: the origin follows the record, not the order."""
    content = [[image_fns.jpeg(20, 20, seed=10 * s + i) for i in range(6)] for s in range(2)]
    content[1][4] = content[1][4][:200]
    content[0][1] = _lying(content[0][1], 30)
    paths = _write(tmp_path, content)
    _, bad = _expected(paths, content, image_fns.op_decode_image)
    assert len(bad) == 2
    for parallel in (None, 2):
        ds = hr.TFRecordDataset(paths, indexed=True).shuffle(12, seed=4).map(
            image_fns.op_decode_image, num_parallel_calls=parallel)
        outputs, errors = _run(ds)
        assert len(outputs) == 10
        assert sorted(element_origin(e) for e in errors) == sorted(bad)  # type: ignore[type-var]


def test_a_shuffle_under_repeat_keeps_origins_in_every_epoch(tmp_path: Path) -> None:
    content = [[image_fns.jpeg(16, 16, seed=i) for i in range(4)]]
    content[0][2] = content[0][2][:150]
    paths = _write(tmp_path, content)
    _, bad = _expected(paths, content, image_fns.op_decode_jpeg)
    for parallel in (None, 2):
        ds = hr.TFRecordDataset(paths).repeat(2).shuffle(3, seed=1).map(
            image_fns.op_decode_jpeg, num_parallel_calls=parallel)
        outputs, errors = _run(ds)
        assert len(outputs) == 6
        assert [element_origin(e) for e in errors] == bad * 2


def test_origins_of_text_lines_and_arrays(tmp_path: Path) -> None:
    path = tmp_path / "lines.txt"
    path.write_bytes(b"1\n2\nx\n4\n")

    def to_int(line: bytes) -> int:
        return int(line)

    outputs, errors = image_fns.drain(hr.TextLineDataset(str(path)).map(to_int), ValueError)
    assert outputs == [1, 2, 4]
    assert [element_origin(e) for e in errors] == [Origin(str(path), 2, 4)]
    ds = hr.Dataset.from_tensor_slices(np.array([b"1", b"y", b"3"], dtype=object)).map(to_int)
    with iter(ds) as iterator:
        next(iterator)
        with pytest.raises(ValueError) as caught:
            next(iterator)
    assert element_origin(caught.value) == Origin(None, 1)
    assert "element 1 of the source" in " ".join(caught.value.__notes__)


def test_a_batched_inception_crop_names_the_row_that_failed(tmp_path: Path) -> None:
    records = [image_fns.jpeg(30, 40, seed=i) for i in range(6)]
    records[4] = records[4][:200]
    paths = _write(tmp_path, [records])
    ds = hr.TFRecordDataset(paths).enumerate().batch(3).map(image_fns.INCEPTION.batch)
    outputs, errors = _run(ds)
    assert [o.shape for o in outputs] == [(3, 16, 16, 3)]
    (error,) = errors
    notes = " ".join(error.__notes__)
    assert "InceptionCrop.batch failed on row 1 of 3, the element of index 4" in notes
    assert "on element 1" in notes  # the batch's index at the map


@pytest.mark.parametrize("parallel", [None, 2])
def test_a_restored_iterator_names_the_same_record(tmp_path: Path, parallel: int | None) -> None:
    """The state carries the record index, so origins after a restore count right."""
    records = [image_fns.jpeg(16, 16, seed=i) for i in range(9)]
    records[6] = records[6][:120]
    paths = _write(tmp_path, [records])
    (bad,) = _expected(paths, [records], image_fns.op_decode_jpeg)[1]
    ds = hr.TFRecordDataset(paths).map(image_fns.op_decode_jpeg, num_parallel_calls=parallel)
    with iter(ds) as iterator:
        for _ in range(4):
            next(iterator)
        state = iterator.get_state()
    restored = iter(ds)
    restored.set_state(state)
    outputs, errors = _run(restored)
    assert len(outputs) == 4
    assert [element_origin(e) for e in errors] == [bad]
    if parallel:  # (its state names the start of a chunk: the file's start, record 0)
        return
    # a state from before states carried the record index
    legacy = json.loads(re.sub(r'"record": \d+', '"record": -1', json.dumps(state)))
    assert legacy != state
    restored = iter(ds)
    restored.set_state(seal(legacy))  # (sealed: the field's meaning is what is tested)
    outputs, errors = _run(restored)
    assert len(outputs) == 4 and len(errors) == 1
    assert element_origin(errors[0]) is None  # unknown, rather than wrong


@pytest.mark.parametrize("native", [True, False])
def test_windowed_decode_errors_name_their_op_on_both_paths(native: bool) -> None:
    """The Pillow path of decode_and_crop_jpeg decoded through decode_jpeg, and its
    errors said "decode_jpeg:"; both paths say what was wrong: bytes, header, reason."""
    lying = _lying(image_fns.jpeg(64, 64, seed=1), 10)
    before = set_native_enabled(native)
    try:
        with pytest.raises(hi.InvalidImageError, match=(
            r"^decode_and_crop_jpeg: invalid or truncated JPEG \(\d+ bytes, header 640x64x3\)"
        )):
            hi.decode_and_crop_jpeg(lying, [600, 0, 20, 20])
        with pytest.raises(hr.InvalidArgumentError, match=r"^decode_and_crop_jpeg: channels"):
            hi.decode_and_crop_jpeg(lying, [0, 0, 2, 2], channels=2)
    finally:
        set_native_enabled(before)


def test_batched_origins_of_arrays_text_lines_and_shuffled_indices(tmp_path: Path) -> None:
    """Each batching route keeps its rows' origins: a slice or a gather of a random-access
    source (its indices), a file source's batch read at once, an assembled batch."""
    def fails_on_six(batch: Any) -> Any:
        rows = np.asarray(batch).tolist()
        if 6 in rows:
            error = ValueError("six")
            error.rows = rows  # type: ignore[attr-defined]
            raise error
        return batch

    values = np.arange(10)
    for ds in (hr.Dataset.from_tensor_slices(values).batch(4),  # a slice per batch
               hr.Dataset.from_tensor_slices(values).shuffle(10, seed=3).batch(4),  # a gather
               hr.Dataset.from_tensor_slices(values).filter(lambda v: v >= 0).batch(4)):
        outputs, errors = image_fns.drain(ds.map(fails_on_six), ValueError)
        (error,) = errors
        origin = element_origin(error)
        assert origin is not None
        failed_batch = error.rows  # type: ignore[attr-defined]
        assert [row.record for row in origin.rows] == failed_batch  # the indices, row order
        assert origin.span == len(failed_batch) and origin.path is None
        if origin.consecutive:
            assert f"elements {failed_batch[0]}-{failed_batch[-1]} of the source" in str(origin)
        else:
            assert str(origin).startswith(f"a batch of {origin.span} records: element ")
    path = tmp_path / "lines.txt"
    path.write_bytes(b"1\n22\nx\n4\n")
    lines = hr.TextLineDataset(str(path))

    def to_int(line: bytes) -> int:
        return int(line)

    _, errors = image_fns.drain(lines.batch(3).map(lambda b: [int(v) for v in b]), ValueError)
    assert element_origin(errors[0]) == Origin.of_rows(
        [Origin(str(path), 0, 0), Origin(str(path), 1, 2), Origin(str(path), 2, 5)])
    assert "records 0-2 (from byte offset 0) of file" in " ".join(errors[0].__notes__)
    outputs, errors = image_fns.drain(lines.batch(3).unbatch().map(to_int), ValueError)
    assert outputs == [1, 22, 4]
    assert element_origin(errors[0]) == Origin(str(path), 2, 5)


def test_mark_batch_row_reads_the_parsers_record_index() -> None:
    from headrace._errors import mark_batch_row

    error = mark_batch_row(ValueError("feature 'x' in record 12 of the batch has 2 values"))
    assert error.headrace_batch_row == 12  # type: ignore[attr-defined]
    assert not hasattr(mark_batch_row(ValueError("no row named")), "headrace_batch_row")
    rows = [Origin("f", 3, 30), Origin("g", 0, 0)]
    noted = hr._errors.note_element_error(mark_batch_row(KeyError("k"), 1), "map(f)", 7,
                                         Origin.of_rows(rows))
    assert element_origin(noted) == rows[1]
    assert noted.__notes__ == ["headrace: raised in map(f) on element 7, row 1 of a batch of 2, "
                               "record 0 (at byte offset 0) of file g"]

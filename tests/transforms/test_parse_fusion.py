"""map(parse one record).batch(n) runs as one columnar parse per batch, with the values
of batch(n).parse_examples(spec), the errors of the per-record map, and exact resume."""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import headrace as hr
from headrace.core.fingerprint import function_name
from headrace.io import example as hx
from headrace.io.tfrecord import write_tfrecord

sys.path.insert(0, str(Path(__file__).parents[1] / "io"))
from io_format_strategies import conforming_example, headrace_spec, specs

FUZZ = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def plain(value: Any) -> Any:
    """Comparable Python values of a batch (ragged and sparse columns as triples)."""
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, tuple):
        return tuple(plain(item) for item in value)
    if isinstance(value, hx.RaggedColumn):
        return ("ragged", value.to_list(), str(value.row_splits.dtype))
    if isinstance(value, hx.SparseColumn):
        return ("sparse", value.indices.tolist(), value.values.tolist(),
                value.dense_shape.tolist())
    return (str(value.dtype), value.shape, value.tolist())


def outcomes(dataset: Any) -> list[Any]:
    """Every batch, or the error (type, message, notes) where one is raised."""
    out: list[Any] = []
    iterator = iter(dataset)
    while True:
        try:
            out.append(plain(next(iterator)))
        except StopIteration:
            return out
        except Exception as error:
            out.append((type(error).__name__, str(error), getattr(error, "__notes__", [])))


class Hidden:
    """The same per-record parse, written so that fusion cannot see it: the reference."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec

    def __call__(self, record: Any) -> Any:
        return getattr(hx, "parse_" + "single_example")(record, self.spec)


@FUZZ
@given(st.data(), st.integers(1, 4), st.booleans(), st.sampled_from(["file", "slices", "parallel"]))
def test_fused_batches_are_parse_examples_and_errors_are_the_maps(
    tmp_path: Path, data: st.DataObject, batch_size: int, drop: bool, source: str
) -> None:
    spec_args = data.draw(specs())
    spec_args = {k: v for k, v in spec_args.items() if v[0] != "sequence"} or {
        "a": ("varlen", "int64_list", (), None)}
    spec = {name: headrace_spec(*args) for name, args in spec_args.items()}
    records = [hx.serialize_example(data.draw(conforming_example(spec_args)))
               for _ in range(data.draw(st.integers(0, 9)))]
    path = tmp_path / f"{data.draw(st.integers(0, 10**9))}.tfrecord"
    write_tfrecord(path, records)

    def base() -> hr.Dataset:
        if source == "file":
            return hr.TFRecordDataset(str(path))
        return hr.Dataset.from_tensor_slices(np.array([*records, b""], dtype=object)[:-1])

    calls = 0

    def parse(record: Any) -> Any:
        nonlocal calls
        calls += 1
        return hx.parse_single_example(record, spec)

    parallel = hr.AUTOTUNE if source == "parallel" else None
    fused = outcomes(base().map(parse, num_parallel_calls=parallel).batch(batch_size, drop))
    # the reference: each batch's records parsed by parse_example, or the first record's
    # error as the per-record map raises it; a short last batch under drop_remainder is
    # dropped once its records were parsed, so its error is raised (tf.data's fused
    # map_and_batch)
    expected: list[Any] = []
    for start in range(0, len(records), batch_size):
        chunk = records[start : start + batch_size]
        for offset, record in enumerate(chunk):
            try:
                hx.parse_single_example(record, spec)
            except hr.ParseError as error:
                index = start + offset
                # where the record came from, as the map unfused says it (TFRecord
                # framing: 16 bytes around each record)
                where = (f", record {index} (at byte offset "
                         f"{sum(len(r) + 16 for r in records[:index])}) of file {path}"
                         if source == "file" else f", element {index} of the source")
                expected.append(("ParseError", str(error), [
                    f"headrace: raised in map({function_name(parse)}) on element "
                    f"{index}{where}"]))
                break
        else:
            if not (drop and len(chunk) < batch_size):
                expected.append(plain(hx.parse_example(chunk, spec)))
    assert fused == expected
    # fused: the function ran once on a stand-in, then only for the refused batches
    refused = sum(1 for item in expected if isinstance(item, tuple) and item[0] == "ParseError")
    assert calls <= 1 + refused * batch_size


def fixed_records(count: int, bad: set[int] = frozenset()) -> list[bytes]:  # type: ignore[assignment]
    return [hx.serialize_example({"x": ("float_list", [] if i in bad else [float(i)]),
                                  "v": ("int64_list", list(range(i % 3)))})
            for i in range(count)]


SPEC = {"x": hx.FixedLenFeature([], np.float32), "v": hx.VarLenFeature(np.int64)}


@pytest.mark.tf
def test_an_error_fails_its_whole_batch_as_tensorflows_fused_map_and_batch(
    tmp_path: Path,
) -> None:
    """tf.data fuses map and batch by default (map_and_batch_fusion): a record that fails
    fails its whole batch, and the next batch starts after it. The error itself is the
    one the per-record map raises (message, note naming the stage and element)."""
    import tensorflow as tf

    path = tmp_path / "bad.tfrecord"
    write_tfrecord(path, fixed_records(10, bad={5}))
    spec = {"x": SPEC["x"]}

    def parse(record: Any) -> Any:
        return hx.parse_single_example(record, spec)

    fused_out = outcomes(hr.TFRecordDataset(str(path)).map(parse).batch(4))
    theirs: list[Any] = []
    iterator = iter(tf.data.TFRecordDataset(str(path)).map(
        lambda r: tf.io.parse_single_example(r, {"x": tf.io.FixedLenFeature([], tf.float32)})
    ).batch(4))
    while True:
        try:
            theirs.append(next(iterator)["x"].numpy().tolist())
        except StopIteration:
            break
        except tf.errors.InvalidArgumentError as error:
            theirs.append(str(error))
    assert [item["x"][2] if isinstance(item, dict) else "error" for item in fused_out] == [
        item if isinstance(item, list) else "error" for item in theirs
    ]
    unfused = Hidden(spec)
    unfused.__qualname__ = parse.__qualname__  # the stage's name in the note
    per_record = outcomes(hr.TFRecordDataset(str(path)).map(unfused).batch(4))
    assert fused_out[1][:2] == per_record[1][:2]
    # both notes name the stage, the element and the record (file, index, byte offset)
    ((fused_note,), (record_note,)) = (fused_out[1][2], per_record[1][2])
    assert fused_note == record_note
    assert fused_note.endswith(f"on element 5, record 5 (at byte offset 220) of file {path}")
    assert fused_out[1][1] == (
        "Key: x.  Number of float values != expected.  Values size: 0 but output shape: []"
    )


def test_fused_is_columnar_and_checkpoints_resume_exactly(tmp_path: Path) -> None:
    path = tmp_path / "data.tfrecord"
    write_tfrecord(path, fixed_records(23))
    calls = []

    def parse(record: Any) -> tuple[Any, Any]:
        calls.append(1)
        features = hx.parse_single_example(record, SPEC)
        return features["x"], features["v"]

    dataset = hr.TFRecordDataset(str(path)).map(parse).batch(5).prefetch(2)
    full = outcomes(dataset)
    assert len(calls) == 1  # traced once, never called per record
    assert full == [plain((batch["x"], batch["v"]))
                    for batch in hr.TFRecordDataset(str(path)).batch(5).parse_examples(SPEC)]
    for taken in range(len(full) + 1):
        iterator = iter(dataset)
        for _ in range(taken):
            next(iterator)
        state = iterator.get_state()
        iterator.close()
        resumed = iter(dataset)
        resumed.set_state(state)
        assert outcomes(resumed) == full[taken:]


def test_partial_and_lambda_and_nested_structures_fuse(tmp_path: Path) -> None:
    path = tmp_path / "data.tfrecord"
    write_tfrecord(path, fixed_records(7))
    reference = list(hr.TFRecordDataset(str(path)).batch(3).parse_examples(SPEC))
    pipelines = {
        "partial": functools.partial(hx.parse_single_example, features=SPEC),
        "lambda": lambda r: {"both": (hx.parse_single_example(r, SPEC)["x"],
                                      [hx.parse_single_example(r, {"v": SPEC["v"]})["v"]])},
    }
    got = {name: outcomes(hr.TFRecordDataset(str(path)).map(fn).batch(3))
           for name, fn in pipelines.items()}
    assert got["partial"] == [plain(batch) for batch in reference]
    assert got["lambda"] == [plain({"both": (b["x"], (b["v"],))}) for b in reference]


def test_a_function_that_does_more_than_parse_runs_per_record(tmp_path: Path) -> None:
    path = tmp_path / "data.tfrecord"
    write_tfrecord(path, fixed_records(6))
    calls = []

    def parse(record: Any) -> Any:
        calls.append(1)
        return hx.parse_single_example(record, {"x": SPEC["x"]})["x"] * 2

    batches = [b.tolist() for b in hr.TFRecordDataset(str(path)).map(parse).batch(4)]
    assert batches == [[0.0, 2.0, 4.0, 6.0], [8.0, 10.0]]
    assert len(calls) == 1 + 6  # the trace, then every record


def test_fixed_len_sequence_is_not_fused(tmp_path: Path) -> None:
    path = tmp_path / "data.tfrecord"
    write_tfrecord(path, fixed_records(4))
    spec = {"v": hx.FixedLenSequenceFeature([], np.int64, allow_missing=True)}
    dataset = hr.TFRecordDataset(str(path)).map(
        lambda r: hx.parse_single_example(r, spec)).batch(4)
    with pytest.raises(hr.ElementSpecError, match="padded_batch"):
        list(dataset)  # rows of different lengths: as in tf.data, batch refuses them

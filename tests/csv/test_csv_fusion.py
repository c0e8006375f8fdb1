"""``map(decode_csv of a line).batch(n)``: one decode per batch, TensorFlow's elements.

The pipelines run under ``headrace.tf_compat`` and under TensorFlow with the same code;
the fused path must give TensorFlow's values, dtypes and structure, decode each batch
in one call, and name the file and record of a bad line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as real_tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import headrace as hr
import headrace._csv.reader as csvfmt
from headrace import tf_compat
from headrace._csv.fusion import FusedDecodeCsv, fused_decode_csv

pytestmark = pytest.mark.tf


def as_numpy(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: as_numpy(item) for key, item in value.items()}
    if isinstance(value, tuple | list):
        return tuple(as_numpy(item) for item in value)
    array = value.numpy() if hasattr(value, "numpy") else np.asarray(value)
    return (np.asarray(array).dtype.name if np.asarray(array).dtype.kind != "O" else "bytes",
            np.asarray(array).tolist())


def elements(dataset: Any) -> list[Any]:
    return [as_numpy(element) for element in dataset]


@pytest.fixture
def decode_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of lines each batched decode (fast path) was given."""
    calls: list[int] = []
    original = csvfmt.decode_lines

    def counted(records: Any, *args: Any) -> Any:
        calls.append(len(records))
        return original(records, *args)

    monkeypatch.setattr("headrace._csv.fusion.decode_lines", counted)
    return calls


def seed_004(tf: Any, path: str, batch_size: int = 32) -> Any:
    dataset = tf.data.TextLineDataset(path)
    dataset = dataset.skip(1)
    dataset = dataset.map(lambda line: tf.io.decode_csv(line, record_defaults=[[0.0]] * 100))
    dataset = dataset.batch(batch_size)
    return dataset.prefetch(buffer_size=tf.data.AUTOTUNE)


def write_floats(path: Path, rows: int, cols: int = 100, seed: int = 4) -> None:
    values = np.random.default_rng(seed).random((rows, cols)).astype(np.float32)
    path.write_text(",".join(f"c{i}" for i in range(cols)) + "\n" + "".join(
        ",".join(repr(float(v)) for v in row) + "\n" for row in values))


def test_seed_004_is_one_decode_per_batch_with_tensorflows_batches(
        tmp_path: Path, decode_calls: list[int]) -> None:
    path = tmp_path / "large_data.csv"
    write_floats(path, 75)
    ours = elements(seed_004(tf_compat, str(path)))
    theirs = elements(seed_004(real_tf, str(path)))
    assert ours == theirs
    assert len(ours) == 3 and len(ours[0]) == 100 and ours[0][0][0] == "float32"
    assert decode_calls == [32, 32, 11]  # one call per batch, not one per line


def test_mixed_types_defaults_select_cols_and_a_dict_arrangement(
        tmp_path: Path, decode_calls: list[int]) -> None:
    path = tmp_path / "mixed.csv"
    path.write_text("id,name,score,count\n" + "".join(
        f"{i},name {i},{'' if i % 7 == 0 else i / 4},{'' if i % 5 == 0 else i * 3}\n"
        for i in range(50)))

    def pipeline(tf: Any) -> Any:
        def to_features(line: Any) -> Any:
            ident, name, score, count = tf.io.decode_csv(
                line, record_defaults=[[0], [""], [-1.5], [7]])
            return {"id": ident, "name": name, "score": score}, count

        return tf.data.TextLineDataset(str(path)).skip(1).map(to_features).batch(16)

    assert elements(pipeline(tf_compat)) == elements(pipeline(real_tf))
    assert decode_calls == [16, 16, 16, 2]  # (mixed types: decode_csv of the batch)

    def selected(tf: Any) -> Any:
        return tf.data.TextLineDataset(str(path)).skip(1).map(
            lambda line: tf.io.decode_csv(line, record_defaults=[[0.0], [0]],
                                          select_cols=[2, 3], na_value="")).batch(20)

    assert elements(selected(tf_compat)) == elements(selected(real_tf))


def test_a_function_that_does_more_than_decode_runs_per_line(tmp_path: Path) -> None:
    path = tmp_path / "more.csv"
    path.write_text("".join(f"{i},{i * 2}\n" for i in range(10)))

    def doubled(line: Any) -> Any:
        first, second = tf_compat.io.decode_csv(line, record_defaults=[[0], [0]])
        return first * 2, second

    assert fused_decode_csv(doubled) is None
    assert fused_decode_csv(lambda line: line) is None  # (no decode_csv: never traced)
    assert isinstance(fused_decode_csv(
        lambda line: hr.decode_csv(line, [[0], [0]])[::-1]), FusedDecodeCsv)
    ours = hr.TextLineDataset(str(path)).map(doubled).batch(4)
    assert [tuple(c.tolist() for c in b) for b in ours] == [
        ([0, 2, 4, 6], [0, 2, 4, 6]), ([8, 10, 12, 14], [8, 10, 12, 14]),
        ([16, 18], [16, 18])]


def test_a_bad_line_names_the_file_and_record_and_tensorflows_message(
        tmp_path: Path, decode_calls: list[int]) -> None:
    path = tmp_path / "bad.csv"
    lines = [f"{i},{i}.5" for i in range(40)]
    lines[37] = "37,x"
    path.write_text("a,b\n" + "\n".join(lines) + "\n")
    ours = tf_compat.data.TextLineDataset(str(path)).skip(1).map(
        lambda line: tf_compat.io.decode_csv(line, record_defaults=[[0], [0.0]])).batch(32)
    iterator = iter(ours)
    assert next(iterator)[0].tolist() == list(range(32))
    with pytest.raises(ValueError, match=r"Field 1 in record 0 is not a valid float: x") as info:
        next(iterator)
    note = " ".join(getattr(info.value, "__notes__", []))
    # element 37 of the map's input; record 38 of the file (counted from 0: line 39)
    offset = path.read_bytes().index(b"37,x")
    assert "on element 37" in note and f"record 38 (at byte offset {offset}) of file {path}" in note
    theirs = real_tf.data.TextLineDataset(str(path)).skip(1).map(
        lambda line: real_tf.io.decode_csv(line, record_defaults=[[0], [0.0]])).batch(32)
    with pytest.raises(real_tf.errors.InvalidArgumentError,
                       match=r"Field 1 in record 0 is not a valid float: x"):
        list(theirs)


def test_ragged_and_empty_lines_are_decode_csvs_errors(tmp_path: Path) -> None:
    for text, message in (("1,2\n3\n", "Expect 2 fields but have 1 in record 0"),
                          ("1,2\n\n3,4\n", "Expect 2 fields but have 0 in record 0"),
                          ('1,2\n"3",4"\n', "Unquoted fields cannot have quotes/CRLFs inside")):
        path = tmp_path / "ragged.csv"
        path.write_text(text)
        ours = hr.TextLineDataset(str(path)).map(
            lambda line: hr.decode_csv(line, [[0], [0]])).batch(8)
        with pytest.raises(ValueError, match=message):
            list(ours)


_FIELD = st.one_of(
    st.integers(-(2**40), 2**40).map(lambda v: str(v).encode()),
    st.floats(allow_nan=False, width=32).map(lambda v: repr(v).encode()),
    st.sampled_from([b"", b" 1", b"2 ", b"1e5", b"-.5", b"inf", b"x", b"1-2", b"0x10", b"NA",
                     b'"3"', b"3000000000"]),
)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    width=st.integers(1, 4),
    data=st.data(),
    kind=st.sampled_from(["int32", "int64", "float32", "float64"]),
    default=st.sampled_from([None, 0, 3]),
    na_value=st.sampled_from(["", "NA"]),
)
def test_the_batched_decode_equals_decode_csv(width: int, data: Any, kind: str,
                                              default: Any, na_value: str) -> None:
    """Whatever the batch, the one-call decode gives decode_csv's arrays or declines."""
    rows = data.draw(st.lists(st.lists(_FIELD, min_size=width, max_size=width), min_size=1,
                              max_size=6))
    if data.draw(st.booleans()):  # a ragged record
        rows[-1] = rows[-1][:-1]
    records = [b",".join(row) for row in rows]
    defaults = [np.dtype(kind) if default is None else [np.dtype(kind).type(default)]
                for _ in range(width)]
    columns = csvfmt.columns_from_defaults(defaults)
    fmt = csvfmt.CsvFormat.make(",", True, na_value)
    fast = csvfmt.decode_lines(records, columns, fmt, [])
    try:
        expected = csvfmt.decode_csv(np.array(records, dtype=object), defaults,
                                     na_value=na_value)
    except ValueError:
        assert fast is None
        return
    if fast is not None:
        assert [c.dtype for c in fast] == [c.dtype for c in expected]
        for got, want in zip(fast, expected, strict=True):
            np.testing.assert_array_equal(got, want)


def test_a_fused_decode_resumes_from_a_checkpoint_exactly(tmp_path: Path) -> None:
    path = tmp_path / "resume.csv"
    write_floats(path, 70, cols=5)
    dataset = hr.TextLineDataset(str(path)).skip(1).map(
        lambda line: hr.decode_csv(line, [[0.0]] * 5)).batch(8)
    everything = [tuple(c.tolist() for c in batch) for batch in dataset]
    assert len(everything) == 9
    for taken in (0, 3, 8):
        iterator = iter(dataset)
        for _ in range(taken):
            next(iterator)
        state = iterator.get_state()
        iterator.close()
        resumed = iter(dataset)
        resumed.set_state(state)
        assert [tuple(c.tolist() for c in batch) for batch in resumed] == everything[taken:]

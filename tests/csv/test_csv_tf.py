"""CSV against TensorFlow itself: decode_csv, CsvDataset and make_csv_dataset.

Records are *generated* (hypothesis): fields drawn from numbers TensorFlow
accepts or refuses (whitespace, signs, hexadecimal, inf/nan spellings,
overflow), quoted strings holding delimiters, quotes and line breaks, stray
quotes, empty fields and ``na_value``; columns of every supported type,
required or with a default; random delimiters, quoting, ``select_cols``,
line endings, headers. The same input goes through TensorFlow and through
headrace (both engines), and the values, dtypes, order and errors must agree:
headrace's message starts with TensorFlow's, then says where.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import headrace as hr
from headrace._csv import CsvError

pytestmark = pytest.mark.tf

SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

NUMBERS = ["0", "1", "-7", "+5", " 2 ", "\t3", "007", "2147483647", "2147483648", "-2147483649",
           "9223372036854775807", "9223372036854775808", "1.5", "-.5", "5.", "1e5", "1E-3",
           "3.4028236e38", "1e400", "1e-400", "inf", "-Infinity", "NaN", "nan(12)", "0x10",
           "0x1p3", "1_0", "1.2.3", "e5", ".", "+-1", "x", " ", "0.1", "16777217", "1.00000006"]
STRINGS = ["a", "b c", "é", '"q,uo""te"', '"multi\nline"', '"cr\r\nlf"', '""', 'bad"quote',
           '"unclosed', '"a"b', "NA"]
KIND_DTYPES = {"int32": tf.int32, "int64": tf.int64, "float32": tf.float32,
               "float64": tf.float64, "string": tf.string}
NP = {"int32": np.int32, "int64": np.int64, "float32": np.float32, "float64": np.float64}


@st.composite
def csv_case(draw: Any, *, stream: bool) -> dict[str, Any]:
    width = draw(st.integers(1, 4))
    kinds = draw(st.lists(st.sampled_from(list(KIND_DTYPES)), min_size=width, max_size=width))
    required = draw(st.lists(st.booleans(), min_size=width, max_size=width))
    delim = draw(st.sampled_from([",", ";", "\t", "|"]))
    quoting = draw(st.booleans())
    na_value = draw(st.sampled_from(["", "NA", "?"]))
    select = None
    file_width = width
    if draw(st.booleans()):
        extra = draw(st.integers(0, 2))
        file_width = width + extra
        select = sorted(draw(st.permutations(range(file_width)))[:width])
    pool = st.one_of(st.sampled_from(NUMBERS), st.sampled_from(STRINGS), st.just(""),
                     st.just(na_value), st.integers(-10**6, 10**6).map(str),
                     st.floats(allow_nan=False, width=32).map(repr))
    rows = draw(st.lists(st.lists(pool, min_size=file_width, max_size=file_width),
                         min_size=0 if stream else 1, max_size=6))
    if rows and draw(st.integers(0, 9)) == 0:  # a ragged row
        rows[draw(st.integers(0, len(rows) - 1))].append("9")
    records = [delim.join(row) for row in rows]
    defaults = []
    for kind, req in zip(kinds, required, strict=True):
        if req:
            defaults.append("required")
        else:
            defaults.append({"string": "dflt", "int32": -1, "int64": -2, "float32": 0.5,
                             "float64": 0.25}[kind])
    return {"kinds": kinds, "defaults": defaults, "delim": delim, "quoting": quoting,
            "na_value": na_value, "select": select, "records": records,
            "line_end": draw(st.sampled_from(["\n", "\r\n", "\r"])),
            "final_newline": draw(st.booleans()), "header": draw(st.booleans())}


def tf_defaults(case: dict[str, Any]) -> list[Any]:
    out = []
    for kind, default in zip(case["kinds"], case["defaults"], strict=True):
        if default == "required":
            out.append(tf.constant([], KIND_DTYPES[kind]))
        else:
            out.append(tf.constant([default], KIND_DTYPES[kind]))
    return out


def hr_defaults(case: dict[str, Any]) -> list[Any]:
    out: list[Any] = []
    for kind, default in zip(case["kinds"], case["defaults"], strict=True):
        dtype = np.dtype(object) if kind == "string" else np.dtype(kind)
        if default == "required":
            out.append(np.array([], dtype=dtype) if kind != "string" else bytes)
        else:
            out.append([NP[kind](default)] if kind != "string" else [default])
    return out


def tf_message(error: Exception) -> str:
    text = str(error)
    if "}} " in text:
        text = text.split("}} ", 1)[1]
    return text.split(" [Op:")[0].strip()


def same_value(a: Any, b: Any) -> bool:
    if isinstance(a, (bytes, np.bytes_)) or isinstance(b, (bytes, np.bytes_)):
        return bytes(a) == bytes(b)
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype != b.dtype:
        return False
    if a.dtype.kind == "f":
        return bool(np.array_equal(a, b, equal_nan=True))
    return bool(np.array_equal(a, b))


# -- decode_csv ----------------------------------------------------------------------------------
def run_tf_decode(case: dict[str, Any]) -> Any:
    try:
        out = tf.io.decode_csv(case["records"], tf_defaults(case), field_delim=case["delim"],
                               use_quote_delim=case["quoting"], na_value=case["na_value"],
                               select_cols=case["select"])
        return [o.numpy() for o in out]
    except tf.errors.InvalidArgumentError as error:
        return ("error", tf_message(error))


def run_hr_decode(case: dict[str, Any]) -> Any:
    try:
        return hr.decode_csv(case["records"], hr_defaults(case), field_delim=case["delim"],
                             use_quote_delim=case["quoting"], na_value=case["na_value"],
                             select_cols=case["select"])
    except CsvError as error:
        return ("error", str(error))


@SETTINGS
@given(csv_case(stream=False))
def test_decode_csv_matches_tensorflow(case: dict[str, Any]) -> None:
    expected = run_tf_decode(case)
    got = run_hr_decode(case)
    if isinstance(expected, tuple):
        assert isinstance(got, tuple), (case, expected, got)
        assert got[1].startswith(expected[1]), (case, expected, got)
        return
    assert not isinstance(got, tuple), (case, expected, got)
    assert len(got) == len(expected)
    for mine, theirs in zip(got, expected, strict=True):
        assert mine.shape == theirs.shape
        for a, b in zip(mine.tolist(), theirs.tolist(), strict=True):
            kind = mine.dtype
            if kind == np.dtype(object):
                assert a == b, (case, a, b)
            else:
                assert same_value(np.array(a, kind), np.array(b, theirs.dtype)), (case, a, b)


def test_decode_csv_messages_are_tensorflows() -> None:
    with pytest.raises(CsvError, match=r"^Expect 3 fields but have 2 in record 0$"):
        hr.decode_csv(["1,2"], [[0], [0], [0]])
    with pytest.raises(CsvError) as caught:
        hr.decode_csv(["1,2", "3,"], [[0], np.array([], np.int32)])
    assert caught.value.message == "Field 1 is required but missing in record 1!"
    assert caught.value.column == 1
    with pytest.raises(CsvError, match=r"^Field 0 in record 0 is not a valid int32: x"):
        hr.decode_csv(["x"], [[0]])
    out = hr.decode_csv(np.array([["1,a"], ["2,b"]], dtype=object), [[0], [""]])
    assert out[0].shape == (2, 1) and out[1][1, 0] == b"b"


# -- CsvDataset ------------------------------------------------------------------------------------
def write_case(case: dict[str, Any], directory: str) -> str:
    end = case["line_end"]
    lines = list(case["records"])
    if case["header"]:
        width = len(case["records"][0].split(case["delim"])) if case["records"] else 1
        lines.insert(0, case["delim"].join(f"c{i}" for i in range(width)))
    text = end.join(lines) + (end if case["final_newline"] and lines else "")
    path = os.path.join(directory, "data.csv")
    with open(path, "wb") as handle:
        handle.write(text.encode())
    return path


class Failed(str):
    """An error in a list of outcomes (its message)."""


def is_error(item: Any) -> bool:
    return isinstance(item, Failed)


def outcomes(iterator: Any, error_type: Any, message: Any, limit: int = 40) -> list[Any]:
    out: list[Any] = []
    for _ in range(limit):
        try:
            element = next(iterator)
        except StopIteration:
            return out
        except error_type as error:
            out.append(Failed(message(error)))
            continue
        out.append(element)
    return out


def flat_batches(items: list[Any]) -> list[Any]:
    """Batches of columns as their records, errors kept in place."""
    flat: list[Any] = []
    for item in items:
        if is_error(item):
            flat.append(item)
        else:
            flat.extend(zip(*item, strict=True))
    return flat


def tf_dataset_outcomes(case: dict[str, Any], path: str, batch: int | None = None) -> Any:
    try:
        ds = tf.data.experimental.CsvDataset(
            path, tf_defaults(case), header=case["header"], field_delim=case["delim"],
            use_quote_delim=case["quoting"], na_value=case["na_value"], select_cols=case["select"])
        if batch is None:
            return outcomes(iter(ds.as_numpy_iterator()), tf.errors.InvalidArgumentError,
                            tf_message)
        return flat_batches(outcomes(iter(ds.batch(batch).as_numpy_iterator()),
                                     tf.errors.InvalidArgumentError, tf_message))
    except tf.errors.InvalidArgumentError as error:  # raised while opening (the header)
        return [Failed(tf_message(error))]


def hr_dataset_outcomes(case: dict[str, Any], path: str, engine: str, batch: int | None) -> Any:
    ds = hr.CsvDataset(path, hr_defaults(case), header=case["header"], field_delim=case["delim"],
                       use_quote_delim=case["quoting"], na_value=case["na_value"],
                       select_cols=case["select"], engine=engine, block_bytes=64)
    if batch is None:
        return outcomes(iter(ds), CsvError, str)
    # (a bad record drops the rows its batch gathered, as in tf.data: compared batched)
    return flat_batches(outcomes(iter(ds.batch(batch)), CsvError, str))


@SETTINGS
@given(csv_case(stream=True), st.sampled_from(["pure", "arrow"]), st.sampled_from([None, 1, 3]))
def test_csv_dataset_matches_tensorflow(case: dict[str, Any], engine: str,
                                        batch: int | None) -> None:
    with tempfile.TemporaryDirectory() as directory:
        path = write_case(case, directory)
        expected = tf_dataset_outcomes(case, path, batch)
        got = hr_dataset_outcomes(case, path, engine, batch)
    assert len(got) == len(expected), (case, expected, got)
    for mine, theirs in zip(got, expected, strict=True):
        if is_error(theirs):
            assert is_error(mine), (case, expected, got)
            assert mine.startswith(theirs), (case, expected, got)
            assert path in mine
            continue
        assert not is_error(mine), (case, expected, got)
        assert len(mine) == len(theirs)
        for a, b in zip(mine, theirs, strict=True):
            assert same_value(a, b), (case, expected, got)


def test_csv_dataset_error_names_file_record_line_and_column(tmp_path: Any) -> None:
    path = tmp_path / "bad.csv"
    path.write_bytes(b"x,y\n1,2\n3,oops\n5,6\n")
    ds = hr.CsvDataset(str(path), [[0], [0]], header=True)
    it = iter(ds)
    assert next(it) == (1, 2)
    with pytest.raises(CsvError) as caught:
        next(it)
    error = caught.value
    assert error.message == "Field 1 in record is not a valid int32: oops"
    assert (error.path, error.record, error.line, error.column, error.offset) == (
        str(path), 1, 3, 1, 8)
    assert next(it) == (5, 6)  # the next record follows, as in tf.data


# -- make_csv_dataset ------------------------------------------------------------------------------
def test_make_csv_dataset_matches_tensorflow(tmp_path: Any) -> None:
    rng = np.random.default_rng(3)
    paths = []
    for f in range(3):
        path = tmp_path / f"part{f}.csv"
        lines = ["id,score,name,label"]
        for i in range(25):
            score = "" if rng.random() < 0.1 else f"{rng.standard_normal():.4f}"
            lines.append(f"{f * 100 + i},{score},n{i},{i % 2}")
        path.write_text("\n".join(lines) + "\n")
        paths.append(str(path))
    pattern = str(tmp_path / "part*.csv")
    kwargs = dict(batch_size=7, label_name="label", shuffle=False, num_epochs=1,
                  select_columns=["id", "score", "label"])
    theirs = list(tf.data.experimental.make_csv_dataset(pattern, **kwargs).as_numpy_iterator())
    mine = list(hr.make_csv_dataset(pattern, **kwargs))
    assert len(mine) == len(theirs)
    for (features, label), (tf_features, tf_label) in zip(mine, theirs, strict=True):
        assert list(features) == list(tf_features)
        for key in features:
            assert features[key].dtype == tf_features[key].dtype
            assert np.array_equal(features[key], tf_features[key])
        assert np.array_equal(label, tf_label) and label.dtype == tf_label.dtype
    # shuffled and repeated: the same rows, every epoch, in headrace's order
    shuffled = hr.make_csv_dataset(pattern, batch_size=5, num_epochs=2, shuffle_seed=1,
                                   label_name="label")
    ids = sorted(int(i) for features, _ in shuffled for i in features["id"])
    assert ids == sorted([f * 100 + i for f in range(3) for i in range(25)] * 2)

"""Bad CSV records and unreadable headers against TensorFlow, under batch and across files.

tf.data's contract, which headrace promises (G3, G5): under ``batch`` a bad record
drops the rows its batch had gathered, its error takes the batch's place, and the next
batch starts right after it, with ``drop_remainder`` or without; a state taken right
after the error resumes with what follows. An empty file or a header that cannot be
read raises once and the next file is read. Files are generated from a seed (row
counts, bad rows at every position of a batch, batch sizes, block sizes), run through
TensorFlow and headrace (both engines), and the batches and errors must agree.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

import headrace as hr
from headrace._csv import CsvError

pytestmark = pytest.mark.tf

ERR = "error"


def drain(iterator: Any, error_type: Any, count: int | None = None) -> list[Any]:
    """The batches (as lists of column lists) and errors (``ERR``) in order: all of
    them, or the first ``count``."""
    out: list[Any] = []
    while count is None or len(out) < count:
        assert len(out) < 200, out[:5]
        try:
            element = next(iterator)
        except StopIteration:
            break
        except error_type:
            out.append(ERR)
            continue
        if isinstance(element, dict):
            element = tuple(element.values())
        out.append([np.asarray(column).tolist() for column in element])
    return out


def bad_file(path: Path, rows: int, bad: set[int]) -> str:
    """``a,b`` with ``rows`` integer records; those in ``bad`` hold a float."""
    path.write_text("a,b\n" + "".join(
        f"{i},{f'{i}.5' if i in bad else i}\n" for i in range(rows)))
    return str(path)


def cases(seed: int, count: int) -> list[tuple[int, set[int], int]]:
    """(rows, bad rows, batch size), drawn so the bad rows fall at every batch position."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        rows = int(rng.integers(1, 40))
        batch = int(rng.integers(1, 8))
        bad = {int(i) for i in rng.choice(rows, size=int(rng.integers(1, min(rows, 4) + 1)),
                                          replace=False)}
        out.append((rows, bad, batch))
    return out


@pytest.mark.parametrize("drop", [False, True])
def test_bad_rows_under_batch_match_tensorflow(tmp_path: Path, drop: bool) -> None:
    for index, (rows, bad, batch) in enumerate(cases(7 + drop, 40)):
        path = bad_file(tmp_path / f"f{index}.csv", rows, bad)
        expected = drain(iter(tf.data.experimental.CsvDataset(
            path, [[0], [0]], header=True).batch(batch, drop_remainder=drop).as_numpy_iterator()),
            tf.errors.InvalidArgumentError)
        for engine in ("arrow", "pure"):
            for block_bytes in (16, 64, 1 << 20):
                got = drain(iter(hr.CsvDataset(path, [[0], [0]], header=True, engine=engine,
                                               block_bytes=block_bytes)
                                 .batch(batch, drop_remainder=drop)), CsvError)
                assert got == expected, (rows, sorted(bad), batch, engine, block_bytes)


def test_make_csv_dataset_bad_rows_match_tensorflow(tmp_path: Path) -> None:
    for index, (rows, bad, batch) in enumerate(cases(11, 25)):
        path = bad_file(tmp_path / f"f{index}.csv", rows, bad)
        kwargs: dict[str, Any] = dict(batch_size=batch, num_epochs=1, shuffle=False,
                                      column_defaults=[0, 0])
        expected = drain(iter(tf.data.experimental.make_csv_dataset(path, **kwargs)
                              .as_numpy_iterator()), tf.errors.InvalidArgumentError)
        got = drain(iter(hr.make_csv_dataset(path, **kwargs)), CsvError)
        assert got == expected, (rows, sorted(bad), batch)


@pytest.mark.parametrize("engine", ["arrow", "pure"])
def test_state_after_a_batch_error_resumes_after_it(tmp_path: Path, engine: str) -> None:
    for index, (rows, bad, batch) in enumerate(cases(13, 12)):
        path = bad_file(tmp_path / f"f{index}.csv", rows, bad)

        def make(path: str = path, batch: int = batch) -> hr.Dataset:
            return hr.CsvDataset(path, [[0], [0]], header=True, engine=engine,
                                 block_bytes=32).batch(batch)

        full = drain(iter(make()), CsvError)
        for cut in (i for i, item in enumerate(full) if item == ERR):
            with iter(make()) as it:
                assert drain(it, CsvError, cut) == full[:cut]
                with pytest.raises(CsvError):
                    next(it)
                state = it.get_state()
            with iter(make()) as it:
                it.set_state(state)
                assert drain(it, CsvError) == full[cut + 1:], (rows, sorted(bad), batch, cut)


HEADERS = [b"", b"\xef\xbb\xbf", b"a,b\n", b'a"b,c\n', b'"a"b,c\n', b'"a"b,bc\n"line\nbreak","a,b"\n',
           b'"unclosed,b\n', b"a,b"]


def header_files(folder: Path, seed: int) -> list[str]:
    """Files with a header drawn from HEADERS (empty, malformed, unclosed, good) and a few
    records, some malformed too."""
    rng = np.random.default_rng(seed)
    paths = []
    for index in range(int(rng.integers(1, 5))):
        head = HEADERS[int(rng.integers(len(HEADERS)))]
        rows = [f"{i},{i * 10}" if rng.random() > 0.2 else f'{i}"x,1'
                for i in range(int(rng.integers(0, 5)))]
        body = "".join(row + "\n" for row in rows).encode()
        path = folder / f"s{seed}_{index}.csv"
        path.write_bytes(head + (b"\n" if head == b"a,b" and body else b"") + body)
        paths.append(str(path))
    return paths


def test_bad_headers_and_empty_files_raise_once_as_tensorflow(tmp_path: Path) -> None:
    defaults = [[""], [""]]
    for seed in range(40):
        paths = header_files(tmp_path, seed)
        tf_ds = tf.data.experimental.CsvDataset(paths, defaults, header=True)
        expected = drain(iter(tf_ds.as_numpy_iterator()), tf.errors.InvalidArgumentError)
        tf_kept = drain(iter(tf_ds.ignore_errors().as_numpy_iterator()),
                        tf.errors.InvalidArgumentError)
        for engine in ("arrow", "pure"):
            ds = hr.CsvDataset(paths, defaults, header=True, engine=engine, block_bytes=16)
            assert drain(iter(ds), CsvError) == expected, (seed, engine)
            assert drain(iter(ds.ignore_errors()), CsvError) == tf_kept, (seed, engine)


@pytest.mark.parametrize("engine", ["arrow", "pure"])
def test_state_after_a_header_error_resumes_after_it(tmp_path: Path, engine: str) -> None:
    for seed in range(15):
        paths = header_files(tmp_path, seed)
        ds = hr.CsvDataset(paths, [[""], [""]], header=True, engine=engine, block_bytes=16)
        full = drain(iter(ds), CsvError)
        for cut in (i for i, item in enumerate(full) if item == ERR):
            with iter(ds) as it:
                assert drain(it, CsvError, cut) == full[:cut]
                with pytest.raises(CsvError):
                    next(it)
                state = it.get_state()
            with iter(ds) as it:
                it.set_state(state)
                assert drain(it, CsvError) == full[cut + 1:], (seed, cut)


def test_ignore_errors_skips_a_bad_row_among_the_inference_rows(tmp_path: Path) -> None:
    # docs/differences.md: tf.data refuses to build; headrace skips the row, as anywhere.
    path = tmp_path / "ragged.csv"
    path.write_text("a,b,c\n1,2.5,x\n3,4.5\n5,6.5,z\n")
    kwargs: dict[str, Any] = dict(batch_size=4, num_epochs=1, shuffle=False)
    with pytest.raises(ValueError, match="Problem inferring types"):
        tf.data.experimental.make_csv_dataset(str(path), ignore_errors=True, **kwargs)
    (batch,) = list(hr.make_csv_dataset(str(path), ignore_errors=True, **kwargs))
    assert batch["a"].tolist() == [1, 5] and batch["b"].dtype == np.float32
    assert batch["c"].tolist() == [b"x", b"z"]
    with pytest.raises(CsvError):  # without ignore_errors, refused at build time as tf.data
        hr.make_csv_dataset(str(path), **kwargs)


def test_a_byte_order_mark_is_skipped_where_tensorflow_keeps_it(tmp_path: Path) -> None:
    # docs/differences.md: the first column is named "a" and its numbers parse.
    path = tmp_path / "bom.csv"
    path.write_bytes(b"\xef\xbb\xbfa,b\n1,x\n2,y\n")
    kwargs: dict[str, Any] = dict(batch_size=2, num_epochs=1, shuffle=False)
    (theirs,) = list(tf.data.experimental.make_csv_dataset(str(path), **kwargs)
                     .as_numpy_iterator())
    assert list(theirs) == ["\ufeffa", "b"]
    (mine,) = list(hr.make_csv_dataset(str(path), **kwargs))
    assert list(mine) == ["a", "b"] and mine["a"].tolist() == [1, 2]
    tf_first = next(iter(tf.data.experimental.CsvDataset(str(path), [[""], [""]])
                         .as_numpy_iterator()))
    assert tf_first == (b"\xef\xbb\xbfa", b"b")
    assert next(iter(hr.CsvDataset(str(path), [[""], [""]]))) == (b"a", b"b")

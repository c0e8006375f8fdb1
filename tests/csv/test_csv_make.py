"""make_csv_dataset on the columnar path: batches cut from parsed blocks, TensorFlow's
values, dtypes, column order and batch edges (across files and epochs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

import headrace as hr
import headrace._csv.source as csvsource

pytestmark = pytest.mark.tf


def write_parts(tmp_path: Path) -> str:
    rng = np.random.default_rng(5)
    for part in range(2):
        lines = ["b_int,a_float,name,label,wide"]
        for i in range(23 + part * 9):
            score = "" if rng.random() < 0.1 else f"{rng.standard_normal():.5f}"
            lines.append(f"{part * 100 + i},{score},n{i},{i % 3},{i * 3_000_000_000}")
        (tmp_path / f"part{part}.csv").write_text("\n".join(lines) + "\n")
    return str(tmp_path / "part*.csv")


@pytest.mark.parametrize("epochs", [1, 2])
def test_unshuffled_batches_are_tensorflows_and_cut_from_blocks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, epochs: int) -> None:
    pattern = write_parts(tmp_path)
    per_record: list[int] = []
    original = csvsource._CsvRecords.pull

    def counted(self: Any) -> Any:
        per_record.append(1)
        return original(self)

    monkeypatch.setattr(csvsource._CsvRecords, "pull", counted)
    kwargs: dict[str, Any] = dict(batch_size=8, label_name="label", shuffle=False,
                                  num_epochs=epochs)
    theirs = list(tf.data.experimental.make_csv_dataset(pattern, **kwargs).as_numpy_iterator())
    dataset = hr.make_csv_dataset(pattern, **kwargs)  # (infers types from 100 records)
    per_record.clear()
    mine = list(dataset)
    assert per_record == []  # batches cut from blocks: no record-by-record read
    assert len(mine) == len(theirs) == -(-55 * epochs // 8)
    for (features, label), (tf_features, tf_label) in zip(mine, theirs, strict=True):
        assert list(features) == list(tf_features) == ["b_int", "a_float", "name", "wide"]
        for key in features:
            assert features[key].dtype == tf_features[key].dtype, key
            assert features[key].tolist() == tf_features[key].tolist(), key
        assert label.dtype == tf_label.dtype and label.tolist() == tf_label.tolist()


def test_shuffled_reads_every_row_once_per_epoch(tmp_path: Path) -> None:
    pattern = write_parts(tmp_path)
    ids = [int(i) for features, _ in hr.make_csv_dataset(
        pattern, batch_size=6, label_name="label", num_epochs=2, shuffle_seed=3)
        for i in features["b_int"]]
    expected = [part * 100 + i for part in range(2) for i in range(23 + part * 9)]
    assert sorted(ids) == sorted(expected * 2) and ids != expected * 2


def test_a_blank_line_of_a_one_column_file_is_its_default_where_tf_refuses(
    tmp_path: Path,
) -> None:
    """docs/differences.md: read as both libraries' CsvDataset read it; tf.data's
    make_csv_dataset refuses to build."""
    path = tmp_path / "blank.csv"
    path.write_text("a\n1\n\n3\n")
    with pytest.raises(ValueError, match="Problem inferring types"):
        tf.data.experimental.make_csv_dataset(str(path), 4, num_epochs=1, shuffle=False)
    (batch,) = list(hr.make_csv_dataset(str(path), 4, num_epochs=1, shuffle=False))
    assert batch["a"].tolist() == [1, 0, 3]
    theirs = tf.data.experimental.CsvDataset(str(path), [[0]], header=True)
    assert [int(row[0]) for row in theirs] == [1, 0, 3]

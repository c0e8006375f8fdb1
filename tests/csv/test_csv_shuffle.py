"""make_csv_dataset's default (shuffled) path shuffles columns: every row once per
epoch, the file order at buffer_size=1, spread positions, same seed same batches,
exact resumes, a buffer shrunk to the budget, TensorFlow's values and dtypes."""

from __future__ import annotations

import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import headrace as hr
import headrace._csv.source as csvsource
from headrace._csv.reader import CsvError
from headrace._csv.shuffle import CsvShuffleNode, _draw_batch
from headrace._errors import HeadraceWarning
from headrace.testing import assert_checkpoint_roundtrip

COLUMNS = "id,x,label"


def write_files(directory: Path, sizes: list[int]) -> tuple[str, list[int]]:
    """Files of ``sizes`` rows; row ids count across files. The pattern and the ids."""
    ids: list[int] = []
    for index, size in enumerate(sizes):
        lines = [COLUMNS]
        for _ in range(size):
            row = len(ids)
            ids.append(row)
            lines.append(f"{row},{row * 0.25},{row % 7}")
        (directory / f"part{index:02d}.csv").write_text("\n".join(lines) + "\n")
    return str(directory / "part*.csv"), ids


def row_ids(dataset: hr.Dataset) -> list[list[int]]:
    return [features["id"].tolist() for features, _ in dataset]


def make(pattern: str, **kwargs: Any) -> hr.Dataset:
    options: dict[str, Any] = dict(label_name="label", column_defaults=[0, 0.0, 0])
    options.update(kwargs)
    return hr.make_csv_dataset(pattern, **options)


def test_the_default_path_is_the_columnar_shuffle(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    pattern, ids = write_files(tmp_path, [40, 25])
    dataset = hr.make_csv_dataset(pattern, batch_size=8, label_name="label", num_epochs=1)
    stages = []
    nodes = [dataset.node]
    while nodes:
        node = nodes.pop()
        stages.append(type(node))
        nodes.extend(node.inputs)
    assert CsvShuffleNode in stages
    per_record: list[int] = []
    original = csvsource._CsvRecords.pull

    def counted(self: Any) -> Any:
        per_record.append(1)
        return original(self)

    monkeypatch.setattr(csvsource._CsvRecords, "pull", counted)
    got = [i for batch in row_ids(dataset) for i in batch]
    assert per_record == []  # no record-by-record read
    assert sorted(got) == ids and got != ids


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(0, 120), min_size=1, max_size=3),
       batch_size=st.integers(1, 40), buffer_size=st.integers(1, 150),
       epochs=st.integers(1, 3), seed=st.integers(0, 2**31))
def test_every_row_once_per_epoch(sizes: list[int], batch_size: int, buffer_size: int,
                                  epochs: int, seed: int) -> None:
    directory = Path(tempfile.mkdtemp())
    try:
        pattern, ids = write_files(directory, sizes)
        batches = row_ids(make(pattern, batch_size=batch_size, num_epochs=epochs,
                               shuffle_buffer_size=buffer_size, shuffle_seed=seed))
    finally:
        shutil.rmtree(directory)
    # batches run across epochs' edges; only the very last one may be short
    assert all(len(batch) == batch_size for batch in batches[:-1])
    flat = [i for batch in batches for i in batch]
    assert len(flat) == len(ids) * epochs
    for epoch in range(epochs):
        assert sorted(flat[epoch * len(ids):(epoch + 1) * len(ids)]) == ids


@settings(max_examples=200, deadline=None)
@given(data=st.data(), slots=st.integers(1, 30), count=st.integers(1, 80))
def test_a_batch_of_draws_is_the_draws_one_at_a_time(data: st.DataObject, slots: int,
                                                    count: int) -> None:
    draws = data.draw(st.lists(st.integers(0, slots - 1), min_size=count, max_size=count))
    buffer = np.arange(slots) * 10
    incoming = 1000 + np.arange(count)
    expected_buffer = buffer.tolist()
    expected = []
    for row, slot in enumerate(draws):  # tf.data: output the slot, refill it
        expected.append(expected_buffer[slot])
        expected_buffer[slot] = int(incoming[row])
    buffers = [buffer.copy(), buffer.astype(np.float32)]
    out = _draw_batch(buffers, [incoming, incoming.astype(np.float32)],
                      np.array(draws, dtype=np.intp))
    assert out[0].tolist() == expected and out[1].tolist() == expected
    assert buffers[0].tolist() == expected_buffer and buffers[1].tolist() == expected_buffer


def test_buffer_size_one_keeps_the_file_order(tmp_path: Path) -> None:
    pattern, ids = write_files(tmp_path, [333])
    batches = row_ids(make(pattern, batch_size=10, num_epochs=2, shuffle_buffer_size=1,
                           shuffle_seed=4))
    assert [i for batch in batches for i in batch] == ids * 2


def test_files_are_shuffled_each_epoch(tmp_path: Path) -> None:
    pattern, _ = write_files(tmp_path, [5] * 8)
    batches = row_ids(make(pattern, batch_size=5, num_epochs=6, shuffle_buffer_size=1,
                           shuffle_seed=2))
    # with a buffer of one row each file comes whole: each epoch is an order of the files
    orders = [tuple(batch[0] // 5 for batch in batches[epoch * 8:(epoch + 1) * 8])
              for epoch in range(6)]
    assert all(sorted(order) == list(range(8)) for order in orders)
    assert len(set(orders)) > 1  # reshuffled each epoch


def test_positions_are_spread_when_the_buffer_holds_everything(tmp_path: Path) -> None:
    rows = 40
    pattern, _ = write_files(tmp_path, [rows])
    positions = []
    orders = set()
    for seed in range(400):
        flat = [i for batch in row_ids(make(pattern, batch_size=16, num_epochs=1,
                                            shuffle_buffer_size=rows, shuffle_seed=seed))
                for i in batch]
        positions.append(flat.index(0))
        orders.add(tuple(flat))
    assert len(orders) == 400  # not a fixed permutation
    counts = np.bincount(positions, minlength=rows)
    # uniform: 10 expected per position; chi-square with 39 degrees of freedom stays
    # below 80 with probability > 0.9999
    chi2 = float(((counts - 10) ** 2 / 10).sum())
    assert chi2 < 80, counts
    assert (counts > 0).sum() >= 30


def test_same_seed_same_batches(tmp_path: Path) -> None:
    pattern, _ = write_files(tmp_path, [150, 70])
    first = list(make(pattern, batch_size=32, num_epochs=3, shuffle_buffer_size=50,
                      shuffle_seed=9))
    again = list(make(pattern, batch_size=32, num_epochs=3, shuffle_buffer_size=50,
                      shuffle_seed=9))
    other = list(make(pattern, batch_size=32, num_epochs=3, shuffle_buffer_size=50,
                      shuffle_seed=10))
    assert len(first) == len(again) == -(-220 * 3 // 32)
    for (features, label), (features2, label2) in zip(first, again, strict=True):
        assert list(features) == list(features2) == ["id", "x"]
        for key in features:
            np.testing.assert_array_equal(features[key], features2[key])
        np.testing.assert_array_equal(label, label2)
    assert [f["id"].tolist() for f, _ in first] != [f["id"].tolist() for f, _ in other]
    # reshuffled each epoch
    flat = [i for f, _ in first for i in f["id"].tolist()]
    assert flat[:220] != flat[220:440]


@pytest.mark.parametrize("epochs", [1, 2])
def test_checkpoints_resume_to_the_same_batches(tmp_path: Path, epochs: int) -> None:
    pattern, _ = write_files(tmp_path, [90, 61])
    assert_checkpoint_roundtrip(make(pattern, batch_size=13, num_epochs=epochs,
                                     shuffle_buffer_size=40, shuffle_seed=5),
                                max_checkpoints=30)


def test_checkpoint_of_a_forever_repeat_and_an_unseeded_shuffle(tmp_path: Path) -> None:
    pattern, _ = write_files(tmp_path, [57])
    forever = make(pattern, batch_size=10, shuffle_buffer_size=20)  # num_epochs=None
    with iter(forever) as iterator:
        for _ in range(8):  # into the second epoch
            next(iterator)
        state = iterator.get_state()
        rest = [next(iterator)[0]["id"].tolist() for _ in range(20)]
    assert all(len(batch) == 10 for batch in rest)  # drop_remainder, as TensorFlow
    with iter(forever) as resumed:
        resumed.set_state(state)
        assert [next(resumed)[0]["id"].tolist() for _ in range(20)] == rest


def test_a_buffer_over_the_budget_shrinks_with_one_warning(tmp_path: Path) -> None:
    rows, columns = 60_000, 30  # 120 B a row: a buffer of every row needs 7 MiB
    path = tmp_path / "wide.csv"
    rest = "," + ",".join("1" for _ in range(columns - 1)) + "\n"
    with path.open("w") as handle:
        handle.write("id," + ",".join(f"c{i}" for i in range(columns - 1)) + "\n")
        handle.writelines(f"{i}{rest}" for i in range(rows))
    dataset = hr.make_csv_dataset(
        str(path), 256, column_defaults=[0] * columns, num_epochs=2,
        shuffle_buffer_size=rows, shuffle_seed=1,
    ).with_options(hr.Options(memory_budget="12MiB"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with iter(dataset) as iterator:
            flat = [i for features in iterator for i in features["id"].tolist()]
            stats = iterator.stats()
    shrunk = [str(w.message) for w in caught if issubclass(w.category, HeadraceWarning)
              and "shuffles within" in str(w.message)]
    assert len(shrunk) == 1, [str(w.message) for w in caught]
    assert "buffer_size=60000" in shrunk[0] and "memory_budget" in shrunk[0]
    assert stats.budget_peak <= stats.budget_total
    (shuffle,) = [stage for stage in stats.stages if stage.name == "shuffle"]
    assert 0 < shuffle.peak <= shuffle.limit
    assert sorted(flat[:rows]) == list(range(rows)) and sorted(flat[rows:]) == list(range(rows))
    # shuffled within the rows that fit: every row leaves within that many draws of
    # entering (row 0 enters first)
    within = int(shrunk[0].split("shuffles within ")[1].split()[0])
    assert 1 <= within < rows
    assert within * 120 <= shuffle.limit
    assert flat.index(0) < rows // 2 and flat[:within] != list(range(within))


@pytest.mark.tf
def test_values_dtypes_and_keys_are_tensorflows(tmp_path: Path) -> None:
    tf = pytest.importorskip("tensorflow")
    rng = np.random.default_rng(3)
    for part in range(2):
        lines = ["id,a_float,small,label,wide"]
        for i in range(60 + part * 17):
            value = "" if rng.random() < 0.1 else f"{rng.standard_normal():.5f}"
            lines.append(f"{part * 1000 + i},{value},{i % 5},{i % 3},{i * 3_000_000_000}")
        (tmp_path / f"p{part}.csv").write_text("\n".join(lines) + "\n")
    pattern = str(tmp_path / "p*.csv")
    kwargs: dict[str, Any] = dict(batch_size=9, label_name="label", num_epochs=1)
    theirs = list(tf.data.experimental.make_csv_dataset(pattern, shuffle=False, **kwargs)
                  .as_numpy_iterator())
    mine = list(hr.make_csv_dataset(pattern, shuffle=True, shuffle_seed=7, **kwargs))

    def rows(batches: list[Any]) -> tuple[list[str], dict[str, Any], list[tuple[Any, ...]]]:
        keys = list(batches[0][0])
        dtypes = {key: batches[0][0][key].dtype for key in keys}
        dtypes["label"] = batches[0][1].dtype
        table = [(*(features[key][i].item() for key in keys), label[i].item())
                 for features, label in batches for i in range(len(label))]
        return keys, dtypes, sorted(table, key=lambda row: row[0])

    my_keys, my_dtypes, my_rows = rows(mine)
    tf_keys, tf_dtypes, tf_rows = rows(theirs)
    assert my_keys == tf_keys == ["id", "a_float", "small", "wide"]
    assert my_dtypes == tf_dtypes
    assert my_rows == tf_rows
    # and shuffled: not the file order
    assert [f["id"].tolist() for f, _ in mine] != [f["id"].tolist() for f, _ in theirs]


def test_bad_rows_are_skipped_with_ignore_errors_and_raised_without(tmp_path: Path) -> None:
    lines = [COLUMNS] + [f"{i},{i * 0.25},{i % 7}" if i % 10 != 3 else f"{i},oops,1"
                         for i in range(100)]
    (tmp_path / "bad.csv").write_text("\n".join(lines) + "\n")
    pattern = str(tmp_path / "bad.csv")
    good = [i for i in range(100) if i % 10 != 3]
    kept = row_ids(make(pattern, batch_size=7, num_epochs=2, shuffle_buffer_size=30,
                        shuffle_seed=1, ignore_errors=True))
    flat = [i for batch in kept for i in batch]
    assert sorted(flat[:90]) == good and sorted(flat[90:]) == good
    with pytest.raises(CsvError, match=r"bad\.csv"):
        row_ids(make(pattern, batch_size=7, num_epochs=1, shuffle_buffer_size=30,
                     shuffle_seed=1))


def test_rows_one_by_one_outside_a_batch(tmp_path: Path) -> None:
    pattern, ids = write_files(tmp_path, [30, 12])
    source = make(pattern, batch_size=4, num_epochs=2, shuffle_buffer_size=9,
                  shuffle_seed=3)
    nodes = [source.node]
    while not isinstance(nodes[-1], CsvShuffleNode):
        nodes.append(nodes[-1].inputs[0])
    rows = [int(row[0]) for row in hr.Dataset(nodes[-1])]
    batched = [i for batch in row_ids(source) for i in batch]
    assert rows == batched and sorted(rows) == sorted(ids * 2)


def test_workers_sharding_one_file_share_its_rows(tmp_path: Path) -> None:
    from headrace._transforms.shard import ShardNode

    pattern, ids = write_files(tmp_path, [101])
    dataset = make(pattern, batch_size=8, num_epochs=2, shuffle_buffer_size=16,
                   shuffle_seed=6)
    nodes = [dataset.node]
    while not isinstance(nodes[-1], CsvShuffleNode):
        nodes.append(nodes[-1].inputs[0])
    node = nodes[-1]
    # one file for two workers: sharding gives each every other record of it
    parts = []
    for index in range(2):
        part = node.with_inputs((ShardNode(node.inputs[0], 2, index),))
        parts.append([int(i) for batch in hr.Dataset(part).batch(8) for i in batch[0]])
    assert sorted(parts[0] + parts[1]) == sorted(ids * 2)
    assert sorted(parts[0]) == sorted(ids[0::2] * 2) and parts[0] != sorted(parts[0])

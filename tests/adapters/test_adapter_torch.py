"""``Dataset.to_torch()``: tensors sharing the batches' memory; DataLoader workers read
disjoint parts that together are the whole dataset."""

from __future__ import annotations

import collections
import random
import warnings
from typing import Any

import numpy as np
import pytest

import headrace as hr

torch = pytest.importorskip("torch")
import shard_cases as sc  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402


def test_batches_share_memory_readonly_ones_without_warning() -> None:
    x = np.arange(60, dtype=np.float32).reshape(20, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "not writable" warning would fail here
        batch = next(iter(hr.Dataset.from_tensor_slices(x).batch(8).to_torch()))
    assert isinstance(batch, torch.Tensor) and batch.shape == (8, 3)
    assert batch.data_ptr() == x.ctypes.data  # a view of the user's array: no copy
    gathered = next(iter(hr.Dataset.from_tensor_slices(x).shuffle(20, seed=0).batch(8).to_torch()))
    assert gathered.dtype == torch.float32 and gathered.shape == (8, 3)
    copied = next(iter(hr.Dataset.from_tensor_slices(x).batch(8).to_torch(copy_readonly=True)))
    assert copied.data_ptr() != x.ctypes.data
    copied += 1  # writing into a copy leaves the source alone
    assert x[0, 0] == 0


def test_nested_elements_and_strings() -> None:
    ds = hr.Dataset.from_tensor_slices(
        {"x": np.ones((4, 2), np.int16), "name": np.array([b"a", b"b", b"c", b"d"], object)}
    ).batch(2)
    batch = next(iter(ds.to_torch()))
    assert batch["x"].dtype == torch.int16 and batch["name"].tolist() == [b"a", b"b"]


def test_length_follows_cardinality() -> None:
    assert len(hr.Dataset.range(10).to_torch()) == 10
    assert len(hr.Dataset.range(10).batch(3).to_torch(worker_sharding="output")) == 4
    for grouped in (hr.Dataset.range(10).batch(3), hr.Dataset.range(9).ragged_batch(3)):
        with pytest.raises(TypeError, match="depends on the number of DataLoader workers"):
            len(grouped.to_torch())  # 9 rows over 2 workers: 2 + 2 batches, not 3
    with pytest.raises(TypeError, match="not known"):
        len(hr.Dataset.range(10).repeat().to_torch())


def test_source_sharding_is_refused_under_a_positional_stage() -> None:
    with pytest.raises(hr.InvalidArgumentError, match="'take' stage counts elements by position"):
        hr.Dataset.range(10).take(5).to_torch(worker_sharding="source")
    with pytest.raises(hr.InvalidArgumentError, match="worker_sharding must be"):
        hr.Dataset.range(10).to_torch(worker_sharding="files")


def _ids(loader: DataLoader) -> list[int]:  # type: ignore[type-arg]
    out: list[int] = []
    for batch in loader:
        ids = batch["id"] if isinstance(batch, dict) else batch
        out.extend(int(v) for v in np.atleast_1d(np.asarray(ids)))
    return out


def _double(e: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"id": e["id"], "x": e["x"] * 2}


def _keep(e: dict[str, np.ndarray]) -> bool:
    return bool(e["id"] % 3 != 1)


#: Workers start from a clean server process: forking a pytest worker that has loaded
#: TensorFlow or JAX (threads) can crash the child. The dataset is pickled, hence no lambdas.
CONTEXT = "forkserver"


def _random_pipeline(rng: random.Random, n: int) -> hr.Dataset:
    data = {"id": np.arange(n), "x": np.arange(n, dtype=np.float32)}
    ds = hr.Dataset.from_tensor_slices(data)
    for _ in range(rng.randint(1, 4)):
        step = rng.choice(["map", "filter", "shuffle", "batch", "prefetch", "take", "skip"])
        batched = isinstance(ds.element_spec["id"].shape, tuple) and ds.element_spec["id"].shape
        if step == "map":
            ds = ds.map(_double)
        elif step == "filter" and not batched:
            ds = ds.filter(_keep)
        elif step == "shuffle":
            ds = ds.shuffle(rng.randint(1, 50), seed=rng.randint(0, 9),
                            reshuffle_each_iteration=False)
        elif step == "batch" and not batched:
            ds = ds.batch(rng.randint(1, 9), drop_remainder=False)
        elif step == "prefetch":
            ds = ds.prefetch(2)
        elif step == "take":
            ds = ds.take(rng.randint(0, n))
        elif step == "skip":
            ds = ds.skip(rng.randint(0, 10))
    return ds.with_options(hr.Options(memory_budget="32MiB"))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("seed", range(6))
def test_workers_read_disjoint_parts_none_missing(seed: int) -> None:
    rng = random.Random(seed)
    ds = _random_pipeline(rng, rng.randint(30, 200))
    expected = _ids(DataLoader(ds.to_torch(), batch_size=None))
    for policy in ("auto", "output"):
        workers = rng.choice([2, 3])
        got = _ids(DataLoader(ds.to_torch(worker_sharding=policy), batch_size=None,
                              num_workers=workers, multiprocessing_context=CONTEXT))
        duplicates = [k for k, c in collections.Counter(got).items() if c > 1]
        assert not duplicates, f"{policy}, {workers} workers: duplicated {duplicates[:5]}"
        assert sorted(got) == sorted(expected), f"{policy}, {workers} workers: missing"
        if policy == "output":  # round-robin over workers gives back the exact stream
            assert got == expected


def test_source_sharding_splits_files_between_workers(tmp_path: object) -> None:
    import os

    from headrace.adapters._sharding import shard_for_worker
    from headrace.io.tfrecord import write_tfrecord

    paths = []
    for shard in range(4):
        path = os.path.join(str(tmp_path), f"part-{shard}.tfrecord")
        write_tfrecord(path, [f"{shard}-{i}".encode() for i in range(5)])
        paths.append(path)
    ds = hr.TFRecordDataset(paths).batch(2)
    parts = [list(shard_for_worker(ds, "source", 2, w)) for w in range(2)]
    read = [[r.decode()[0] for b in part for r in b] for part in parts]
    assert set(read[0]) == {"0", "2"} and set(read[1]) == {"1", "3"}  # each opens its files
    budget = hr.Dataset.range(4).with_options(hr.Options(memory_budget="64MiB"))
    assert shard_for_worker(budget, "source", 4, 0).options.budget_bytes == 16 * 2**20


def test_loader_with_workers_end_to_end() -> None:
    x = np.arange(4000, dtype=np.float32).reshape(1000, 4)
    ds = hr.Dataset.from_tensor_slices({"id": np.arange(1000), "x": x}).shuffle(1000, seed=3)
    loader = DataLoader(ds.batch(50).to_torch(), batch_size=None, num_workers=2,
                        multiprocessing_context=CONTEXT)
    rows = sorted(int(i) for batch in loader for i in batch["id"])
    assert rows == list(range(1000))


def _as_tuples(element: Any) -> Any:
    """A DataLoader element with its lists (torch's collate turns tuples into them) as tuples."""
    if isinstance(element, (list, tuple)):
        return tuple(_as_tuples(part) for part in element)
    return element


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("seed", [1])  # each DataLoader starts processes: few and small
def test_loader_workers_keep_every_pair_and_every_row(tmp_path: Any, seed: int) -> None:
    """A real DataLoader with workers, default worker_sharding: the issue's zip of TFRecord
    files with a label array (filtered, batches dropping their remainder), then a drawn
    pipeline; all workers together give the unsharded rows with every tuple intact."""
    env = sc.make_env(str(tmp_path), seed)
    rng = random.Random(seed)
    records = hr.TFRecordDataset(env.files).map(sc.to_int, output_signature=sc.INT)
    labels = hr.Dataset.from_tensor_slices(np.arange(env.total, dtype=np.int64) * 10)
    issue = hr.Dataset.zip(records, labels).filter(sc.keep).batch(2, drop_remainder=True)
    for case in (sc.Case(issue, True), sc.random_case(rng, env)):
        expected = sc.multiset(sc.rows(case.dataset, case.batched))
        workers = rng.randint(2, 3)
        loader = DataLoader(case.dataset.to_torch(), batch_size=None, num_workers=workers,
                            multiprocessing_context=CONTEXT)
        got = sc.multiset(sc.rows(map(_as_tuples, loader), case.batched))
        assert got == expected, f"{sc.describe(case.dataset.node)}, {workers} workers"


def _epochs(loader: Any, epochs: int) -> list[list[int]]:
    return [[int(row) for row in loader] for _ in range(epochs)]


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("persistent", [False, True])
def test_workers_reshuffle_each_epoch_and_not_in_lockstep(persistent: bool) -> None:
    """A shuffle in DataLoader workers drew the same order every epoch (a forked worker
    starts at iteration 0; a persistent one re-derived its part afresh), and under source
    sharding every worker applied the same permutation to its own rows, so worker 1's
    stream was worker 0's plus one (attacks9). Now epoch e is the pipeline's iteration e
    in every worker (under output sharding: the single-process stream of iteration e),
    the same run after run whatever torch's RNG does (G3)."""
    ds = hr.Dataset.from_tensor_slices(np.arange(64)).shuffle(64, seed=0)

    def run(policy: str, seed: int) -> list[list[int]]:
        torch.manual_seed(seed)  # (another torch seed changes nothing: G3 is headrace's)
        return _epochs(DataLoader(ds.to_torch(worker_sharding=policy), batch_size=None,
                                  num_workers=2, persistent_workers=persistent,
                                  multiprocessing_context=CONTEXT), 2)

    first, second = run("auto", 5)
    assert sorted(first) == sorted(second) == list(range(64))  # each epoch: every row once
    assert first != second
    steps = {b - a for a, b in zip(first[0::2], first[1::2], strict=True)}
    assert len(steps) > 1  # the workers' orders are not one permutation, shifted
    assert run("auto", 6) == [first, second]
    plain = [[int(v) for v in ds] for _ in range(2)]
    assert run("output", 7) == plain
    fixed = hr.Dataset.from_tensor_slices(np.arange(64)).shuffle(
        64, seed=0, reshuffle_each_iteration=False)
    again = _epochs(DataLoader(fixed.to_torch(), batch_size=None, num_workers=2,
                               persistent_workers=persistent, multiprocessing_context=CONTEXT), 2)
    assert again[0] == again[1]


def _every(_: Any) -> bool:
    return True


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_a_zip_split_as_one_stream_draws_alike_in_every_worker() -> None:
    """A zip of unlike branches (a shuffle beside a filter) is split by position: every
    worker runs it whole and keeps its n-th pairs, so all must draw the epoch's shuffle
    alike, or their parts overlap (a per-worker stream lost and doubled pairs, attacks9).
    Each epoch is then the pipeline's iteration of that number, pair for pair."""
    ds = hr.Dataset.zip(hr.Dataset.from_tensor_slices(np.arange(60)).shuffle(60, seed=2),
                        hr.Dataset.range(60).filter(_every))
    loader = DataLoader(ds.to_torch(), batch_size=None, num_workers=2,
                        multiprocessing_context=CONTEXT)
    for epoch in range(2):
        got = collections.Counter((int(a), int(b)) for a, b in loader)
        assert got == collections.Counter((int(a), int(b)) for a, b in ds), epoch


def test_the_epoch_clock_numbers_keys_in_order_and_falls_back_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Workers of one epoch share a key and get one number; a late worker of an earlier
    epoch gets its own back; without a temporary folder to_torch() still works, each
    process numbering keys by itself (an unpickled copy shares the file, not the dict)."""
    import os
    import pickle
    import tempfile

    from headrace.adapters.torch import _EpochClock

    clock = _EpochClock()
    assert [clock.epoch(k) for k in (7, 7, 9, 7, 11, 9)] == [0, 0, 1, 0, 2, 1]
    copy = pickle.loads(pickle.dumps(clock))
    assert copy.epoch(13) == 3 and clock.epoch(13) == 3  # one file: one count
    path = clock.path
    del clock, copy
    assert not os.path.exists(path)  # removed with the object that made it

    def no_folder(*args: Any, **kwargs: Any) -> Any:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tempfile, "mkstemp", no_folder)
    alone = _EpochClock()
    assert [alone.epoch(k) for k in (5, 5, 6)] == [0, 0, 1]
    ds = hr.Dataset.from_tensor_slices(np.arange(6)).shuffle(6, seed=0)
    assert sorted(int(v) for v in ds.to_torch()) == list(range(6))

"""headrace.ray.DataService on a real local 2-node Ray cluster: every element of an epoch
exactly once across consumers (against the unsharded pipeline), also when a worker actor
is killed mid-epoch; static sharding deterministic; a job resumed from consumer states."""

from __future__ import annotations

import pickle
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
from ray.cluster_utils import Cluster

import headrace as hr
from headrace.ray import DataService, ServiceConsumer, from_ray, to_ray

# Ray's workers import this module to run its functions, and they run no conftest: the
# shared modules' folder goes on their path here (ray_cluster, the test functions' helpers)
sys.path.insert(0, str(Path(__file__).parents[1] / "support"))
from ray_cluster import two_node_cluster

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    yield from two_node_cluster()


def _upper(line: Any) -> Any:
    return bytes(line).upper()


def _lines(tmp_path: Path, files: int = 6, rows: int = 40) -> hr.Dataset:
    paths = []
    for i in range(files):
        path = tmp_path / f"part-{i}.txt"
        path.write_text("".join(f"f{i}-{j}\n" for j in range(rows)))
        paths.append(str(path))
    return hr.TextLineDataset(paths).map(_upper)


def _round_robin(consumers: list[ServiceConsumer], on_element: Any = None) -> Counter[Any]:
    """Read all consumers in turn (as trainers stepping together), counting elements."""
    got: Counter[Any] = Counter()
    live = [iter(c) for c in consumers]
    while live:
        for iterator in list(live):
            try:
                element = next(iterator)
            except StopIteration:
                live.remove(iterator)
                continue
            got[bytes(element)] += 1
            if on_element is not None:
                on_element(sum(got.values()))
    return got


def test_killed_worker_mid_epoch_loses_and_duplicates_nothing(cluster: Cluster,
                                                               tmp_path: Path) -> None:
    dataset = _lines(tmp_path)
    oracle = Counter(bytes(e) for e in dataset)
    service = DataService(dataset, num_workers=2, memory_budget="16MiB", chunk_size=2)
    try:
        assert service.num_splits == 6  # one split per file
        # the actors are spread over both nodes
        nodes = {ray.get(w.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id()))
                 for w in service.workers}
        assert len(nodes) == 2

        def kill(delivered: int) -> None:
            if delivered == 50:
                ray.kill(service.workers[0], no_restart=False)

        consumers = [service.consumer(0, 2), service.consumer(1, 2)]
        got = _round_robin(consumers, kill)
        lost, duplicated = oracle - got, {k: n - 1 for k, n in got.items() if n > 1}
        assert (sum(lost.values()), sum(duplicated.values())) == (0, 0)
        assert got == oracle
        stats = service.stats()
        assert stats["failures"][0] >= 1  # the kill really cut a split short
        assert stats["done"][0] == list(range(6))
        # iterated again, the consumers read the next epoch: every element once more
        assert _round_robin(consumers) == oracle
        assert [c.get_state()["epoch"] for c in consumers] == [1, 1]
    finally:
        service.shutdown()


def test_static_sharding_is_deterministic_and_resumes_from_consumer_states(
        cluster: Cluster) -> None:
    dataset = hr.Dataset.from_tensor_slices({"x": np.arange(100)}).map(lambda e: e["x"] * 2)
    oracle = [int(v) for v in dataset]

    def run() -> tuple[list[int], list[int]]:
        service = DataService(dataset, num_workers=2, sharding="static", num_splits=6,
                              memory_budget="16MiB", chunk_size=3)
        try:
            # consumer 1 reads in a Ray task (on any node): consumers travel
            remote = ray.remote(lambda consumer: [int(v) for v in consumer])
            other = remote.options(num_cpus=0).remote(service.consumer(1, 2))
            return [int(v) for v in service.consumer(0, 2)], ray.get(other)
        finally:
            service.shutdown()

    first, second = run()
    # consumer i reads splits i, i + 2, ... (position ranges), in order
    bounds = [100 * i // 6 for i in range(7)]
    assert first == [v for s in (0, 2, 4) for v in oracle[bounds[s]:bounds[s + 1]]]
    assert second == [v for s in (1, 3, 5) for v in oracle[bounds[s]:bounds[s + 1]]]

    # a second run, stopped mid-epoch, gives the same prefixes; the job resumed from its
    # consumers' states gives each consumer exactly the rest, in order
    def start() -> DataService:
        return DataService(dataset, num_workers=2, sharding="static", num_splits=6,
                           memory_budget="16MiB", chunk_size=4)

    service = start()
    try:
        consumers = [service.consumer(i, 2) for i in range(2)]
        iterators = [iter(c) for c in consumers]
        before: list[list[int]] = [[], []]
        for i in range(37):
            before[i % 2].append(int(next(iterators[i % 2])))
        states = [c.state_dict() for c in consumers]
        with pytest.raises(hr.InvalidArgumentError, match="send a consumer to a trainer before"):
            pickle.dumps(consumers[0])
    finally:
        service.shutdown()
    assert before == [first[:19], second[:18]]
    service = start()
    try:
        resumed = [service.consumer(i, 2) for i in range(2)]
        for consumer, state in zip(resumed, states, strict=True):
            consumer.load_state_dict(state)
        after = [[int(v) for v in c] for c in resumed]
        with pytest.raises(hr.CheckpointError, match="before any of them reads"):
            resumed[0].load_state_dict(states[0])  # too late: splits were handed out
    finally:
        service.shutdown()
    assert [before[0] + after[0], before[1] + after[1]] == [first, second]
    # a service cut otherwise (another num_splits, as another num_workers gives by
    # default, or another sharding) refuses the states at once: its splits are other
    # positions, and reading on repeated elements (the outsider's r2: 32 of 96 repeats)
    other = DataService(dataset, num_workers=3, memory_budget="16MiB", chunk_size=4)
    try:
        with pytest.raises(hr.CheckpointError, match="6 splits with sharding='static'"):
            other.consumer(0, 2).load_state_dict(states[0])
    finally:
        other.shutdown()


def test_bad_arguments_are_clear_errors(cluster: Cluster) -> None:
    ranges = hr.Dataset.range(10)
    with pytest.raises(hr.InvalidArgumentError, match="sharding must be 'dynamic' or 'static'"):
        DataService(ranges, sharding="random")
    with pytest.raises(hr.InvalidArgumentError, match="num_workers must be an int >= 1"):
        DataService(ranges, num_workers=0)
    with pytest.raises(hr.InvalidArgumentError, match="a dataset_fn needs num_splits="):
        DataService(lambda i, n: ranges)
    with pytest.raises(hr.InvalidArgumentError, match="has no seed"):
        DataService(ranges.shuffle(10))
    with pytest.raises(hr.InvalidArgumentError, match="length is unknown or infinite"):
        DataService(ranges.repeat())


def test_to_ray_and_from_ray_round_trip_through_ray_data(cluster: Cluster) -> None:
    dataset = hr.Dataset.from_tensor_slices(
        {"x": np.arange(300), "v": np.arange(600.0).reshape(300, 2)})
    # headrace's splits become Ray Data read tasks; Ray's map_batches; back to headrace
    doubled = to_ray(dataset, num_splits=3, block_rows=64).map_batches(
        lambda batch: {"x": batch["x"] * 2, "v": batch["v"]})
    back = from_ray(doubled, batch_size=50)
    rows = sorted((int(e["x"]), e["v"].tolist()) for e in back)
    assert rows == [(2 * i, [2.0 * i, 2.0 * i + 1]) for i in range(300)]
    assert back.element_spec["v"].shape == (2,)


def _part(index: int, num_splits: int) -> hr.Dataset:
    """Split ``index`` of a dataset_fn: rows index*10..index*10+9; split 2's row 25 is bad."""

    def check(v: Any) -> Any:
        if int(v) == 25:
            raise ValueError("bad row 25")
        return v

    return hr.Dataset.range(index * 10, index * 10 + 10).map(check)


def test_dataset_fn_splits_and_a_pipeline_error_reaches_the_consumer(cluster: Cluster) -> None:
    service = DataService(_part, num_workers=1, num_splits=4, sharding="static",
                          memory_budget="16MiB", chunk_size=4)
    try:
        with pytest.raises(ValueError, match="bad row 25"):  # the pipeline's own error
            list(service.consumer(0, 2))  # splits 0 and 2
    finally:
        service.shutdown()
    good = DataService(lambda i, n: hr.Dataset.range(i * 10, i * 10 + 10), num_workers=1,
                       num_splits=3, sharding="static", memory_budget="16MiB")
    try:
        assert [int(v) for v in good.consumer(0, 1)] == list(range(30))
    finally:
        good.shutdown()


def test_a_node_lost_mid_epoch_loses_and_duplicates_nothing(cluster: Cluster,
                                                            tmp_path: Path) -> None:
    """Last in the module: it takes a node out of the cluster."""
    cluster.add_node(num_cpus=1, object_store_memory=80 << 20)
    dataset = _lines(tmp_path)
    oracle = Counter(bytes(e) for e in dataset)
    service = DataService(dataset, num_workers=2, memory_budget="16MiB", chunk_size=2)
    try:
        where = [ray.get(w.__ray_call__.remote(
            lambda _: ray.get_runtime_context().get_node_id())) for w in service.workers]
        head = cluster.head_node.node_id
        victim = next(i for i, node in enumerate(where) if node != head)
        node = next(n for n in cluster.list_all_nodes() if n.node_id == where[victim])

        def remove(delivered: int) -> None:
            if delivered == 30:
                cluster.remove_node(node)

        got = _round_robin([service.consumer(0, 1)], remove)
        assert sum((oracle - got).values()) == 0  # lost
        assert sum(n - 1 for n in got.values() if n > 1) == 0  # duplicated
        assert got == oracle and service.stats()["failures"][victim] >= 1
    finally:
        service.shutdown()


def test_a_pipeline_of_one_file_is_one_split(cluster: Cluster, tmp_path: Path) -> None:
    """Splits are a file pipeline's files, one per file: one file is one split, not a
    refusal that the pipeline 'reads no list of files' (attacks9)."""
    dataset = _lines(tmp_path, files=1, rows=30)
    service = DataService(dataset, num_workers=2, memory_budget="16MiB", chunk_size=4)
    try:
        assert service.num_splits == 1
        got = _round_robin([service.consumer(i, 2) for i in range(2)])
        assert got == Counter(bytes(v) for v in dataset)
    finally:
        service.shutdown()

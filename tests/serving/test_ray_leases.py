"""headrace.ray.DataService when a consumer leaves: one that closes (or is dropped)
mid-epoch gives its splits back, resuming exactly after what it yielded; one whose
process dies, or stops talking, loses them after the lease timeout to the consumers that
stay; one that comes back after that gets a ServiceError, never repeated elements.
Every case is checked against the unsharded pipeline: each element once overall."""

from __future__ import annotations

import gc
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
from ray.cluster_utils import Cluster

import headrace as hr
from headrace.ray import DataService, ServiceConsumer, ServiceError

# Ray's workers import this module to run its functions, and they run no conftest: the
# shared modules' folder goes on their path here (ray_cluster, the test functions' helpers)
sys.path.insert(0, str(Path(__file__).parents[1] / "support"))
from ray_cluster import two_node_cluster

pytestmark = pytest.mark.slow

N, SPLITS, CHUNK = 600, 6, 8


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    yield from two_node_cluster()


def _service(sharding: str = "dynamic", **options: Any) -> DataService:
    dataset = hr.Dataset.from_tensor_slices(np.arange(N, dtype=np.int64))
    return DataService(dataset, num_workers=2, sharding=sharding, num_splits=SPLITS,
                       memory_budget="16MiB", chunk_size=CHUNK, **options)


def _bounds() -> list[int]:
    """Split i of the service is positions bounds[i]:bounds[i + 1] (cut by position)."""
    return [N * i // SPLITS for i in range(SPLITS + 1)]


def _claimed(reading: list[list[Any]]) -> list[int]:
    """The rest of each chunk a consumer had begun yielding (``get_state()["reading"]``):
    counted as delivered to it, so a consumer that dies never makes them reach another."""
    bounds, rest = _bounds(), []
    for split, _, seq, offset in reading:
        if offset:
            start, stop = bounds[split], bounds[split + 1]
            rest.extend(range(start + seq * CHUNK + offset, min(start + (seq + 1) * CHUNK, stop)))
    return rest


def _once(*parts: list[int]) -> tuple[list[int], list[int]]:
    """(lost, duplicated) of everything delivered against the unsharded pipeline."""
    got = Counter(v for part in parts for v in part)
    return (sorted(set(range(N)) - set(got)),
            sorted(v for v, n in got.items() if n > 1))


def _side_by_side(left: Iterator[Any], stays: Iterator[Any], k: int, first: list[int],
                  rest: list[int]) -> None:
    """Two trainers stepping together until the first has ``k`` elements."""
    while len(first) < k:
        first.append(int(next(left)))
        rest.append(int(next(stays)))


def test_a_consumer_that_leaves_gives_its_splits_back(cluster: Cluster) -> None:
    rng = np.random.default_rng(26)
    # dynamic: consumer 0 reads k elements (k drawn: mid-chunk, past whole splits)
    # beside consumer 1, then leaves by close(), its with block or being dropped;
    # consumer 1 reads on and gets everything else exactly once
    for way in ("close", "with", "drop"):
        k = int(rng.integers(1, 260))
        service = _service()
        try:
            leaver, stayer = service.consumer(0, 2), service.consumer(1, 2)
            first: list[int] = []
            rest: list[int] = []
            left, stays = iter(leaver), iter(stayer)
            if way == "with":
                with leaver:
                    _side_by_side(left, stays, k, first, rest)
            else:
                _side_by_side(left, stays, k, first, rest)
            if way == "close":
                leaver.close()
                assert list(left) == []  # its iterator ends: the splits went back
            elif way == "drop":
                del leaver, left
                gc.collect()
            rest.extend(int(v) for v in stays)
            assert _once(first, rest) == ([], []), (way, k)
            assert sorted(service.stats()["done"][0]) == list(range(SPLITS))
        finally:
            service.shutdown()

    # static: a split belongs to its consumer index, so what consumer 0 leaves waits for
    # a replacement consumer 0, which reads on in the same order
    service = _service("static")
    try:
        bounds = _bounds()
        mine = [v for s in (0, 2, 4) for v in range(bounds[s], bounds[s + 1])]
        leaver = service.consumer(0, 2)
        k = int(rng.integers(1, 250))
        left = iter(leaver)
        first = [int(next(left)) for _ in range(k)]
        leaver.close()
        other = [int(v) for v in service.consumer(1, 2)]
        assert first + [int(v) for v in service.consumer(0, 2)] == mine
        assert _once(first, mine[k:], other) == ([], [])
    finally:
        service.shutdown()


def test_a_static_replacement_after_an_epoch_reads_on_in_the_epoch_left(
        cluster: Cluster) -> None:
    """A replacement consumer started at epoch 0 whatever epoch its index was in: when
    its predecessor left in the second epoch, the replacement's first pass read nothing
    (that epoch 0 was done) and the trainer beside it ended short (attacks9)."""
    service = _service("static")
    try:
        bounds = _bounds()
        mine = [v for s in (0, 2, 4) for v in range(bounds[s], bounds[s + 1])]
        theirs = [v for s in (1, 3, 5) for v in range(bounds[s], bounds[s + 1])]
        leaver, stays = service.consumer(0, 2), service.consumer(1, 2)
        assert [int(v) for v in leaver] == mine and [int(v) for v in stays] == theirs
        left = iter(leaver)  # the second epoch
        first = [int(next(left)) for _ in range(37)]
        leaver.close()
        replacement = service.consumer(0, 2)
        assert first + [int(v) for v in replacement] == mine
        assert [int(v) for v in stays] == theirs
        assert [int(v) for v in replacement] == mine  # then the third epoch, whole
    finally:
        service.shutdown()


@ray.remote(num_cpus=0)
class _Trainer:
    """A trainer process reading one consumer."""

    def __init__(self, consumer: ServiceConsumer) -> None:
        self.consumer = consumer
        self.iterator = iter(consumer)

    def pid(self) -> int:
        return os.getpid()

    def read(self, k: int) -> dict[str, Any]:
        """Up to ``k`` elements, where it is, and the ServiceError that stopped it."""
        got: list[int] = []
        try:
            for _ in range(k):
                got.append(int(next(self.iterator)))
        except StopIteration:
            pass
        except ServiceError as error:
            return {"got": got, "error": str(error)}
        return {"got": got, "reading": self.consumer.get_state()["reading"], "error": None}


def test_a_dead_consumer_loses_its_splits_after_the_lease_timeout(cluster: Cluster) -> None:
    rng = np.random.default_rng(2626)
    timeout = 3.0
    for _ in range(2):
        k = int(rng.integers(1, 200))
        service = _service(lease_timeout_s=timeout)
        try:
            trainer = _Trainer.remote(service.consumer(0, 2))
            dead = ray.get(trainer.read.remote(k))  # what its trainer got, reported
            assert len(dead["got"]) == k and dead["error"] is None
            # it trains on them a moment (its last chunk's report, sent without waiting,
            # leaves the process), then dies
            time.sleep(0.2)
            ray.kill(trainer)
            # a holder silent for half the timeout is waited for: start reading then
            time.sleep(timeout / 2 + 0.5)
            rest = [int(v) for v in service.consumer(1, 2)]
            lost, duplicated = _once(dead["got"], rest)
            assert duplicated == []
            # only the rest of the chunk it had begun (delivered to it) reached no one
            assert lost == sorted(_claimed(dead["reading"])), k
            assert len(lost) < CHUNK
            assert service.stats()["reassigned"] >= 1
        finally:
            service.shutdown()


def test_a_consumer_back_after_its_leases_expired_gets_a_service_error(
        cluster: Cluster) -> None:
    timeout = 3.0
    service = _service(lease_timeout_s=timeout)
    try:
        trainer = _Trainer.remote(service.consumer(0, 2))
        pid = ray.get(trainer.pid.remote())
        before = ray.get(trainer.read.remote(37))
        time.sleep(0.2)  # it trains on them a moment (its report leaves), then hangs
        os.kill(pid, signal.SIGSTOP)  # no renewals, no chunks
        try:
            time.sleep(timeout / 2 + 0.5)
            rest = [int(v) for v in service.consumer(1, 2)]
        finally:
            os.kill(pid, signal.SIGCONT)
        back = ray.get(trainer.read.remote(N))
        # it may finish the chunk it had begun (it is its), then is refused
        assert back["error"] is not None and len(back["got"]) < CHUNK
        assert "leases expired" in back["error"] and "re-assigned" in back["error"]
        assert "ServiceConsumer 0" in back["error"]
        assert _once(before["got"], back["got"], rest) == ([], [])
    finally:
        service.shutdown()


def test_lease_timeout_must_be_positive(cluster: Cluster) -> None:
    with pytest.raises(hr.InvalidArgumentError, match="lease_timeout_s must be a number"):
        _service(lease_timeout_s=0)

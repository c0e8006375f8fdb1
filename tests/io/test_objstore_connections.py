"""The connections an object-store reader holds, counted by a proxy between the client
and the server (tests/io/connection_counter.py), against ``max_open_files`` (G2).

moto closes each connection after its answer; the proxy does not (it answers each
request on a connection of its own to moto), so the client sees a server that keeps
connections alive, as S3 does, and its pool could keep them.

What holds exactly, and is asserted: the server never answers more requests at once
than the cap (no request is made outside a slot of the file pool), and no connection
outlives its request (none is kept idle, outside any slot, for a later one), so the
client holds no connection once the reading is done. What does not hold exactly: the
client closes a connection on its own threads a moment after its answer was read, so
the next request's connection can open while the last one is being closed (a few ms
under load); the peak of connections is printed, not asserted.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from connection_counter import ConnectionCounter
from objstore_servers import make_bucket, moto_server, s3_environment

import headrace as hr
from headrace.io import objstore
from headrace.io.filepool import borrowed_slot, get_default_pool, set_max_open_files
from headrace.io.tfrecord import TFRecordWriter

BUCKET = "conns"


@pytest.fixture(scope="module")
def counter() -> Iterator[ConnectionCounter]:
    with moto_server() as endpoint:
        proxy = ConnectionCounter(endpoint)
        try:
            with s3_environment(proxy.endpoint):
                make_bucket(endpoint, BUCKET)
                yield proxy
        finally:
            proxy.close()


@dataclass(frozen=True)
class _Case:
    objects: int
    cap: int
    cycle_length: int | None  # None: a TFRecordDataset over the list (read ahead)
    block_length: int
    num_parallel_calls: int | None
    buffer_size: int | None
    compression: str


def _draw(rng: random.Random) -> _Case:
    # mostly more objects read at once than the cap lets open: the pool suspends
    # and resumes them, and requests wait for slots
    cycle = rng.choice([None, *range(2, 17)])
    parallel = None if cycle is None or rng.random() < 0.2 else rng.randint(cycle // 2 + 1, cycle)
    objects = rng.randint(4, 16)
    return _Case(
        objects=objects,
        cap=rng.randint(1, min(objects, 10 if cycle is None else cycle) - 1),
        cycle_length=cycle,
        block_length=rng.randint(1, 3),
        num_parallel_calls=parallel,
        buffer_size=rng.choice([4096, 65536, 262144, None]),
        compression=rng.choice(["", "", "GZIP"]),
    )


def _shards(tmp: Path, rng: random.Random, case: _Case, tag: str) -> tuple[list[str], list[str]]:
    """Local shards and their copies on the server: (urls, paths)."""
    urls, paths = [], []
    for shard in range(case.objects):
        path = tmp / f"{tag}-{shard}.tfrecord"
        with TFRecordWriter(str(path), case.compression or None) as writer:
            for i in range(rng.randint(0, 120)):
                writer.write(f"{shard}:{i}:".encode() + rng.randbytes(
                    rng.choice((0, 17, 300, 5000, 20000))))
        url = f"s3://{BUCKET}/{tag}/part-{shard:03d}.tfrecord"
        objstore.put_atomic(url, path.read_bytes())
        urls.append(url)
        paths.append(str(path))
    return urls, paths


def _read(names: list[str], case: _Case) -> list[Any]:
    def records(name: Any) -> hr.Dataset:
        return hr.TFRecordDataset(name, case.compression, buffer_size=case.buffer_size)

    if case.cycle_length is None:
        dataset = records(names)
    else:
        dataset = hr.Dataset.from_tensor_slices(names).interleave(
            records, cycle_length=case.cycle_length, block_length=case.block_length,
            num_parallel_calls=case.num_parallel_calls)
    options = hr.Options()
    options.max_open_files = case.cap
    return list(dataset.with_options(options).as_numpy_iterator())


def _closed_within(counter: ConnectionCounter, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while counter.live and time.monotonic() < deadline:
        time.sleep(0.01)
    return counter.live == 0


@pytest.mark.parametrize("seed", range(8))
def test_connections_live_inside_their_slots(
    counter: ConnectionCounter, tmp_path: Path, seed: int
) -> None:
    rng = random.Random(seed)
    case = _draw(rng)
    objstore.reset_stores()
    urls, paths = _shards(tmp_path, rng, case, f"s{seed}")
    objstore.reset_stores()  # (the uploads' client goes, and its connections with it)
    _closed_within(counter, 5)
    counter.reset_peak()
    first = len(counter.connections)
    remote = _read(urls, case)
    assert remote == _read(paths, case), case
    assert counter.peak_requests <= case.cap, (
        f"{case}: the server answered {counter.peak_requests} requests at once, above "
        f"max_open_files={case.cap}: a request was made outside a slot")
    kept = [c.requests for c in counter.connections[first:] if len(c.requests) > 1]
    assert not kept, (
        f"{case}: {len(kept)} connections were kept open for a later request (idle, "
        f"outside any slot), e.g. {kept[:3]}; most open at once: {counter.peak}")
    assert _closed_within(counter, 5), (
        f"{case}: {counter.live} connections still open after the reading ended")
    print(f"{case}: at most {counter.peak} connections open at once, "
          f"{counter.peak_requests} requests answered at once")


def test_client_options_bring_back_idle_connections(
    counter: ConnectionCounter, tmp_path: Path
) -> None:
    """The documented way out, for a process that wants keep-alive more than an exact
    cap: ``configure(client_options={"pool_max_idle_per_host": ...})`` keeps
    connections for later requests again."""
    rng = random.Random(100)
    case = _Case(objects=5, cap=2, cycle_length=None, block_length=1,
                 num_parallel_calls=None, buffer_size=4096, compression="")
    objstore.reset_stores()
    urls, paths = _shards(tmp_path, rng, case, "keep")
    objstore.reset_stores()
    _closed_within(counter, 5)
    objstore.configure(f"s3://{BUCKET}", client_options={"pool_max_idle_per_host": "4"})
    first = len(counter.connections)
    try:
        assert _read(urls, case) == _read(paths, case)
    finally:
        objstore.reset_stores()  # (the client goes, with the connections it kept)
    carried = [len(c.requests) for c in counter.connections[first:]]
    assert max(carried) > 1, f"each connection carried one request: {carried}"


@pytest.mark.parametrize(("cap", "parts"), [(1, 4), (3, 8), (16, 4)])
def test_an_upload_sends_its_parts_within_the_cap(
    counter: ConnectionCounter, cap: int, parts: int
) -> None:
    """Each part of a multipart upload in flight is a request on a connection of its
    own: the upload holds the caller's slot and sends more parts at once only on slots
    the pool has free, so the server never answers more of its requests at once than
    the cap (nor than ``parts_in_flight``); the object is the bytes given."""
    data = random.Random(cap).randbytes(26 * 2**20)  # six parts
    url = f"s3://{BUCKET}/upload/{cap}-{parts}"
    pool = get_default_pool()
    previous = pool.stats().max_open_files
    objstore.reset_stores()
    _closed_within(counter, 5)
    set_max_open_files(cap)
    try:
        counter.reset_peak()
        with borrowed_slot():
            objstore.put_atomic(url, data, parts_in_flight=parts)
        answered = counter.peak_requests
    finally:
        set_max_open_files(previous)
    assert answered <= min(cap, parts), (cap, parts, answered)
    assert objstore.read_whole(objstore.object_info(url)) == data


def test_a_save_to_a_bucket_uploads_within_the_cap(
    counter: ConnectionCounter, tmp_path: Path
) -> None:
    """``save(url)`` writes locally, then uploads each file: every request in the cap."""
    url = f"s3://{BUCKET}/saved/ds"
    blob = random.Random(5).randbytes(12 * 2**20)
    dataset = hr.Dataset.range(4).map(lambda i: {"i": i, "blob": blob})
    pool = get_default_pool()
    previous = pool.stats().max_open_files
    objstore.reset_stores()
    _closed_within(counter, 5)
    set_max_open_files(3)  # (save's least: its shard, the shard's index, its input)
    try:
        counter.reset_peak()
        dataset.save(url)
        answered = counter.peak_requests
    finally:
        set_max_open_files(previous)
    assert answered <= 3, answered
    loaded = [(int(e["i"]), bytes(e["blob"])) for e in hr.Dataset.load(url)]
    assert loaded == [(i, blob) for i in range(4)]

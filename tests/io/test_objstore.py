"""Object storage URLs read and written like paths, against a real S3 server on loopback.

moto's S3 server runs as a subprocess for the module; faults (connection resets in the
middle of an object, 503 SlowDown, slow answers) are injected by a TCP proxy between
the client and moto (tests/support/objstore_servers.py). The oracle everywhere is the same
files read from the local disk: element for element, nothing lost, nothing repeated.
"""

from __future__ import annotations

import collections
import contextlib
import gzip
import json
import os
import random
import re
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from objstore_servers import (
    ACCESS_KEY,
    SECRET_KEY,
    FaultProxy,
    Faults,
    make_bucket,
    moto_server,
    range_http_server,
    s3_environment,
)
from tests.transforms.test_interleave_descriptors import FdPeak

import headrace as hr
from headrace._errors import DataLossError, InvalidArgumentError
from headrace.io import objstore
from headrace.io.filepool import get_default_pool
from headrace.io.tfrecord import TFRecordWriter
from headrace.io.tfrecord_index import StaleIndexError

BUCKET = "data"


@pytest.fixture(scope="module")
def s3() -> Iterator[str]:
    with moto_server() as endpoint, s3_environment(endpoint):
        make_bucket(endpoint, BUCKET)
        yield endpoint


@pytest.fixture(autouse=True)
def fresh_stores() -> Iterator[None]:
    objstore.reset_stores()
    yield
    objstore.reset_stores()


_SIZES = (0, 1, 17, 300, 5000, 20000)


def _records(
    rng: random.Random, count: int, shard: int, sizes: tuple[int, ...] = _SIZES
) -> list[bytes]:
    # sizes from empty to larger than a small read buffer, so records straddle ranges
    return [f"{shard}:{i}:".encode() + rng.randbytes(rng.choice(sizes)) for i in range(count)]


def _write_shards(
    tmp: Path, prefix: str, shards: int, seed: int, compression: str = "",
    *, count: tuple[int, int] = (1, 60), sizes: tuple[int, ...] = _SIZES,
) -> tuple[list[str], list[str]]:
    """Local shards and their copies under ``s3://data/<prefix>/``: (urls, paths)."""
    rng = random.Random(seed)
    urls, paths = [], []
    for shard in range(shards):
        path = tmp / f"{prefix.replace('/', '_')}-{shard}.tfrecord"
        with TFRecordWriter(str(path), compression or None) as writer:
            for record in _records(rng, rng.randrange(*count), shard, sizes):
                writer.write(record)
        url = f"s3://{BUCKET}/{prefix}/part-{shard:03d}.tfrecord"
        objstore.put_atomic(url, path.read_bytes())
        urls.append(url)
        paths.append(str(path))
    return urls, paths


def _read(dataset: hr.Dataset) -> list[Any]:
    return list(dataset.as_numpy_iterator())


@pytest.mark.parametrize("compression", ["", "GZIP"])
@pytest.mark.parametrize("buffer_size", [4096, None])
def test_tfrecord_from_s3_equals_local(
    s3: str, tmp_path: Path, compression: str, buffer_size: int | None
) -> None:
    urls, paths = _write_shards(tmp_path, f"tf-{compression}-{buffer_size}", 3, 1, compression)
    remote = _read(hr.TFRecordDataset(urls, compression, buffer_size))
    local = _read(hr.TFRecordDataset(paths, compression))
    assert remote == local and len(local) > 3


def test_text_csv_and_list_files_from_s3(s3: str, tmp_path: Path) -> None:
    lines = [f"{i},{i * 0.5},name{i}" for i in range(500)]
    for part in range(3):
        body = ("a,b,c\n" + "\n".join(lines[part::3]) + "\n").encode()
        (tmp_path / f"t{part}.csv").write_bytes(body)
        objstore.put_atomic(f"s3://{BUCKET}/csv/t{part}.csv", body)
    objstore.put_atomic(f"s3://{BUCKET}/csv/nested/t9.csv", b"a,b,c\n1,2,3\n")
    objstore.put_atomic(f"s3://{BUCKET}/csv/t0.csv.gz", gzip.compress(b"x\ny\n"))
    urls = hr.Dataset.list_files(f"s3://{BUCKET}/csv/*.csv", shuffle=False)
    assert [u.decode() if isinstance(u, bytes) else u for u in _read(urls)] == [
        f"s3://{BUCKET}/csv/t{part}.csv" for part in range(3)
    ]  # '*' stops at '/': nested/t9.csv is not listed
    names = [f"s3://{BUCKET}/csv/t{part}.csv" for part in range(3)]
    local = [str(tmp_path / f"t{part}.csv") for part in range(3)]
    assert _read(hr.TextLineDataset(names)) == _read(hr.TextLineDataset(local))
    defaults = [0, 0.0, ""]
    assert _read(hr.CsvDataset(names, defaults, header=True)) == _read(
        hr.CsvDataset(local, defaults, header=True))
    remote_batches = _read(hr.make_csv_dataset(
        f"s3://{BUCKET}/csv/t?.csv", 7, num_epochs=1, shuffle=False))
    local_batches = _read(hr.make_csv_dataset(
        str(tmp_path / "t?.csv"), 7, num_epochs=1, shuffle=False))
    assert len(remote_batches) == len(local_batches)
    for got, want in zip(remote_batches, local_batches, strict=True):
        assert got.keys() == want.keys()
        for key in want:
            assert list(got[key]) == list(want[key])
    assert _read(hr.TextLineDataset(f"s3://{BUCKET}/csv/t0.csv.gz", "GZIP")) == [b"x", b"y"]


def test_list_files_pages_and_patterns(s3: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(objstore, "_LIST_PAGE", 3)  # many pages from a few objects
    keys = [f"ls/a/x{i:02d}.rec" for i in range(11)] + ["ls/a/y.rec", "ls/a/sub/x99.rec",
                                                          "ls/ab/x00.rec"]
    for key in keys:
        objstore.put_atomic(f"s3://{BUCKET}/{key}", b"1")
    listed = [meta.url for meta in objstore.list_objects(f"s3://{BUCKET}/ls/")]
    assert listed == sorted(f"s3://{BUCKET}/{key}" for key in keys)
    assert objstore.glob_objects(f"s3://{BUCKET}/ls/a/x*.rec") == [
        f"s3://{BUCKET}/ls/a/x{i:02d}.rec" for i in range(11)]
    assert objstore.glob_objects(f"s3://{BUCKET}/ls/a/x0[2-4].rec") == [
        f"s3://{BUCKET}/ls/a/x0{i}.rec" for i in (2, 3, 4)]
    assert objstore.glob_objects(f"s3://{BUCKET}/ls/*/x00.rec") == [
        f"s3://{BUCKET}/ls/a/x00.rec", f"s3://{BUCKET}/ls/ab/x00.rec"]
    with pytest.raises(InvalidArgumentError, match=r"no object 's3://data/ls/a/none.rec'"):
        hr.Dataset.list_files(f"s3://{BUCKET}/ls/a/none.rec")
    with pytest.raises(InvalidArgumentError, match="no files match"):
        hr.Dataset.list_files(f"s3://{BUCKET}/ls/a/*.nothing")


@pytest.mark.parametrize(("seed", "compression"), [(0, ""), (1, ""), (2, "GZIP")])
def test_faults_lose_and_repeat_nothing(
    s3: str, tmp_path: Path, seed: int, compression: str
) -> None:
    """Resets in the middle of objects and 503s, retried by headrace alone (the client's
    own retries off): the elements are the local ones, none lost, none repeated."""
    urls, paths = _write_shards(tmp_path, f"faults{seed}", 3, 10 + seed, compression)
    faults = Faults(resets=4, reset_after=9000 + 997 * seed, errors_503=3)
    proxy = FaultProxy(s3, faults)
    try:
        objstore.configure(f"s3://{BUCKET}", endpoint=proxy.endpoint,
                           retry_config={"max_retries": 0})
        objstore.configure(retry=objstore.RetryPolicy(attempts=10, initial_backoff=0.01))
        remote = _read(hr.TFRecordDataset(urls, compression, buffer_size=64 * 1024))
    finally:
        proxy.close()
    local = _read(hr.TFRecordDataset(paths, compression))
    counts = collections.Counter(remote)
    lost = sum(1 for record in local if record not in counts)
    duplicated = sum(count - 1 for count in counts.values() if count > 1)
    assert (lost, duplicated) == (0, 0)
    assert remote == local
    assert faults.done_resets == 4 and faults.done_503 == 3  # the faults happened


def test_slow_responses_are_waited_for(s3: str, tmp_path: Path) -> None:
    urls, paths = _write_shards(tmp_path, "slow", 2, 3)
    faults = Faults(delay=0.2)
    proxy = FaultProxy(s3, faults)
    try:
        objstore.configure(f"s3://{BUCKET}", endpoint=proxy.endpoint)
        remote = _read(hr.TFRecordDataset(urls))
    finally:
        proxy.close()
    assert remote == _read(hr.TFRecordDataset(paths)) and faults.requests >= 2


def test_retries_give_up_naming_the_url(s3: str, tmp_path: Path) -> None:
    urls, _ = _write_shards(tmp_path, "giveup", 1, 4)
    faults = Faults(errors_503=1000)
    proxy = FaultProxy(s3, faults)
    try:
        objstore.configure(f"s3://{BUCKET}", endpoint=proxy.endpoint,
                           retry_config={"max_retries": 0})
        objstore.configure(retry=objstore.RetryPolicy(attempts=3, initial_backoff=0.01))
        with pytest.raises(OSError, match="failed 3 times") as caught:
            _read(hr.TFRecordDataset(urls))
    finally:
        proxy.close()
    # the read that gave up tried 3 times (its message says so); a read ahead of the same
    # object started beside it may have met 503s too before the stream closed
    assert caught.value.filename == urls[0] and faults.done_503 >= 3


def test_denied_access_is_named_and_not_retried(s3: str, tmp_path: Path) -> None:
    urls, _ = _write_shards(tmp_path, "denied", 1, 12)
    faults = Faults(errors_403=1)
    proxy = FaultProxy(s3, faults)
    try:
        objstore.configure(f"s3://{BUCKET}", endpoint=proxy.endpoint)
        with pytest.raises(PermissionError, match="access denied") as caught:
            _read(hr.TFRecordDataset(urls))
    finally:
        proxy.close()
    assert caught.value.filename == urls[0] and faults.requests == 1  # not retried
    assert SECRET_KEY not in str(caught.value) and ACCESS_KEY not in str(caught.value)


def test_missing_objects_and_buckets_are_named_without_credentials(s3: str) -> None:
    for url in (f"s3://{BUCKET}/no/such.tfrecord", "s3://no-such-bucket-x/a.tfrecord"):
        with pytest.raises(FileNotFoundError) as caught:
            _read(hr.TFRecordDataset(url))
        assert caught.value.filename == url
        text = "".join(map(str, [caught.value, *getattr(caught.value, "__notes__", [])]))
        assert SECRET_KEY not in text and ACCESS_KEY not in text
    with pytest.raises(InvalidArgumentError, match="names no bucket"):
        _read(hr.TFRecordDataset("s3:///key"))


def test_state_names_urls_only_and_resumes(s3: str, tmp_path: Path) -> None:
    urls, paths = _write_shards(tmp_path, "state", 3, 5)
    local = _read(hr.TFRecordDataset(paths))
    dataset = hr.TFRecordDataset(urls, buffer_size=4096)
    iterator = iter(dataset)
    head = [next(iterator) for _ in range(len(local) // 2)]
    state = iterator.get_state()
    text = json.dumps(state, default=str)
    assert SECRET_KEY not in text and ACCESS_KEY not in text and "127.0.0.1" not in text
    resumed = iter(dataset)
    resumed.set_state(state)
    rest = list(resumed)
    assert [bytes(x) for x in head + rest] == local


def test_object_replaced_while_read_is_data_loss(s3: str, tmp_path: Path) -> None:
    urls, _ = _write_shards(tmp_path, "changed", 1, 6, count=(500, 501), sizes=(1000,))
    iterator = iter(hr.TFRecordDataset(urls, buffer_size=4096))
    next(iterator)
    objstore.put_atomic(urls[0], b"\0" * 100_000)
    with pytest.raises(DataLossError, match="changed while it was read"):
        list(iterator)


@pytest.mark.parametrize("suspended", [False, True], ids=["reading", "suspended"])
def test_object_deleted_while_read_is_data_loss(
    s3: str, tmp_path: Path, suspended: bool
) -> None:
    """Its remaining bytes are lost: a DataLossError naming the URL, as for an object
    that changed (a FileNotFoundError would read as an object never there). Suspended:
    the stream finds it gone when it is resumed under a cap of one open file."""
    urls, _ = _write_shards(tmp_path, "deleted", 2, 8, count=(500, 501), sizes=(1000,))
    options = hr.Options()
    options.max_open_files = 1
    dataset = hr.TFRecordDataset(urls[0], buffer_size=4096)
    if suspended:  # two objects read in turn: each open suspends the other
        dataset = hr.Dataset.from_tensor_slices(urls).interleave(
            lambda name: hr.TFRecordDataset(name, buffer_size=4096), cycle_length=2)
    iterator = iter(dataset.with_options(options))
    head = [next(iterator) for _ in range(4)]
    objstore.delete_object(urls[0])
    with pytest.raises(DataLossError, match=re.escape(urls[0]) + ".*deleted while it was read"):
        list(iterator)
    assert len(head) == 4


def test_open_objects_count_against_the_file_cap(s3: str, tmp_path: Path) -> None:
    """An interleave over 8 objects, 6 at once, under max_open_files=2: the pool never
    holds more than 2 objects open, the rest are suspended at their offsets and
    resumed with range reads; the elements are tf.data's interleave order."""
    urls, paths = _write_shards(tmp_path, "cap", 8, 7, count=(150, 200), sizes=(100, 1000))
    options = hr.Options()
    options.max_open_files = 2

    def over(names: list[str]) -> list[Any]:
        dataset = hr.Dataset.from_tensor_slices(names).interleave(
            lambda name: hr.TFRecordDataset(name, buffer_size=4096), cycle_length=6,
            block_length=1)
        return _read(dataset.with_options(options))

    pool = get_default_pool()
    before = pool.stats()
    with FdPeak() as fds:  # sockets are descriptors: connections count here
        remote = over(urls)
    after = pool.stats()
    assert remote == over(paths)
    assert after.suspensions - before.suspensions > 0
    assert after.resumptions - before.resumptions > 0
    assert fds.growth <= 2, f"{fds.growth} descriptors/connections opened under a cap of 2"


def test_http_range_reads_equal_local(tmp_path: Path) -> None:
    urls, paths = [], []
    rng = random.Random(8)
    for compression in ("", "GZIP"):
        path = tmp_path / f"h{compression}.tfrecord"
        with TFRecordWriter(str(path), compression or None) as writer:
            for record in _records(rng, 40, 0):
                writer.write(record)
        paths.append((str(path), compression))
    with range_http_server(str(tmp_path)) as base:
        for path, compression in paths:
            url = f"{base}/{Path(path).name}"
            urls.append(url)
            remote = _read(hr.TFRecordDataset(url, compression, buffer_size=4096))
            assert remote == _read(hr.TFRecordDataset(path, compression))
        with pytest.raises(FileNotFoundError) as caught:
            _read(hr.TFRecordDataset(f"{base}/missing.tfrecord"))
        assert caught.value.filename == f"{base}/missing.tfrecord"
        with pytest.raises(InvalidArgumentError, match="read-only"):
            objstore.put_atomic(f"{base}/new.bin", b"x")
        assert _read(hr.Dataset.list_files(urls[0])) == [urls[0]]
        with pytest.raises(InvalidArgumentError, match="a web server has no listing"):
            hr.Dataset.list_files(f"{base}/*.tfrecord")
    # a server that ignores Range would hand out the wrong bytes: refused, named
    import functools
    import http.server
    import threading

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    plain = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=plain.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{plain.server_address[1]}/h.tfrecord"
        with pytest.raises(OSError, match="Range request not supported") as caught:
            _read(hr.TFRecordDataset(url, buffer_size=4096))
        assert caught.value.filename == url
    finally:
        plain.shutdown()
        plain.server_close()


def test_file_urls_are_local_paths(tmp_path: Path) -> None:
    path = tmp_path / "f.tfrecord"
    with TFRecordWriter(str(path)) as writer:
        writer.write(b"one")
        writer.write(b"two")
    assert _read(hr.TFRecordDataset(f"file://{path}")) == [b"one", b"two"]
    listed = _read(hr.Dataset.list_files(f"file://{tmp_path}/*.tfrecord", shuffle=False))
    assert [bytes(x) if not isinstance(x, str) else x.encode() for x in listed] == [
        str(path).encode()]


def _examples(count: int) -> hr.Dataset:
    return hr.Dataset.range(count).map(lambda i: {"id": i, "text": b"row-%d" % i})


@pytest.mark.parametrize(("num_shards", "compression"), [(1, None), (3, None), (2, "GZIP")])
def test_save_tfrecords_to_s3_reads_back_as_locally(
    s3: str, tmp_path: Path, num_shards: int, compression: str | None
) -> None:
    prefix = f"s3://{BUCKET}/saved-{num_shards}-{compression}"
    urls = _examples(50).save_tfrecords(prefix, num_shards=num_shards,
                                        compression_type=compression, progress=False)
    local = _examples(50).save_tfrecords(str(tmp_path / "local"), num_shards=num_shards,
                                         compression_type=compression, progress=False)
    assert [u.rsplit("/", 1)[1] for u in urls] == [Path(p).name for p in local]
    for url, path in zip(urls, local, strict=True):
        assert _read(hr.TFRecordDataset(url, compression)) == _read(
            hr.TFRecordDataset(path, compression))
    listed = sorted(info.url for info in objstore.list_objects(prefix + "/"))
    index = [] if compression else [u + ".hrx" for u in urls]
    assert listed == sorted(urls + index)  # no staging key left behind


def test_save_tfrecords_to_s3_is_all_or_nothing(s3: str) -> None:
    def failing(i: Any) -> Any:
        if int(i) == 40:
            raise ValueError("element 40 is bad")
        return {"id": i}

    prefix = f"s3://{BUCKET}/failed-save"
    with pytest.raises(ValueError, match="element 40"):
        hr.Dataset.range(50).map(failing).save_tfrecords(prefix, num_shards=2, progress=False)
    assert list(objstore.list_objects(prefix + "/")) == []
    # an upload that fails (the bucket is missing) leaves nothing either, and names the URL
    with pytest.raises(FileNotFoundError) as caught:
        _examples(5).save_tfrecords("s3://no-such-bucket-y/out", progress=False)
    assert "no-such-bucket-y" in str(caught.value.filename)


@pytest.mark.parametrize(("compression", "num_shards"), [(None, 3), ("GZIP", 2)])
def test_save_and_load_through_s3_equal_local(
    s3: str, tmp_path: Path, compression: str | None, num_shards: int
) -> None:
    dataset = hr.Dataset.range(60).map(lambda i: {"i": i, "twice": [i, 2 * i]})
    url = f"s3://{BUCKET}/saved-ds-{compression}"
    dataset.save(url, compression=compression, num_shards=num_shards)
    dataset.save(str(tmp_path / "here"), compression=compression, num_shards=num_shards)
    remote = hr.Dataset.load(url)
    here = hr.Dataset.load(str(tmp_path / "here"))
    assert _read(remote) == _read(here)
    if compression is None:  # random access through the uploaded indexes
        assert _read(remote.global_shuffle(seed=2)) == _read(here.global_shuffle(seed=2))
    # a save that stops before its manifest is uploaded is not a saved dataset
    objstore.delete_object(f"{url}/headrace-dataset.json")
    with pytest.raises(FileNotFoundError, match=r"is not a complete saved dataset: it has no"):
        hr.Dataset.load(url)
    with pytest.raises(InvalidArgumentError, match="checkpoint_args needs a local directory"):
        dataset.save(url, checkpoint_args={"checkpoint_interval": 10})


def test_read_buffers_are_booked_on_the_budget(s3: str, tmp_path: Path) -> None:
    """An object's reader buffer, the stream's block and the block read ahead are the
    stage's bytes. By default they shrink to fit half the stage's share (8 MiB reads
    made 24 MiB per open object: an interleave of four objects under 64 MiB was
    refused); a ``buffer_size`` the user gives is kept, and refused naming the object
    where it cannot fit."""
    urls, paths = _write_shards(tmp_path, "booked", 2, 9)
    options = hr.Options()
    options.memory_budget = "6MiB"
    with pytest.raises(hr._errors.MemoryBudgetError, match=r"read-ahead of s3://data/booked"):
        _read(hr.TFRecordDataset(urls, buffer_size=8 << 20).with_options(options))
    fitted = hr.TFRecordDataset(urls).with_options(options)
    assert _read(fitted) == _read(hr.TFRecordDataset(paths))
    with iter(fitted) as iterator:
        next(iterator)
        stage = iterator.stats().stages[-1]
        assert 0 < stage.held <= stage.limit, stage
    # three buffers in half the share, at most 8 MiB each and at least 256 KiB
    assert [objstore.fitting_buffer(mib << 20) >> 10 for mib in (1, 6, 48, 64, 512)] == [
        256, 1024, 8192, 8192, 8192]
    body = b"".join(b"%d,%d\n" % (i, i * i) for i in range(2000))
    objstore.put_atomic(f"s3://{BUCKET}/booked/t.csv", body)
    (tmp_path / "t.csv").write_bytes(body)
    csv_url = f"s3://{BUCKET}/booked/t.csv"
    with pytest.raises(hr._errors.MemoryBudgetError, match=r"read-ahead of s3://data/booked/t"):
        _read(hr.CsvDataset(csv_url, [0, 0], buffer_size=8 << 20).with_options(options))
    fitted_csv = hr.CsvDataset(csv_url, [0, 0]).with_options(options)
    assert _read(fitted_csv) == _read(hr.CsvDataset(str(tmp_path / "t.csv"), [0, 0]))
    # four objects at once under 64 MiB: each reads with what its slot's share allows
    options.memory_budget = "64MiB"
    urls, paths = _write_shards(tmp_path, "four", 8, 10)

    def interleaved(names: list[str]) -> hr.Dataset:
        return hr.Dataset.from_tensor_slices(names).interleave(
            hr.TFRecordDataset, cycle_length=4, num_parallel_calls=4).with_options(options)
    assert _read(interleaved(urls)) == _read(interleaved(paths))


def test_gcs_and_azure_urls_make_their_stores(monkeypatch: pytest.MonkeyPatch) -> None:
    """Structural only (no GCS or Azure emulator is installed here): the URL picks the
    store of its cloud, and a store that cannot be set up is refused naming it."""
    from obstore.store import AzureStore, GCSStore

    assert isinstance(objstore._store("gs://bucket"), GCSStore)
    assert objstore.split_url("gs://bucket/a/b.tfrecord") == ("gs://bucket", "a/b.tfrecord")
    monkeypatch.delenv("AZURE_STORAGE_ACCOUNT_NAME", raising=False)
    with pytest.raises(InvalidArgumentError, match=r"az://container: the object store cannot"):
        _read(hr.TFRecordDataset("az://container/a.tfrecord"))
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", "account")
    objstore.reset_stores()
    assert isinstance(objstore._store("az://container"), AzureStore)


def test_an_option_the_store_does_not_take_is_refused_where_it_is_given() -> None:
    """obstore panics on a configuration key it does not know (a BaseException that
    passes ``except Exception``), at the first read: headrace refuses it in configure,
    as an ordinary error naming the store and the options."""
    with pytest.raises(InvalidArgumentError, match=(
            r"s3://other: the object store cannot be set up .*'allow_http'.*configure")):
        objstore.configure("s3://other", endpoint="http://127.0.0.1:9", allow_http=True)
    objstore.configure("s3://other", endpoint="http://127.0.0.1:9", region="eu-west-1")
    objstore.reset_stores()


def test_a_child_forked_after_use_refuses_instead_of_hanging(s3: str, tmp_path: Path) -> None:
    """The client's runtime does not survive os.fork once it ran: a request from the
    child would wait forever. The child gets an error saying so, naming the store."""
    urls, _ = _write_shards(tmp_path, "fork", 1, 11)
    _read(hr.TFRecordDataset(urls))  # the runtime runs in this process now
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        try:  # (the client alone: a pipeline's locks may have been held at the fork)
            objstore.object_info(urls[0])
            message = "read"
        except InvalidArgumentError as error:
            message = str(error)
        os.write(write_end, message.encode()[:4000])
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        message = pipe.read().decode()
    os.waitpid(pid, 0)
    assert message.startswith(f"s3://{BUCKET}: this process was forked"), message
    assert _read(hr.TFRecordDataset(urls))  # the parent reads on


def test_indexed_objects_global_shuffle_equals_local(s3: str, tmp_path: Path) -> None:
    """save_tfrecords uploads each shard's .hrx index: indexed=True reads objects by
    positioned range reads, and global_shuffle gives the local files' order."""
    prefix = f"s3://{BUCKET}/indexed"
    urls = _examples(120).save_tfrecords(prefix, num_shards=3, progress=False)
    local = _examples(120).save_tfrecords(str(tmp_path / "ix"), num_shards=3, progress=False)
    remote = hr.TFRecordDataset(urls, indexed=True)
    here = hr.TFRecordDataset(local, indexed=True)
    assert remote.cardinality() == 120
    assert _read(remote.global_shuffle(seed=4)) == _read(here.global_shuffle(seed=4))
    objstore.delete_object(urls[1] + ".hrx")
    with pytest.raises(StaleIndexError, match=r"no index file s3://data/indexed/"):
        hr.TFRecordDataset(urls, indexed=True)
    objstore.put_atomic(urls[2], b"\0" * 64)  # the shard changed after it was indexed
    with pytest.raises(StaleIndexError, match="is stale"):
        hr.TFRecordDataset(urls[2:], indexed=True)


def test_cli_convert_between_objects(
    s3: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``headrace convert`` reads a CSV object into TFRecord shards in the bucket and
    back to a CSV object, as it does with local files."""
    from headrace.cli import main

    body = "a,b\n" + "".join(f"{i},{i * 1.5}\n" for i in range(40))
    objstore.put_atomic(f"s3://{BUCKET}/conv/in.csv", body.encode())
    assert main(["convert", f"s3://{BUCKET}/conv/in.csv", f"s3://{BUCKET}/conv/tf",
                 "--shards", "2", "--progress", "never"]) == 0
    shards = objstore.glob_objects(f"s3://{BUCKET}/conv/tf/*.tfrecord")
    assert len(shards) == 2 and "40 records in" in capsys.readouterr().out
    assert main(["convert", *shards, f"s3://{BUCKET}/conv/out.csv", "--progress", "never"]) == 0
    info = objstore.object_info(f"s3://{BUCKET}/conv/out.csv")
    lines = objstore.read_whole(info).decode().splitlines()
    assert lines[0] == "a,b" and len(lines) == 41 and lines[1].split(",")[0] == "0"
    assert main(["convert", f"s3://{BUCKET}/conv/missing.csv", str(tmp_path / "x")]) == 1
    assert "s3://data/conv/missing.csv does not exist" in capsys.readouterr().err


def _shared_files(tmp_path: Path, key_id: str, region: str) -> dict[str, str]:
    """AWS shared credentials and config files with a profile ``team``; the variables
    that point at them, as the AWS CLI reads them."""
    credentials, config = tmp_path / "credentials", tmp_path / "config"
    credentials.write_text(
        f"[team]\naws_access_key_id = {key_id}\naws_secret_access_key = team-secret-42\n")
    config.write_text(f"[profile team]\nregion = {region}\n")
    return {"AWS_SHARED_CREDENTIALS_FILE": str(credentials), "AWS_CONFIG_FILE": str(config)}


def test_credentials_of_an_aws_profile_sign_the_requests(
    s3: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Most users keep S3 keys in ``~/.aws/credentials`` under a profile, which the
    client alone does not read: the profile's key signs every request, with its
    region, and its secret appears in no error."""
    urls, paths = _write_shards(tmp_path, "profile", 2, 30)
    expected = _read(hr.TFRecordDataset(paths))
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION"):
        monkeypatch.delenv(name, raising=False)
    for name, value in _shared_files(tmp_path, "AKIDTEAMPROFILE", "eu-west-3").items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_PROFILE", "team")
    faults = Faults()
    proxy = FaultProxy(s3, faults)
    try:
        objstore.configure(f"s3://{BUCKET}", endpoint=proxy.endpoint)
        assert _read(hr.TFRecordDataset(urls)) == expected
        with pytest.raises(FileNotFoundError) as caught:
            _read(hr.TFRecordDataset(f"s3://{BUCKET}/profile/none.tfrecord"))
    finally:
        proxy.close()
    assert faults.authorizations and all(
        "Credential=AKIDTEAMPROFILE/" in value and "/eu-west-3/s3/" in value
        for value in faults.authorizations), faults.authorizations[:2]
    assert "team-secret-42" not in str(caught.value)


def test_keys_in_the_environment_win_over_the_shared_files(
    s3: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    urls, paths = _write_shards(tmp_path, "envwins", 1, 10)
    expected = _read(hr.TFRecordDataset(paths))
    for name, value in _shared_files(tmp_path, "AKIDFROMFILES", "eu-west-3").items():
        monkeypatch.setenv(name, value)
    faults = Faults()
    proxy = FaultProxy(s3, faults)
    try:
        objstore.configure(f"s3://{BUCKET}", endpoint=proxy.endpoint)
        assert _read(hr.TFRecordDataset(urls)) == expected
    finally:
        proxy.close()
    assert faults.authorizations and all(
        f"Credential={ACCESS_KEY}/" in value for value in faults.authorizations)


def test_a_missing_profile_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in _shared_files(tmp_path, "AKIDTEAM", "eu-west-3").items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_PROFILE", "nobody")
    with pytest.raises(InvalidArgumentError, match=r"s3://data: the AWS shared credentials "
                       r"cannot be read \(.*nobody"):
        objstore.object_info(f"s3://{BUCKET}/x")


# ------------------------------------------------- reading the next object ahead


class _Successors:
    """What the read-ahead across objects did: the file sources it served, the
    successors claimed with their data (False: no slot), the objects opened with one
    GET (``at_open``: no object before them to read them ahead), the fetches in flight on the
    read-ahead threads and the most slots their limiter held while one ran."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from headrace._sources import files

        self.sources: list[Any] = []
        self.claims: list[bool] = []
        self.at_open: list[bool] = []
        self.fetches = self.active = self.most_slots = self.slotted = 0
        self.on_claim: Any = None
        self.on_fetch: Any = None
        self.lock = __import__("threading").Lock()
        open_file, claim, fetch, first_range = (
            files._FileRecordsIterator._open, objstore.Successor.claim,
            objstore._fetch_successor, objstore._first_range)

        def spy_open(source: Any) -> Any:
            if source not in self.sources:
                self.sources.append(source)
            return open_file(source)

        def spy_claim(successor: objstore.Successor) -> Any:
            if self.on_claim is not None:
                self.on_claim(successor)
            ahead = successor._future is not None  # (else: an open's own single GET)
            claimed = claim(successor)
            (self.claims if ahead else self.at_open).append(claimed is not None)
            return claimed

        def spy_fetch(url: str, size: int, pool: Any, limiter: Any) -> Any:
            with self.lock:
                self.fetches += 1
                self.active += 1
            try:
                with pool.transient(wait=False, limiter=limiter) as got:  # (the slot the
                    # fetch takes comes next: a look at the cap while this one is held)
                    if got and limiter is not None:
                        self.most_slots = max(self.most_slots, limiter.open_files)
                        self.slotted += 1
                return fetch(url, size, pool, limiter)
            finally:
                with self.lock:
                    self.active -= 1

        def spy_first_range(url: str, size: int) -> Any:  # (on that thread, or in the
            if self.on_fetch is not None:  # open if the thread had not started yet)
                self.on_fetch(url)
            return first_range(url, size)

        monkeypatch.setattr(objstore, "_first_range", spy_first_range)
        monkeypatch.setattr(files._FileRecordsIterator, "_open", spy_open)
        monkeypatch.setattr(objstore.Successor, "claim", spy_claim)
        monkeypatch.setattr(objstore, "_fetch_successor", spy_fetch)


def _small_objects(tmp: Path, prefix: str, count: int, seed: int,
                   compression: str = "") -> tuple[list[str], list[str]]:
    """Many small shards, some empty, some larger than a 4 KiB range."""
    urls, paths = _write_shards(tmp, prefix, count, seed, compression, count=(0, 12),
                                sizes=(0, 40, 700, 3000))
    return urls, paths


@pytest.mark.parametrize(("compression", "buffer_size"), [("", 4096), ("", None),
                                                          ("GZIP", None)])
def test_many_small_objects_are_read_ahead_and_equal_local(
    s3: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compression: str,
    buffer_size: int | None,
) -> None:
    """Each object's HEAD and first range are read while the one before it is on its
    last range: every object but the first is opened from what was read ahead, and the
    elements are the local files', in order."""
    urls, paths = _small_objects(tmp_path, f"small-{compression}-{buffer_size}", 24, 20,
                                 compression)
    spy = _Successors(monkeypatch)
    remote = _read(hr.TFRecordDataset(urls, compression, buffer_size))
    assert remote == _read(hr.TFRecordDataset(paths, compression))
    assert spy.claims == [True] * (len(urls) - 1)  # every object after the first
    batched = _read(hr.TFRecordDataset(urls, compression, buffer_size).batch(5))
    local = _read(hr.TFRecordDataset(paths, compression).batch(5))
    assert [list(b) for b in batched] == [list(b) for b in local]


def test_many_small_files_over_http_are_read_ahead_and_equal_local(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A web server's files: the size and ETag come from the ranged GET's answer
    (Content-Range), an empty file from a HEAD."""
    rng = random.Random(25)
    paths = []
    for shard in range(8):
        path = tmp_path / f"w{shard}.tfrecord"
        with TFRecordWriter(str(path)) as writer:
            for record in _records(rng, 0 if shard in (2, 3) else rng.randrange(1, 20), shard):
                writer.write(record)
        paths.append(str(path))
    spy = _Successors(monkeypatch)
    with range_http_server(str(tmp_path)) as base:
        urls = [f"{base}/{Path(path).name}" for path in paths]
        remote = _read(hr.TFRecordDataset(urls, buffer_size=4096))
    assert remote == _read(hr.TFRecordDataset(paths)) and len(remote) > 20
    assert spy.claims == [True] * (len(urls) - 1)


def test_the_object_read_ahead_is_booked_on_the_stage(
    s3: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """G1: the next object's range read ahead lives in the booking of the object before
    it (the range read-ahead it no longer needs), kept from its close until the next one
    opens; the stage never holds more than its share."""
    from headrace._sources import files

    urls, paths = _small_objects(tmp_path, "small-booked", 12, 21)
    options = hr.Options()
    options.memory_budget = "6MiB"
    spy = _Successors(monkeypatch)
    seen: list[tuple[int, int, int]] = []

    def at_claim(successor: objstore.Successor) -> None:
        if successor._future is None:
            return  # (the first object's open: nothing was read ahead)
        source = spy.sources[-1]
        assert source.reader is None  # between the close of one object and the next open
        booking = source.remote_booking
        assert booking is not None and booking.account is source.account
        seen.append((booking.nbytes, source.account.held, successor.size))

    spy.on_claim = at_claim
    gaps: list[bool] = []
    next_file = files._FileRecordsIterator._next_file

    def between(source: Any) -> None:  # the object closed, the next not open yet
        next_file(source)
        if source.successor is not None:
            booking = source.remote_booking
            gaps.append(booking is not None and booking.nbytes >= source.successor.size
                        and source.account.held >= booking.nbytes)

    monkeypatch.setattr(files._FileRecordsIterator, "_next_file", between)
    dataset = hr.TFRecordDataset(urls).with_options(options)
    with iter(dataset) as iterator:
        remote = [bytes(x) for x in iterator]
        stage = next(s for s in iterator.stats().stages if s.name.startswith("tfrecord"))
    assert remote == _read(hr.TFRecordDataset(paths))
    assert len(seen) == len(urls) - 1 and gaps == [True] * (len(urls) - 1)
    for booked, held, size in seen:
        assert booked == objstore.READ_AHEAD_RANGES * size and held >= booked
    assert stage.peak <= stage.limit and stage.overdrawn_peak == 0, stage
    assert spy.sources[-1].account.held == 0  # all given back at the end


@pytest.mark.parametrize("fault", ["reset", "503"])
def test_a_fault_while_the_next_object_is_read_ahead_loses_nothing(
    s3: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    """The proxy resets the connection or answers 503 SlowDown while the next object is
    read ahead (the reader makes no request then): its GET is retried; nothing is lost
    or repeated."""
    urls, paths = _write_shards(tmp_path, f"ahead-{fault}", 6, 22, count=(40, 41),
                                sizes=(1000,))
    faults = Faults(reset_after=5000)
    proxy = FaultProxy(s3, faults)
    spy = _Successors(monkeypatch)

    def arm(url: str) -> None:
        if url == urls[3]:  # the fourth object's HEAD and GET meet the faults
            with faults.lock:
                if fault == "reset":
                    faults.resets = 2
                else:
                    faults.errors_503 = 3

    spy.on_fetch = arm
    try:
        objstore.configure(f"s3://{BUCKET}", endpoint=proxy.endpoint,
                           retry_config={"max_retries": 0})
        objstore.configure(retry=objstore.RetryPolicy(attempts=10, initial_backoff=0.01))
        remote = _read(hr.TFRecordDataset(urls))
    finally:
        proxy.close()
    local = _read(hr.TFRecordDataset(paths))
    assert remote == local and len(local) == 6 * 40
    assert (faults.done_resets, faults.done_503) == ((2, 0) if fault == "reset" else (0, 3))
    assert spy.claims == [True] * 5


@pytest.mark.parametrize("cap", [1, 2])
def test_reading_the_next_object_ahead_stays_under_the_file_cap(
    s3: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cap: int
) -> None:
    """G2: the fetch of the next object takes a slot of the pipeline's cap while it runs;
    under max_open_files=1 the reader holds the only one, so nothing is read ahead on a
    thread (each object's open reads it)."""
    urls, paths = _small_objects(tmp_path, f"small-cap{cap}", 16, 23)
    options = hr.Options()
    options.max_open_files = cap
    spy = _Successors(monkeypatch)
    with FdPeak() as fds:
        remote = _read(hr.TFRecordDataset(urls, buffer_size=4096).with_options(options))
    assert remote == _read(hr.TFRecordDataset(paths))
    if cap > 1:
        assert spy.claims == [True] * (len(urls) - 1)
    else:  # no fetch got a slot on its thread (one not started is made by the open,
        assert spy.slotted == 0  # in the open's own slot)
    assert spy.most_slots <= cap
    if cap > 1:  # (under a cap of 1 the client itself may hold a second socket a moment,
        # while it replaces a pooled connection the server closed: with or without this)
        assert fds.growth <= cap, f"{fds.growth} descriptors/connections under a cap of {cap}"


def test_dropping_the_iterator_drops_the_object_read_ahead(
    s3: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An iterator closed (or a take() that ends) while the next object is read ahead:
    the fetch finishes on its own, its booking stays until it has, then every byte is
    given back and no fetch is left running."""
    import time

    urls, paths = _write_shards(tmp_path, "dropped", 4, 24, count=(30, 31), sizes=(500,))
    faults = Faults(delay=0.3)
    proxy = FaultProxy(s3, faults)
    spy = _Successors(monkeypatch)
    try:
        objstore.configure(f"s3://{BUCKET}", endpoint=proxy.endpoint)
        iterator = iter(hr.TFRecordDataset(urls))
        next(iterator)  # the first object is open, the second is being read ahead
        source = spy.sources[0]
        deadline = time.monotonic() + 10
        while not spy.active and time.monotonic() < deadline:  # (its thread starts)
            time.sleep(0.01)
        assert spy.active == 1 and source.successor is not None
        booked = source.remote_booking.nbytes
        iterator.close()
        assert spy.active == 1 and source.account.held >= booked  # still in flight: booked
        deadline = time.monotonic() + 10
        while (spy.active or source.account.held) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert (spy.active, source.account.held) == (0, 0)
        assert source.successor is None and source.remote_booking is None
        # take() ends the same way, mid-list
        taken = _read(hr.TFRecordDataset(urls).take(35))
    finally:
        proxy.close()
    assert taken == _read(hr.TFRecordDataset(paths))[:35]
    assert spy.claims == [True]  # (the take's second object)
    deadline = time.monotonic() + 10
    while spy.active and time.monotonic() < deadline:
        time.sleep(0.02)
    assert spy.active == 0 and spy.sources[-1].account.held == 0


def test_an_object_replaced_after_it_was_read_ahead_is_data_loss(
    s3: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The next object's later ranges are read on the condition of the ETag its first
    range came with: replaced between the read-ahead and its next range, it raises
    DataLossError naming it, after the elements of the objects before it."""
    urls, paths = _write_shards(tmp_path, "replaced-ahead", 2, 26, count=(60, 61),
                                sizes=(1000,))
    spy = _Successors(monkeypatch)

    def replace(successor: objstore.Successor) -> None:
        if successor._future is None:
            return  # (the first object's open)
        successor._future.result()  # (its first range is read: the old version's)
        objstore.put_atomic(successor.url, b"\0" * 100_000)

    spy.on_claim = replace
    got: list[bytes] = []
    with pytest.raises(DataLossError, match=r"replaced-ahead/part-001.*changed while it was read"):
        for element in hr.TFRecordDataset(urls, buffer_size=4096).as_numpy_iterator():
            got.append(element)
    first = _read(hr.TFRecordDataset(paths[0]))
    assert got[: len(first)] == first and len(got) < 120
    assert spy.claims == [True]


def test_each_small_object_costs_one_request(
    s3: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An object read from its start is opened with one ranged GET, whose answer
    carries its size and ETag (a HEAD then a GET was two round trips per object): read
    ahead in a list, or opened by an interleave's slot. An empty object takes a HEAD."""
    urls, paths = _write_shards(tmp_path, "one-request", 10, 27, count=(0, 8), sizes=(40, 900))
    empty = sum(1 for path in paths if not os.path.getsize(path))
    assert 0 < empty < len(paths)
    faults = Faults()
    proxy = FaultProxy(s3, faults)
    spy = _Successors(monkeypatch)
    try:
        objstore.configure(f"s3://{BUCKET}", endpoint=proxy.endpoint)
        listed = _read(hr.TFRecordDataset(urls))
        in_list = faults.requests
        def interleaved(names: list[str]) -> hr.Dataset:
            return hr.Dataset.from_tensor_slices(names).interleave(
                hr.TFRecordDataset, cycle_length=4, block_length=2)
        remote = _read(interleaved(urls))
    finally:
        proxy.close()
    assert listed == _read(hr.TFRecordDataset(paths))
    assert remote == _read(interleaved(paths))
    assert in_list == len(urls) + empty  # (an empty object: its GET is refused, 416)
    assert faults.requests - in_list == len(urls) + empty
    assert spy.at_open == [True] * (1 + len(urls)) and spy.claims == [True] * (len(urls) - 1)


def test_many_small_text_objects_are_read_ahead_and_equal_local(
    s3: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TextLineDataset reads through the same file source: lines of many small objects
    (some empty, some without a final newline) in order, each object read ahead."""
    rng = random.Random(28)
    urls, paths = [], []
    for part in range(14):
        lines = [f"{part}-{i}-" + "x" * rng.randrange(0, 3000) for i in range(rng.randrange(0, 9))]
        body = "\n".join(lines) + ("\n" if part % 3 else "")
        path = tmp_path / f"t{part}.txt"
        path.write_text(body)
        url = f"s3://{BUCKET}/text-ahead/t{part:02d}.txt"
        objstore.put_atomic(url, body.encode())
        urls.append(url)
        paths.append(str(path))
    spy = _Successors(monkeypatch)
    remote = _read(hr.TextLineDataset(urls, buffer_size=4096))
    assert remote == _read(hr.TextLineDataset(paths)) and len(remote) > 20
    assert spy.claims == [True] * (len(urls) - 1)


# ----------------------------------------------------------- cache(url) and snapshot(url)


def _cache_input(count: int = 120, seed: int = 0) -> tuple[hr.Dataset, list[int]]:
    """Elements from empty to larger than a record read alone (32 KiB), so cache reads
    take runs of small records and large records one by one; and the calls of the input
    (a pass that reads the cache reads no input)."""
    rng = random.Random(seed)
    blobs = [rng.randbytes(rng.choice((0, 40, 3000, 40000))) for _ in range(count)]
    calls: list[int] = []

    def element(i: Any) -> Any:
        calls.append(1)
        return {"i": i, "blob": blobs[int(i)]}

    return hr.Dataset.range(count).map(element), calls


def _plain(elements: list[Any]) -> list[tuple[int, bytes]]:
    return [(int(e["i"]), bytes(e["blob"])) for e in elements]


def _objects(prefix: str, name: str = "") -> list[str]:
    """The objects under the folder ``prefix`` whose names start with ``name``."""
    return sorted(info.url for info in objstore.list_objects(prefix)
                  if info.url.startswith(prefix + name))


def _persisted(dataset: hr.Dataset, method: str, where: str) -> hr.Dataset:
    if method == "cache":
        return dataset.cache(where)
    return dataset.snapshot(where, compression=method.split("-", 1)[1] or None)


@pytest.mark.parametrize("method", ["cache", "snapshot-", "snapshot-GZIP"])
def test_cache_and_snapshot_on_s3_equal_local(s3: str, tmp_path: Path, method: str) -> None:
    """Two epochs through the cache, a new iterator, batches decoded column by column:
    element for element the local cache's, and after the first pass no input is read."""
    url = f"s3://{BUCKET}/persist-{method}/c"
    dataset, calls = _cache_input()
    remote = _persisted(dataset, method, url)
    local = _plain(_read(_persisted(dataset, method, str(tmp_path / "c")).repeat(2)))
    calls.clear()
    assert _plain(_read(remote.repeat(2))) == local and len(local) == 240
    assert len(calls) == 120  # the first epoch read the input, the second the cache
    names = _objects(f"s3://{BUCKET}/persist-{method}/")
    assert [name.rsplit(".", 1)[-1] for name in names] == (
        [names[0].rsplit(".", 1)[-1], "crc", "hrx", "json"])  # data, its files, the manifest
    calls.clear()
    assert _plain(_read(remote)) == local[:120] and calls == []
    batches = _read(remote.batch(16))
    assert [int(i) for batch in batches for i in batch["i"]] == list(range(120))
    assert [bytes(b) for batch in batches for b in batch["blob"]] == [b for _, b in local[:120]]
    assert calls == [] and _objects(f"s3://{BUCKET}/persist-{method}/") == names


@pytest.mark.parametrize("width", [10, 9000])
def test_batches_of_a_cache_on_s3_are_read_in_runs(
    s3: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, width: int
) -> None:
    """``cache(url).batch(n)`` of alike elements is decoded column by column from runs
    of records, one GET per run (records of 36 KB, which a local file reads straight into
    the batch's rows piece by piece, are read in runs too: a piece would be a GET)."""
    rows = np.arange(300 * width, dtype=np.float32).reshape(300, width)
    dataset = hr.Dataset.from_tensor_slices({"x": rows, "i": np.arange(300)})
    url = f"s3://{BUCKET}/batched-{width}/c"
    local = _read(dataset.cache(str(tmp_path / "c")).batch(32))
    _read(dataset.cache(url))
    gets: list[int] = []
    fetch = objstore._fetch

    def counted(info: Any, offset: int, size: int) -> Any:
        gets.append(size)
        return fetch(info, offset, size)

    monkeypatch.setattr(objstore, "_fetch", counted)
    for _ in range(2):
        remote = _read(dataset.cache(url).batch(32))
        assert len(remote) == len(local) == 10
        for got, want in zip(remote, local, strict=True):
            assert np.array_equal(got["x"], want["x"]) and np.array_equal(got["i"], want["i"])
    # a run (or a few) per batch, small objects, and the first record's head, once a pass
    # (its layout: the batch's rows are booked before any run is read)
    assert len(gets) <= 2 * (10 + 4 + 1), gets


_OTHER_PROCESS = """
import json, sys
import headrace as hr
from headrace._persist import remote_store

def refuse(*args, **kwargs):
    raise AssertionError("the cache was written again instead of read")

remote_store.RemoteStore.__init__ = refuse
dataset = hr.Dataset.from_tensor_slices([3 * i for i in range(300)])
print(json.dumps([int(x) for x in dataset.cache(sys.argv[1]).as_numpy_iterator()]))
"""


def test_a_cache_on_s3_is_read_by_another_process(s3: str) -> None:
    import subprocess

    url = f"s3://{BUCKET}/other-process/c"
    # (no function: a function's fingerprint names where it was defined)
    dataset = hr.Dataset.from_tensor_slices([3 * i for i in range(300)])
    assert [int(x) for x in _read(dataset.cache(url))] == [3 * i for i in range(300)]
    source = os.path.dirname(os.path.dirname(os.path.dirname(hr.__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [source, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", _OTHER_PROCESS, url], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout) == [3 * i for i in range(300)]


@pytest.mark.parametrize(("stop", "method"), [
    ("take", "cache"), ("raise", "cache"), ("upload", "cache"),
    ("take", "snapshot-"), ("raise", "snapshot-GZIP"),
])
def test_an_interrupted_first_pass_leaves_no_cache_on_s3(
    s3: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop: str, method: str
) -> None:
    """A pass that stops early (``take``, an exception, an upload that fails) publishes
    no manifest and leaves no object, nor its local staging directory; the next pass
    reads the input and writes it."""
    import tempfile

    staging = tmp_path / "staging"
    staging.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(staging))
    prefix = f"s3://{BUCKET}/interrupted-{stop}-{method}/"
    dataset, calls = _cache_input(60, seed=3)
    expected = _plain(_read(dataset))
    # (a snapshot stopped early says nothing: tf.data's advice is the cache's)
    advice = (pytest.warns(UserWarning, match="partially cached contents")
              if method == "cache" else contextlib.nullcontext())
    if stop == "raise":
        armed = [True]

        def fail_once(e: Any) -> Any:
            if int(e["i"]) == 40 and armed:
                armed.pop()
                raise ZeroDivisionError("element 40")
            return e

        failing = _persisted(dataset.map(fail_once), method, prefix + "c")
        with advice, iter(failing) as iterator, pytest.raises(ZeroDivisionError):
            list(iterator)
    else:
        cached = _persisted(dataset, method, prefix + "c")
        if stop == "take":
            with advice:
                assert _plain(_read(cached.take(7))) == expected[:7]
        else:
            def refused(url: str, data: bytes) -> bool:
                raise OSError(5, "the manifest's upload failed", url)

            put_if_absent = objstore.put_if_absent
            monkeypatch.setattr(objstore, "put_if_absent", refused)
            with pytest.raises(OSError, match="the manifest's upload failed"):
                _read(cached)
            monkeypatch.setattr(objstore, "put_if_absent", put_if_absent)
    assert _objects(prefix) == []  # nothing published, nothing left behind
    assert list(staging.iterdir()) == []
    dataset, calls = _cache_input(60, seed=3)
    cached = _persisted(dataset, method, prefix + "c")
    assert _plain(_read(cached)) == expected and len(calls) == 60
    assert len(_objects(prefix)) == 4 and list(staging.iterdir()) == []
    calls.clear()
    assert _plain(_read(cached)) == expected and calls == []


@pytest.mark.parametrize(
    "damage", ["truncate-data", "flip-byte", "foreign-data", "edit-manifest",
               "bad-json", "no-checksums"])
def test_a_damaged_cache_on_s3_is_refused_naming_the_url(s3: str, damage: str) -> None:
    prefix = f"s3://{BUCKET}/damaged-{damage}/"
    dataset, calls = _cache_input(50, seed=4)
    cached = dataset.cache(prefix + "c")
    assert len(_read(cached)) == 50
    other, _ = _cache_input(50, seed=5)
    _read(other.cache(prefix + "other"))
    names = _objects(prefix, "c")
    data = next(name for name in names if name.rsplit(".", 1)[-1] not in ("crc", "hrx", "json"))
    manifest = prefix + "c.hrcache.json"

    def body(url: str) -> bytes:
        return objstore.read_whole(objstore.object_info(url))

    named = data
    if damage == "truncate-data":
        objstore.put_atomic(data, body(data)[:-10])
    elif damage == "flip-byte":
        content = bytearray(body(data))
        content[len(content) // 2] ^= 1
        objstore.put_atomic(data, bytes(content))
    elif damage == "foreign-data":
        foreign = next(name for name in _objects(prefix, "other")
                       if name.rsplit(".", 1)[-1] not in ("crc", "hrx", "json"))
        objstore.put_atomic(data, body(foreign))
        named = manifest  # (its records are not the ones the manifest vouches for)
    elif damage == "edit-manifest":
        content = json.loads(body(manifest))
        content["elements"] = 49
        objstore.put_atomic(manifest, json.dumps(content).encode())
        named = manifest
    elif damage == "bad-json":
        objstore.put_atomic(manifest, body(manifest)[:-5])
        named = manifest
    else:
        objstore.delete_object(data + ".crc")
        named = data + ".crc"
    calls.clear()
    with pytest.raises(DataLossError, match=re.escape(named)):
        _read(cached)
    assert calls == []  # refused, never rebuilt over
    assert _objects(prefix, "c") == [n for n in names if damage != "no-checksums"
                                      or not n.endswith(".crc")]


@pytest.mark.parametrize("seed", [0, 1])
def test_faults_while_a_cache_is_read_from_s3_lose_and_repeat_nothing(
    s3: str, tmp_path: Path, seed: int
) -> None:
    """Resets in the middle of ranges and 503s while the cache (and the range read
    ahead) is read, retried by headrace alone: the local cache's elements, in order."""
    url = f"s3://{BUCKET}/cache-faults-{seed}/c"
    dataset, calls = _cache_input(150, seed=10 + seed)
    cached = dataset.cache(url)
    assert len(_read(cached)) == 150
    local = _plain(_read(dataset.cache(str(tmp_path / "c"))))
    faults = Faults(resets=4, reset_after=20000 + 3001 * seed, errors_503=3)
    proxy = FaultProxy(s3, faults)
    try:
        objstore.configure(f"s3://{BUCKET}", endpoint=proxy.endpoint,
                           retry_config={"max_retries": 0})
        objstore.configure(retry=objstore.RetryPolicy(attempts=10, initial_backoff=0.01))
        calls.clear()
        remote = _plain(_read(cached.repeat(2)))
    finally:
        proxy.close()
    assert remote == local * 2 and calls == []
    assert faults.done_resets == 4 and faults.done_503 == 3  # the faults happened


def test_503s_while_a_cache_is_uploaded_are_retried(
    s3: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """503 SlowDown answers to the upload's PUTs (data, index, checksums, the conditional
    manifest) are retried from the file's start; the cache is published once, whole."""
    from headrace._persist import remote_store

    prefix = f"s3://{BUCKET}/upload-503/"
    dataset, calls = _cache_input(80, seed=16)
    faults = Faults()
    proxy = FaultProxy(s3, faults)
    upload = remote_store.RemoteStore._upload

    def armed(store: Any) -> None:
        with faults.lock:
            faults.errors_503 = faults.done_503 + 4
        upload(store)

    monkeypatch.setattr(remote_store.RemoteStore, "_upload", armed)
    try:
        objstore.configure(f"s3://{BUCKET}", endpoint=proxy.endpoint,
                           retry_config={"max_retries": 0})
        objstore.configure(retry=objstore.RetryPolicy(attempts=10, initial_backoff=0.01))
        expected = _plain(_read(dataset.cache(prefix + "c")))
    finally:
        proxy.close()
    objstore.reset_stores()
    assert faults.done_503 == 4 and len(_objects(prefix)) == 4
    calls.clear()
    assert _plain(_read(dataset.cache(prefix + "c"))) == expected and calls == []


def test_reading_a_cache_from_s3_stays_within_the_budget(
    s3: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """G1: what the client holds while it uploads the cache is booked on the stage;
    reading it, the records read and the range read ahead are booked on the cache's
    share, which the stage never passes; each byte of the data object is fetched once a
    pass (the range read ahead is the one the next read asks for, never a guess)."""
    from headrace._persist import records

    url = f"s3://{BUCKET}/cache-budget/c"
    dataset, calls = _cache_input(200, seed=7)
    options = hr.Options()
    options.memory_budget = "3MiB"
    uploads: list[tuple[int, int, int]] = []
    put_atomic = objstore.put_atomic

    def booked_upload(url: str, data: Any, *, parts_in_flight: int = 4,
                      limiter: Any = None) -> None:
        stage = objstore_stage[0]
        uploads.append((stage.held, stage.share(), parts_in_flight))
        put_atomic(url, data, parts_in_flight=parts_in_flight, limiter=limiter)

    from headrace._persist import remote_store

    objstore_stage: list[Any] = []
    store_init = remote_store.RemoteStore.__init__

    def remember(store: Any, *args: Any) -> None:
        store_init(store, *args)
        objstore_stage.append(store.account)

    monkeypatch.setattr(remote_store.RemoteStore, "__init__", remember)
    monkeypatch.setattr(objstore, "put_atomic", booked_upload)
    expected = _plain(_read(dataset.cache(url)))  # written under the default budget
    # the data, its index, its checksums: each upload booked while it runs
    assert len(uploads) == 3 and all(held > 0 and parts >= 1 for held, _, parts in uploads)
    assert uploads[0][0] >= 1 << 20 and all(held <= share for held, share, _ in uploads)
    cached = dataset.cache(url).with_options(options)
    fetched: list[tuple[int, int]] = []
    fetch = objstore._fetch

    def counted(info: Any, offset: int, size: int) -> Any:
        if ".hrcache." in info.url and info.url.rsplit(".", 1)[-1] not in ("crc", "hrx", "json"):
            fetched.append((offset, size))
        return fetch(info, offset, size)

    ahead: list[tuple[int, int]] = []
    read_next_ahead = records.RecordReader._read_next_ahead

    def booked(reader: Any, first: int) -> None:
        read_next_ahead(reader, first)
        if reader.ahead_booking.nbytes:
            ahead.append((reader.ahead_booking.nbytes, reader.account.held))

    monkeypatch.setattr(objstore, "_fetch", counted)
    monkeypatch.setattr(records.RecordReader, "_read_next_ahead", booked)
    calls.clear()
    with iter(cached) as iterator:
        got = _plain(list(iterator))
        stage = next(s for s in iterator.stats().stages if s.name.startswith("cache"))
    assert got == expected and calls == []
    size = next(info.size for info in objstore.list_objects(f"s3://{BUCKET}/cache-budget/")
                if info.url.rsplit(".", 1)[-1] not in ("crc", "hrx", "json"))
    assert sum(n for _, n in fetched) == size and len(set(fetched)) == len(fetched)
    # every range but the first was read ahead, booked while it was on its way
    assert len(ahead) == len(fetched) - 1 > 5
    assert all(held >= nbytes > 0 for nbytes, held in ahead)
    assert 0 < stage.peak <= stage.limit and stage.overdrawn_peak == 0, stage


def test_a_budget_without_room_for_the_upload_is_refused_early_in_the_pass(
    s3: str,
) -> None:
    """The upload at a pass's end holds the staged cache whole, or a 5 MiB part of it at
    least: under a budget that cannot give that, the pass is refused as soon as the
    staged data shows it (naming the upload), not at its end after every element was
    computed; nothing is uploaded. A cache small enough to upload whole is written."""
    prefix = f"s3://{BUCKET}/cache-small-budget/"
    blob = bytes(range(256)) * 160  # 40 KiB

    calls: list[int] = []

    def element(i: Any) -> Any:
        calls.append(1)
        return {"i": i, "blob": blob}

    options = hr.Options()
    options.memory_budget = "4MiB"
    large = hr.Dataset.range(400).map(element)  # 16 MiB staged: a part to upload
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(hr.MemoryBudgetError,
                           match=r"upload of s3://.*cache-small-budget/l"):
            _read(large.cache(prefix + "l").with_options(options))
    assert 0 < len(calls) < 200 and _objects(prefix) == []
    # the pass was refused, not stopped early: no advice about take(k)
    assert not [w for w in caught if "take(k)" in str(w.message)]
    small = hr.Dataset.range(40).map(element)  # 1.6 MiB: uploaded whole, within 4 MiB
    expected = _plain(_read(small))
    assert _plain(_read(small.cache(prefix + "s").with_options(options))) == expected
    assert any(url.endswith("s.hrcache.json") for url in _objects(prefix))


@pytest.mark.parametrize("cap", [1, 2])
def test_reading_a_cache_from_s3_stays_under_the_file_cap(
    s3: str, monkeypatch: pytest.MonkeyPatch, cap: int
) -> None:
    """G2: the cache object holds a slot of the pipeline's cap, and the range read ahead
    takes another while it is fetched, only if one is free: under max_open_files=1
    nothing is fetched on a thread (each read fetches its own range), under 2 the cap
    is never passed; the elements are the same."""
    url = f"s3://{BUCKET}/cache-cap-{cap}/c"
    dataset, calls = _cache_input(150, seed=15)
    expected = _plain(_read(dataset.cache(url)))
    options = hr.Options()
    options.max_open_files = cap
    options.memory_budget = "3MiB"  # (runs of a few hundred KiB: many ranges)
    slots: list[tuple[bool, int]] = []
    fetch_ahead = objstore._fetch_ahead

    def spied(info: Any, offset: int, size: int, pool: Any, limiter: Any) -> Any:
        with pool.transient(wait=False, limiter=limiter) as got:  # (a look at the cap
            slots.append((got, limiter.open_files if got else 0))  # with the slot held)
        return fetch_ahead(info, offset, size, pool, limiter)

    monkeypatch.setattr(objstore, "_fetch_ahead", spied)
    calls.clear()
    with FdPeak() as fds:
        assert _plain(_read(dataset.cache(url).with_options(options))) == expected
    assert calls == [] and len(slots) > 3
    if cap == 1:
        assert not any(got for got, _ in slots)
    else:
        assert all(got for got, _ in slots) and max(held for _, held in slots) <= cap
        assert fds.growth <= cap, f"{fds.growth} descriptors/connections under a cap of {cap}"


@pytest.mark.parametrize("phase", ["reading", "writing"])
def test_resuming_a_cache_on_s3_mid_pass_equals_the_uninterrupted_run(
    s3: str, phase: str
) -> None:
    url = f"s3://{BUCKET}/cache-resume-{phase}/c"
    dataset, calls = _cache_input(90, seed=8)
    cached = dataset.cache(url)
    expected = _plain(_read(dataset))
    if phase == "reading":
        assert _plain(_read(cached)) == expected
    first = iter(cached)
    head = _plain([next(first) for _ in range(37)])
    state = first.get_state()
    with pytest.warns(UserWarning) if phase == "writing" else contextlib.nullcontext():
        first.close()  # (a pass stopped while writing: its partial cache is discarded)
    calls.clear()
    resumed = iter(cached)
    resumed.set_state(state)
    assert head + _plain(list(resumed)) == expected
    assert (calls == []) == (phase == "reading")  # a write is replayed from its input
    calls.clear()
    assert _plain(_read(cached)) == expected and calls == []  # and it was published


def test_racing_writers_keep_the_first_manifest(s3: str) -> None:
    """Two iterators that start before either completes both write (an object store has
    no lock); the manifest is published only if none is there, so the first to complete
    is kept, and the second deletes its copy. Another pipeline's cache at the URL is
    replaced, its objects deleted."""
    prefix = f"s3://{BUCKET}/race/"
    dataset, calls = _cache_input(40, seed=9)
    cached = dataset.cache(prefix + "c")
    expected = _plain(_read(dataset))
    first, second = iter(cached), iter(cached)
    assert _plain([next(second) for _ in range(5)]) == expected[:5]
    assert _plain(list(first)) == expected
    published = _objects(prefix)
    manifest = objstore.object_info(prefix + "c.hrcache.json")
    assert _plain(list(second)) == expected[5:]
    assert _objects(prefix) == published and len(published) == 4
    assert objstore.object_info(prefix + "c.hrcache.json").etag == manifest.etag
    calls.clear()
    assert _plain(_read(cached)) == expected and calls == []
    other, _ = _cache_input(40, seed=11)
    assert _plain(_read(other.cache(prefix + "c"))) == _plain(_read(other))
    replaced = _objects(prefix)
    assert len(replaced) == 4 and not set(replaced) & (set(published) - {manifest.url})


def test_a_store_without_conditional_writes_still_publishes_once(
    s3: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that refuses If-None-Match (501, or the client's NotSupported): the
    manifest is published if no object is there (a HEAD first), never over one."""
    import obstore
    from obstore.exceptions import NotSupportedError

    put = obstore.put

    def no_create(store: Any, key: str, data: Any, **options: Any) -> Any:
        if options.get("mode") == "create":
            raise NotSupportedError("conditional put is not supported by this store")
        return put(store, key, data, **options)

    monkeypatch.setattr(obstore, "put", no_create)
    url = f"s3://{BUCKET}/unconditional/m.json"
    assert objstore.put_if_absent(url, b"first") is True
    assert objstore.put_if_absent(url, b"second") is False
    assert objstore.read_whole(objstore.object_info(url)) == b"first"
    dataset, calls = _cache_input(20, seed=14)
    cached = dataset.cache(f"s3://{BUCKET}/unconditional/c")
    assert len(_read(cached)) == 20 and len(calls) == 20
    calls.clear()
    assert len(_read(cached)) == 20 and calls == []


def test_cache_and_snapshot_urls_pick_their_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """gs:// and az:// go through the same code as s3:// (no emulator here): the first
    request goes to the store of the URL's cloud."""
    asked: list[str] = []

    def store(root: str) -> Any:
        asked.append(root)
        raise InvalidArgumentError(f"{root}: no store in this test")

    monkeypatch.setattr(objstore, "_store", store)
    for dataset in (hr.Dataset.range(3).cache("gs://bucket/dir/c"),
                    hr.Dataset.range(3).snapshot("az://container/snaps")):
        with pytest.raises(InvalidArgumentError, match="no store in this test"):
            _read(dataset)
    assert asked == ["gs://bucket", "az://container"]


@pytest.mark.parametrize(("method", "url", "problem"), [
    ("cache", "https://host/c", "web server's URL, which headrace only reads"),
    ("snapshot", "http://host:8000/s", "web server's URL, which headrace only reads"),
    ("cache", "s3://bucket", r"names a bucket or a folder.*s3://bucket/name"),
    ("cache", "gs://bucket/dir/", r"names a bucket or a folder.*gs://bucket/dir/name"),
    ("cache", "s3:///c", "names no bucket"),
])
def test_urls_a_cache_cannot_be_written_to_are_refused_when_built(
    method: str, url: str, problem: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=f"{re.escape(url)}.*{problem}|{problem}"):
        getattr(hr.Dataset.range(3), method)(url)


@pytest.mark.parametrize("method", ["cache", "snapshot-"])
def test_a_cache_in_a_missing_bucket_is_refused_before_its_pass(s3: str, method: str) -> None:
    dataset, calls = _cache_input(20, seed=13)
    with pytest.raises(FileNotFoundError, match="no such object or bucket") as caught:
        _read(_persisted(dataset, method, "s3://no-such-bucket-c/dir/c"))
    assert str(caught.value.filename).startswith("s3://no-such-bucket-c/dir/")
    assert calls == []  # said before the input was read, not after a whole pass


@pytest.mark.parametrize("method", ["cache", "snapshot-"])
def test_file_urls_cache_to_their_paths(tmp_path: Path, method: str) -> None:
    dataset, calls = _cache_input(20, seed=12)
    cached = _persisted(dataset, method, f"file://{tmp_path}/c")
    expected = _plain(_read(dataset))
    calls.clear()
    assert _plain(_read(cached)) == expected and len(calls) == 20
    calls.clear()
    assert _plain(_read(_persisted(dataset, method, str(tmp_path / "c")))) == expected
    assert calls == []  # the same files

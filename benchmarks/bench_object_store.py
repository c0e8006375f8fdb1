"""TFRecord read+parse from an S3 server vs the same files on local disk vs the client's raw read.

    python benchmarks/bench_object_store.py [--case MIB:SHARDS ...] [--rounds 3]
                                            [--budget 256MiB] [--compare-clients]

Each case (by default ``256:4``, realistic 64 MiB shards, and ``64:64``, many small
shards of 1 MiB) is timed in the same run, side by side, rounds interleaved, best of
``rounds`` each:

* ``raw client``: obstore's ``get_range`` over every object in 8 MiB ranges, objects one
  after another (a HEAD, then the ranges: what a user's loop over the shards does),
  bytes only, nothing parsed: the most the client gets out of this server that way;
* ``raw client, no HEAD``: the same, each object's size taken from its first GET's
  answer (one request fewer per object, as headrace's read-ahead across objects does);
  the ``vs no HEAD`` column is the ratio to it;
* ``headrace s3 records``: ``TFRecordDataset(urls).batch(1024)`` (framing, CRCs);
* ``before: HEAD + GET, none read ahead``: the same records, each object opened with a
  HEAD when the one before ends and its first range read when the reader asks for it
  (as before the read-ahead across objects): the anchor it is measured against;
* ``headrace s3 interleave(4) records``: the objects through
  ``interleave(TFRecordDataset, cycle_length=4, block_length=16).batch(1024)``: each
  slot reads one object, so nothing is read ahead across objects, but each slot's open
  is one ranged GET; with its ``before`` line (a HEAD and a GET per open);
* ``headrace s3 read+parse``: ``...batch(1024).parse_examples(spec)``;
* ``headrace local read+parse``: the same on the local copies;
* with ``--compare-clients``: ``pyarrow.fs`` and ``s3fs`` reading the same ranges raw.

The server is moto's (``moto[server]``) in a subprocess on loopback, the same one the
tests use: it bounds every line here (it serves a few hundred MB/s at best, far from a
cloud bucket's aggregate, and shares this machine's CPUs), so the ratio to the raw client
is the measure, not MB/s. Target: headrace's S3 records and read+parse >= 0.8 of the raw
client's throughput, in both cases. Memory: the peak growth of this process's resident
anonymous memory during a pass (moto's is its own process and not counted), against
``Options(memory_budget=...)``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))

from objstore_servers import make_bucket, moto_server, s3_env

from _harness import charged, read_status


class _Peak:
    """The peak of this process's anonymous resident memory above its start."""

    def __init__(self) -> None:
        self.base = self.peak = charged(read_status())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, charged(read_status()))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak - self.base


def _other_clients(endpoint: str, urls: list[str]) -> dict[str, Callable[[], int]]:
    """Raw reads of the same objects in the same 8 MiB ranges by the other candidate
    clients, where installed (they are not headrace dependencies)."""
    from objstore_servers import ACCESS_KEY, SECRET_KEY

    from headrace.io import objstore

    block = objstore.REMOTE_BUFFER_SIZE
    keys = [url.removeprefix("s3://") for url in urls]
    lines: dict[str, Callable[[], int]] = {}
    try:
        import pyarrow.fs as pafs

        arrow = pafs.S3FileSystem(access_key=ACCESS_KEY, secret_key=SECRET_KEY,
                                  endpoint_override=endpoint, region="us-east-1", scheme="http")

        def arrow_raw() -> int:
            count = 0
            for key in keys:
                with arrow.open_input_file(key) as file:
                    size = file.size()
                    for start in range(0, size, block):
                        count += len(file.read_at(min(block, size - start), start))
            return count

        lines["raw pyarrow.fs"] = arrow_raw
    except ImportError:
        pass
    try:
        import s3fs

        fs = s3fs.S3FileSystem(key=ACCESS_KEY, secret=SECRET_KEY, endpoint_url=endpoint)

        def s3fs_raw() -> int:
            count = 0
            for key in keys:
                size = fs.size(key)
                for start in range(0, size, block):
                    count += len(fs.cat_file(key, start=start, end=min(size, start + block)))
            return count

        lines["raw s3fs"] = s3fs_raw
    except ImportError:
        pass
    return lines


def _case(text: str) -> tuple[int, int]:
    try:
        mib, shards = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a case is MIB:SHARDS, got {text!r}") from None
    if mib < 1 or shards < 1:
        raise argparse.ArgumentTypeError(f"a case needs MIB and SHARDS >= 1, got {text!r}")
    return mib, shards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", type=_case, action="append", dest="cases",
                        help="MIB:SHARDS, TFRecord data in all and shards it is in "
                             "(repeat it; default: 256:4 and 64:64)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget", default="256MiB")
    parser.add_argument("--compare-clients", action="store_true",
                        help="also time pyarrow.fs and s3fs reading the same objects raw "
                             "(how the client was chosen)")
    args = parser.parse_args()
    cases = args.cases or [(256, 4), (64, 64)]
    with tempfile.TemporaryDirectory() as scratch, moto_server() as endpoint:
        os.environ.update(s3_env(endpoint))
        from headrace.io import objstore

        objstore.reset_stores()
        make_bucket(endpoint, "bench")
        print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs "
              "(moto's server runs on the same CPUs)")
        for number, (mib, shards) in enumerate(cases):
            _run_case(endpoint, Path(scratch) / str(number), mib, shards, args)
        print(f"load average {os.getloadavg()[0]:.1f} at the end")


def _run_case(endpoint: str, scratch: Path, mib: int, shards: int, args: Any) -> None:
    import obstore

    import headrace as hr
    from headrace.io import objstore
    from headrace.io.example import FixedLenFeature

    spec = {"x": FixedLenFeature((32,), np.float32), "y": FixedLenFeature((), np.int64),
            "data": FixedLenFeature((), bytes)}
    payload = 1024
    rows = mib * 1024 * 1024 // (payload + 200)
    rng = np.random.default_rng(0)
    table = {
        "x": rng.standard_normal((rows, 32), dtype=np.float32),
        "y": np.arange(rows, dtype=np.int64),
        "data": np.array([rng.bytes(payload) for _ in range(min(rows, 4096))], dtype=object),
    }
    table["data"] = table["data"][np.arange(rows) % len(table["data"])]
    options = hr.Options()
    options.memory_budget = args.budget

    scratch.mkdir()
    local = hr.Dataset.from_tensor_slices(table).batch(4096).save_tfrecords(
        str(scratch), num_shards=shards, batched=True, progress=False)
    total = sum(os.path.getsize(path) for path in local)
    urls = []
    for path in local:
        url = f"s3://bench/{scratch.name}/{Path(path).name}"
        with open(path, "rb") as file:
            objstore.put_atomic(url, file)
        urls.append(url)
    store = objstore._store("s3://bench")

    def raw() -> int:
        count = 0
        for url in urls:
            key = url.split("/", 3)[3]
            size = objstore.object_info(url).size
            for start in range(0, size, objstore.REMOTE_BUFFER_SIZE):
                count += len(obstore.get_range(
                    store, key, start=start,
                    end=min(size, start + objstore.REMOTE_BUFFER_SIZE)))
        return count

    def raw_without_head() -> int:
        count = 0
        for url in urls:
            key = url.split("/", 3)[3]
            block = objstore.REMOTE_BUFFER_SIZE
            first = obstore.get(store, key, options={"range": (0, block)})
            size = int(first.meta["size"])
            count += len(first.bytes())
            for start in range(block, size, block):
                count += len(obstore.get_range(store, key, start=start,
                                               end=min(size, start + block)))
        return count

    def records(names: list[str]) -> Callable[[], int]:
        def go() -> int:
            ds = hr.TFRecordDataset(names).batch(1024).with_options(options)
            return sum(len(batch) for batch in ds)
        return go

    def interleaved(names: list[str]) -> Callable[[], int]:
        def go() -> int:
            ds = hr.Dataset.from_tensor_slices(names).interleave(
                hr.TFRecordDataset, cycle_length=4, block_length=16)
            return sum(len(batch) for batch in ds.batch(1024).with_options(options))
        return go

    def one_by_one(line: Callable[[], int]) -> Callable[[], int]:
        successor = objstore.Successor

        def go() -> int:
            # no Successor: each object opened with a HEAD, then its first range
            # read when the reader asks for it, nothing read ahead (as before)
            objstore.Successor = lambda *args, **kwargs: None  # type: ignore[assignment,misc]
            try:
                return line()
            finally:
                objstore.Successor = successor  # type: ignore[misc]
        return go

    def parsed(names: list[str]) -> Callable[[], int]:
        def go() -> int:
            ds = hr.TFRecordDataset(names).batch(1024).parse_examples(spec)
            return sum(len(batch["y"]) for batch in ds.with_options(options))
        return go

    lines: dict[str, Callable[[], int]] = {
        "raw client (obstore get_range)": raw,
        "raw client, no HEAD": raw_without_head,
        "headrace s3 records": records(urls),
        "  before: HEAD + GET, none read ahead": one_by_one(records(urls)),
        "headrace s3 interleave(4) records": interleaved(urls),
        "  before: HEAD + GET per slot's open": one_by_one(interleaved(urls)),
        "headrace s3 read+parse": parsed(urls),
        "headrace local read+parse": parsed(local),
    }
    if args.compare_clients:
        lines.update(_other_clients(endpoint, urls))
    best: dict[str, float] = {name: float("inf") for name in lines}
    memory: dict[str, int] = {name: 0 for name in lines}
    for go in lines.values():  # warm-up: imports, connections, page cache
        go()
    for _ in range(args.rounds):
        for name, go in lines.items():
            peak = _Peak()
            start = time.perf_counter()
            result = go()
            elapsed = time.perf_counter() - start
            memory[name] = max(memory[name], peak.stop())
            assert result in (total, rows), (name, result)  # every byte, or every row
            best[name] = min(best[name], elapsed)

    raw_rate = total / best["raw client (obstore get_range)"]
    headless_rate = total / best["raw client, no HEAD"]
    print()
    print(f"{total / 2**20:.1f} MiB in {shards} TFRecord shards of {total / shards / 2**20:.1f} "
          f"MiB, {rows} Examples; best of {args.rounds}; memory_budget={args.budget}; "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'line':36} {'MB/s':>8} {'vs raw':>7} {'vs no HEAD':>10} {'peak RSS growth':>16}")
    for name, seconds in best.items():
        rate = total / seconds
        print(f"{name:36} {rate / 1e6:8.1f} {rate / raw_rate:7.2f} {rate / headless_rate:10.2f} "
              f"{memory[name] / 2**20:13.1f} MiB")
    for url in urls:
        objstore.delete_object(url)


if __name__ == "__main__":
    main()

"""``headrace convert images.npy shards/ --feature image``: a 300 MB uint8 array of images to
TFRecord shards of raw-bytes Examples, against TensorFlow's idiomatic writer and a plain
copy of the same bytes (the disk's floor).

* copy: the ``.npy`` read in 16 MiB chunks and written to one file, fsynced;
* tf: ``tf.train.Example`` (``image``: ``bytes_list`` of the row's bytes, ``image_shape``:
  ``int64_list``) per row, ``SerializeToString`` and ``tf.io.TFRecordWriter``, 4 files;
* tf+fsync: the same, each file fsynced after it is written (durable on return);
* headrace: ``headrace._tools.convert.to_tfrecords(..., feature="image", num_shards=4)``,
  which also fsyncs, renames atomically and writes the ``.hrx`` indexes.

Each side runs in a fresh process, one after the other; the rate is the array's bytes
over the wall time of the write (imports excluded). Needs ~1 GB of free disk.

    python benchmarks/bench_convert_raw.py [--megabytes 300] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

SIDES = ("copy", "tf", "tf+fsync", "headrace")
ROW_SHAPE = (224, 224, 3)


def run_side(side: str, npy: str, out: str) -> float:
    """Seconds ``side`` takes to write ``npy`` under ``out``."""
    os.makedirs(out, exist_ok=True)
    if side == "headrace":
        from headrace._tools.convert import to_tfrecords

        started = time.perf_counter()
        to_tfrecords(npy, out, feature="image", num_shards=4, progress=False)
        return time.perf_counter() - started
    if side in ("tf", "tf+fsync"):
        import tensorflow as tf

        array = np.load(npy, mmap_mode="r")
        started = time.perf_counter()
        per_shard = -(-len(array) // 4)
        for shard in range(4):
            path = os.path.join(out, f"part-{shard}.tfrecord")
            with tf.io.TFRecordWriter(path) as writer:
                for row in array[shard * per_shard:(shard + 1) * per_shard]:
                    example = tf.train.Example(features=tf.train.Features(feature={
                        "image": tf.train.Feature(bytes_list=tf.train.BytesList(
                            value=[row.tobytes()])),
                        "image_shape": tf.train.Feature(int64_list=tf.train.Int64List(
                            value=list(row.shape))),
                    }))
                    writer.write(example.SerializeToString())
            if side == "tf+fsync":  # durable, as headrace's shards are when it returns
                with open(path, "rb") as written:
                    os.fsync(written.fileno())
        return time.perf_counter() - started
    started = time.perf_counter()
    with open(npy, "rb") as source, open(os.path.join(out, "copy"), "wb") as dest:
        while chunk := source.read(16 << 20):
            dest.write(chunk)
        dest.flush()
        os.fsync(dest.fileno())
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=300)
    parser.add_argument("--dir", default=None, help="where the data and shards go")
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--npy", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.side:  # a child: one side, one JSON line
        print(json.dumps({"seconds": run_side(args.side, args.npy, args.out)}))
        return 0
    folder = tempfile.mkdtemp(prefix="bench-convert-raw-", dir=args.dir)
    try:
        rows = max(1, args.megabytes * 1_000_000 // int(np.prod(ROW_SHAPE)))
        npy = os.path.join(folder, "images.npy")
        data = np.lib.format.open_memmap(npy, "w+", np.uint8, (rows, *ROW_SHAPE))
        rng = np.random.default_rng(0)
        for start in range(0, rows, 100):
            stop = min(rows, start + 100)
            data[start:stop] = rng.integers(0, 256, (stop - start, *ROW_SHAPE), dtype=np.uint8)
        data.flush()
        del data
        nbytes = rows * int(np.prod(ROW_SHAPE))
        rates = {}
        for side in SIDES:
            out = os.path.join(folder, side)
            done = subprocess.run(
                [sys.executable, __file__, "--side", side, "--npy", npy, "--out", out],
                capture_output=True, text=True, check=True)
            seconds = json.loads(done.stdout.strip().splitlines()[-1])["seconds"]
            rates[side] = nbytes / seconds / 1e6
            shutil.rmtree(out, ignore_errors=True)
        print(f"{rows} rows of {ROW_SHAPE} uint8 = {nbytes / 1e6:.0f} MB")
        print("| side | MB/s | headrace / side |")
        print("|---|---:|---:|")
        for side in SIDES:
            print(f"| {side} | {rates[side]:,.0f} | {rates['headrace'] / rates[side]:.2f} |")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

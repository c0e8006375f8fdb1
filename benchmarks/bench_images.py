"""The image pipeline end to end: headrace vs tf.data vs PyTorch's DataLoader.

Synthetic ImageNet-like data made here (``--images`` JPEGs of about 500x375,
quality 90, in 16 TFRecord shards of ``tf.train.Example``s with
``image/encoded`` and ``image/class/label``; ``--full`` makes 20,000), read
to 224x224 float32 batches of 128 with an Inception-style random resized crop
and a random flip, scaled to [0, 1]. Each side runs in its own fresh process,
one after the other, for ``--epochs`` epochs:

* **headrace**: list_files -> interleave(TFRecordDataset) -> enumerate ->
  map(parse + ``headrace.image.InceptionCrop``: crop box from the JPEG header, only
  the window decoded, resize + flip + [0, 1] in the same C pass; 2 worker processes,
  or 3 threads since that C call releases the GIL)
  -> batch(128) -> prefetch(AUTOTUNE), budget 256 MiB.
* **tf.data**: TFRecordDataset(num_parallel_reads=AUTOTUNE) -> map(parse +
  extract_jpeg_shape + sample_distorted_bounding_box + decode_and_crop_jpeg +
  resize + flip, AUTOTUNE) -> batch(128) -> prefetch(AUTOTUNE): TensorFlow's
  own fastest form of this pipeline (its official ResNet preprocessing).
* **torch**: DataLoader(2 workers) over an IterableDataset reading the same
  TFRecords (the ``tfrecord`` package, files split between the workers) with
  Pillow transforms (torchvision's RandomResizedCrop and flip, written with
  Pillow: torchvision is not installed) and default collation.

Reported: images/s (the first batch, i.e. start-up, outside the clock), the
CPU-seconds per image of the whole process tree (the machine is shared: CPU
time is what load does not inflate), and the peak of the tree's Pss_Anon +
Pss_Shmem (worker processes included, shared pages once). The peak comes from a
second run of the side, sampled from another process: sampling smaps stalls the
sampled process's page faults, so the timed run is not sampled.

    PYTHONPATH=src python benchmarks/bench_images.py [--images 2000] [--full] [--epochs 2]

writes benchmarks/results/images.md and images.json (``--out NAME``: NAME.md and
NAME.json, so that a run of a few sides, or a longer one, keeps the full run's).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

MIB = 1 << 20
SIZE = 224
BATCH = 128
SHARDS = 16
SEED = 2024
BUDGET = "256MiB"


# -- data -------------------------------------------------------------------------------


def make_shards(directory: Path, images: int) -> list[str]:
    """``images`` synthetic JPEGs in 16 TFRecord shards of Examples (made once per size)."""
    from bench_decoders import synthetic_jpegs
    from headrace.io.example import serialize_example
    from headrace.io.tfrecord import write_tfrecord

    directory.mkdir(parents=True, exist_ok=True)
    paths = [str(directory / f"train-{i:05d}-of-{SHARDS:05d}.tfrecord") for i in range(SHARDS)]
    if all(os.path.exists(p) for p in paths):
        return paths
    import numpy as np

    per_shard = math.ceil(images / SHARDS)
    made = 0
    for index, path in enumerate(paths):
        count = min(per_shard, images - made)
        jpegs = synthetic_jpegs(count, seed=index)
        records = [
            serialize_example({"image/encoded": data,
                               "image/class/label": np.int64((made + i) % 1000)})
            for i, data in enumerate(jpegs)
        ]
        write_tfrecord(path, records)
        made += count
    return paths


# -- measurements of the process tree: bench_workers' (Pss of the tree, CPU of the tree)

from bench_workers import PeakSampler, tree_cpu  # noqa: E402

# -- the three sides --------------------------------------------------------------------


_CROPS: dict[bool, Any] = {}


def _crop(antialias: bool = True) -> Any:
    import headrace.image as hi

    if antialias not in _CROPS:
        _CROPS[antialias] = hi.InceptionCrop((SIZE, SIZE), seed=SEED, antialias=antialias)
    return _CROPS[antialias]


def headrace_augment(index: int, record: bytes, antialias: bool = True) -> Any:
    """Parse one Example, then ``headrace.image.InceptionCrop``: crop box from the JPEG
    header, only the window decoded, resized, flipped and scaled to [0, 1] in one C pass
    (antialiased, as torchvision's RandomResizedCrop)."""
    import numpy as np

    from headrace.io.example import decode_example

    features = decode_example(record)
    image = _crop(antialias)(index, features["image/encoded"][1][0])
    return image, np.int64(features["image/class/label"][1][0])


def headrace_augment_plain(index: int, record: bytes) -> Any:
    """The same with plain bilinear (``antialias=False``): tf.image.resize of the crop,
    the very work of the tf.data side."""
    return headrace_augment(index, record, antialias=False)


def headrace_plain_tf_image(record: bytes) -> Any:
    """The pipeline as a tf.image user writes it: decode_jpeg -> random_crop ->
    random_flip_left_right -> convert_image_dtype (headrace's ops, int seeds)."""
    import numpy as np

    import headrace.image as hi
    from headrace.io.example import decode_example

    features = decode_example(record)
    image = hi.decode_jpeg(features["image/encoded"][1][0], channels=3)
    image = hi.random_crop(image, (SIZE, SIZE, 3), seed=SEED)
    image = hi.random_flip_left_right(image, seed=SEED)
    return hi.convert_image_dtype(image, np.float32), np.int64(features["image/class/label"][1][0])


def side_headrace_plain(files: list[str], epochs: int, workers: str = "threads",
                        calls: int | None = None) -> Any:
    import headrace as hr

    ds = (
        hr.Dataset.from_tensor_slices(files)
        .interleave(lambda path: hr.TFRecordDataset(path), cycle_length=4,
                    num_parallel_calls=2)
        .repeat(epochs)
        .map(headrace_plain_tf_image, num_parallel_calls=calls or hr.AUTOTUNE,
             workers=workers)
        .batch(BATCH)
        .prefetch(hr.AUTOTUNE)
        .with_options(hr.Options(memory_budget=BUDGET))
    )
    return iter(ds), lambda batch: len(batch[1])


def side_tf_plain(files: list[str], epochs: int) -> Any:
    import tensorflow as tf

    features = {"image/encoded": tf.io.FixedLenFeature((), tf.string),
                "image/class/label": tf.io.FixedLenFeature((), tf.int64)}

    def augment(record: Any) -> Any:
        parsed = tf.io.parse_single_example(record, features)
        image = tf.io.decode_jpeg(parsed["image/encoded"], channels=3)
        image = tf.image.random_crop(image, (SIZE, SIZE, 3), seed=SEED)
        image = tf.image.random_flip_left_right(image, seed=SEED)
        return tf.image.convert_image_dtype(image, tf.float32), parsed["image/class/label"]

    ds = (
        tf.data.TFRecordDataset(files, num_parallel_reads=tf.data.AUTOTUNE)
        .repeat(epochs)
        .map(augment, num_parallel_calls=tf.data.AUTOTUNE)
        .batch(BATCH)
        .prefetch(tf.data.AUTOTUNE)
    )
    return iter(ds), lambda batch: int(batch[1].shape[0])


def headrace_augment_batch(indices: Any, records: Any) -> Any:
    """The same augmentation on a whole batch: the Examples parsed as columns, each image
    written by ``InceptionCrop.batch`` straight into the batch's array."""
    import numpy as np

    from headrace.io.example import FixedLenFeature, parse_example

    parsed = parse_example(list(records), {
        "image/encoded": FixedLenFeature((), "string"),
        "image/class/label": FixedLenFeature((), "int64"),
    })
    labels = np.asarray(parsed["image/class/label"], np.int64)
    return _crop().batch(indices, parsed["image/encoded"]), labels


def _indexed_records(files: list[str], epochs: int) -> Any:
    """(index, record) of the shards, 4 files interleaved: both headrace sides' input."""
    import headrace as hr

    return (
        hr.Dataset.from_tensor_slices(files)
        .interleave(lambda path: hr.TFRecordDataset(path), cycle_length=4,
                    num_parallel_calls=2)
        .repeat(epochs)
        .enumerate()
    )


def side_headrace_batched(files: list[str], epochs: int, calls: int = 2,
                          workers: str = "threads") -> Any:
    import headrace as hr

    ds = (
        _indexed_records(files, epochs)
        .batch(BATCH)
        .map(headrace_augment_batch, num_parallel_calls=calls, workers=workers)
        .prefetch(hr.AUTOTUNE)
        .with_options(hr.Options(memory_budget=BUDGET))
    )
    return iter(ds), lambda batch: len(batch[1])


def side_headrace(files: list[str], epochs: int, workers: str = "processes",
                  calls: int = 2, augment: Any = headrace_augment) -> Any:
    import headrace as hr

    ds = (
        _indexed_records(files, epochs)
        .map(augment, num_parallel_calls=calls, workers=workers)
        .batch(BATCH)
        .prefetch(hr.AUTOTUNE)
        .with_options(hr.Options(memory_budget=BUDGET))
    )
    return iter(ds), lambda batch: len(batch[1])


def side_tf(files: list[str], epochs: int, crop_decode: bool = True) -> Any:
    import tensorflow as tf

    features = {"image/encoded": tf.io.FixedLenFeature((), tf.string),
                "image/class/label": tf.io.FixedLenFeature((), tf.int64)}

    def augment(record: Any) -> Any:
        parsed = tf.io.parse_single_example(record, features)
        encoded = parsed["image/encoded"]
        shape = tf.io.extract_jpeg_shape(encoded)
        begin, size, _ = tf.image.sample_distorted_bounding_box(
            shape, tf.constant([0.0, 0.0, 1.0, 1.0], shape=[1, 1, 4]),
            min_object_covered=0.1, aspect_ratio_range=(3 / 4, 4 / 3), area_range=(0.08, 1.0),
            max_attempts=10, use_image_if_no_bounding_boxes=True)
        y, x, _ = tf.unstack(begin)
        h, w, _ = tf.unstack(size)
        if crop_decode:  # decode only the window (libjpeg skips rows and columns)
            image = tf.io.decode_and_crop_jpeg(encoded, tf.stack([y, x, h, w]), channels=3)
        else:  # the form: decode_jpeg, then crop
            image = tf.io.decode_jpeg(encoded, channels=3)[y : y + h, x : x + w]
        image = tf.image.resize(image, (SIZE, SIZE))
        image = tf.image.random_flip_left_right(image)
        return image / 255.0, parsed["image/class/label"]

    ds = (
        tf.data.TFRecordDataset(files, num_parallel_reads=tf.data.AUTOTUNE)
        .repeat(epochs)
        .map(augment, num_parallel_calls=tf.data.AUTOTUNE)
        .batch(BATCH)
        .prefetch(tf.data.AUTOTUNE)
    )
    return iter(ds), lambda batch: int(batch[1].shape[0])


class _TorchImages:
    """An IterableDataset over the TFRecords, the files split between the workers (its
    base class is added when torch is imported: the other sides never import torch)."""

    def __init__(self, files: list[str], epochs: int) -> None:
        self.files, self.epochs = files, epochs

    def __iter__(self) -> Any:
        import io

        import numpy as np
        import torch
        from PIL import Image
        from tfrecord.reader import tfrecord_loader

        info = torch.utils.data.get_worker_info()
        mine = self.files if info is None else self.files[info.id :: info.num_workers]
        rng = random.Random(SEED + (0 if info is None else info.id))
        for _ in range(self.epochs):
            for path in mine:
                for example in tfrecord_loader(path, None, {"image/encoded": "byte",
                                                            "image/class/label": "int"}):
                    image = Image.open(io.BytesIO(example["image/encoded"]))
                    image = image.convert("RGB")
                    y, x, h, w = _torch_box(image.height, image.width, rng)
                    image = image.resize((SIZE, SIZE), Image.BILINEAR, box=(x, y, x + w, y + h))
                    if rng.random() < 0.5:
                        image = image.transpose(Image.FLIP_LEFT_RIGHT)
                    array = np.asarray(image, np.float32) * np.float32(1 / 255)
                    yield torch.from_numpy(array).permute(2, 0, 1), int(
                        example["image/class/label"][0])


def _torch_box(height: int, width: int, rng: random.Random) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop.get_params."""
    area = height * width
    for _ in range(10):
        target = area * rng.uniform(0.08, 1.0)
        aspect = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, height - h), rng.randint(0, width - w), h, w
    return 0, 0, height, width


def side_torch(files: list[str], epochs: int) -> Any:
    import torch

    dataset_class = type("TorchImages", (_TorchImages, torch.utils.data.IterableDataset), {})
    loader = torch.utils.data.DataLoader(
        dataset_class(files, epochs), batch_size=BATCH, num_workers=2,
        multiprocessing_context="fork",
    )
    return iter(loader), lambda batch: len(batch[1])


SIDES = {
    "headrace (2 processes)": side_headrace,
    "headrace (3 threads)": lambda files, epochs: side_headrace(files, epochs, "threads", 3),
    "headrace (batch -> map on 2 threads)": side_headrace_batched,
    "headrace (batch -> map on 2 processes)": lambda files, epochs: side_headrace_batched(
        files, epochs, 2, "processes"),
    "headrace (3 threads; plain bilinear as tf.data)": lambda files, epochs: side_headrace(
        files, epochs, "threads", 3, headrace_augment_plain),
    "tf.data (decode_and_crop_jpeg)": side_tf,
    "tf.data (decode_jpeg + crop)": lambda files, epochs: side_tf(files, epochs, False),
    "torch DataLoader (2 workers)": side_torch,
    # the plain pipeline: decode_jpeg -> random_crop -> random_flip -> convert
    "plain tf.image: headrace (AUTOTUNE threads)": side_headrace_plain,
    "plain tf.image: headrace (2 processes)": lambda files, epochs: side_headrace_plain(
        files, epochs, "processes", 2),
    "plain tf.image: tf.data": side_tf_plain,
}
BASELINE = "tf.data (decode_jpeg + crop)"
PLAIN_BASELINE = "plain tf.image: tf.data"


def baseline_of(side: str) -> str:
    """The tf.data side a side is compared with: the same pipeline's."""
    return PLAIN_BASELINE if side.startswith("plain tf.image") else BASELINE


def child(cfg: dict[str, Any]) -> dict[str, Any]:
    global BUDGET
    BUDGET = cfg.get("budget", BUDGET)
    if cfg["side"].startswith("headrace"):  # one BLAS thread per worker: two workers fill two cores
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Speed and memory come from two runs of the side: the peak sampler reads every
    # process's smaps, which takes the kernel's lock on its memory map and stalls its
    # page faults (tf.data's large heap loses ~30% of its rate to it, headrace's
    # workers 10-20%), so a timed run has no sampler.
    sampler = PeakSampler() if cfg.get("measure") == "memory" else None
    if "calls" in cfg:  # a --scaling side: n processes or threads, for a fixed time
        side = side_headrace if cfg["pipeline"] == "inception" else side_headrace_plain
        iterator, count_of = side(cfg["files"], 1000, cfg["workers"], cfg["calls"])
    else:
        iterator, count_of = SIDES[cfg["side"]](cfg["files"], cfg["epochs"])
    first = next(iterator)  # start-up (imports, workers, first fill) outside the clock
    images = count_of(first)
    started, cpu0 = time.perf_counter(), tree_cpu()
    timed, limit = 0, cfg.get("seconds")
    for batch in iterator:
        timed += count_of(batch)
        if limit and time.perf_counter() - started >= limit:
            break
    seconds = time.perf_counter() - started
    cpu = tree_cpu() - cpu0
    shape = tuple(first[0].shape)
    if sampler is not None:
        peak = sampler.stop() + sampler.start  # the tree's peak itself, not its growth
        return {"images": images + timed, "peak_pss_mib": peak / MIB}
    return {"images": images + timed, "timed_images": timed, "seconds": seconds,
            "images_per_s": timed / seconds,
            # None where the tree's CPU is unknown: DataLoader workers exit with the last
            # epoch, before the tree is read, taking their CPU time with them
            "cpu_s_per_image": cpu / max(timed, 1) if cpu > 0 else None,
            "batch_shape": list(shape)}


def shards_for(directory: str | None, images: int) -> list[str]:
    """The benchmark's shards of ``images`` JPEGs (made once, kept between runs)."""
    where = Path(directory or Path(tempfile.gettempdir()) / f"headrace-bench-images-{images}")
    print(f"making {images} JPEGs in {SHARDS} shards under {where} ...", file=sys.stderr)
    return make_shards(where, images)


def measure_side(cfg: dict[str, Any], *, peak: bool, timeout: float = 3600) -> dict[str, Any]:
    """One side in fresh processes: a timed run, then (``peak``) a run for its peak memory."""
    from _harness import child_env, run_child

    result: dict[str, Any] = {}
    for measure in ("speed", "memory") if peak else ("speed",):
        print(f"  running {cfg['side']} ({measure}) ...", file=sys.stderr, flush=True)
        part = run_child([sys.executable, str(Path(__file__).resolve()), "--child",
                          json.dumps({**cfg, "measure": measure})], timeout=timeout,
                         env=child_env())
        if part.get("error"):
            print(part["error"], part.get("stderr_tail", ""), file=sys.stderr)
        result.update(part if measure == "speed" else
                      {key: part[key] for key in ("peak_pss_mib", "error") if key in part})
    return result


def main(argv: list[str] | None = None) -> int:
    from _harness import fmt_ratio, md_table, report_head, write_report

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--full", action="store_true", help="20,000 images (the issue's size)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="rounds of the three sides")
    parser.add_argument("--dir", default=None, help="where the shards go (kept between runs)")
    parser.add_argument("--sides", default=None,
                        help="comma-separated subset of the sides (default: all)")
    parser.add_argument("--budget", default=BUDGET,
                        help="the headrace sides' memory budget (default %(default)s)")
    parser.add_argument("--out", default="images",
                        help="results file name under benchmarks/results (default %(default)s)")
    parser.add_argument("--scaling", default=None, metavar="N,N,...",
                        help="instead of the sides: headrace's two pipelines on N worker "
                             "processes and N threads, each timed for --seconds")
    parser.add_argument("--seconds", type=float, default=8.0,
                        help="--scaling: seconds each side is timed for (default %(default)s)")
    parser.add_argument("--no-peak", action="store_true",
                        help="time each side only (no second run for its peak memory)")
    parser.add_argument("--child", default=None)
    args = parser.parse_args(argv)
    if args.child:
        cfg = json.loads(args.child)
        print("@@RESULT@@ " + json.dumps(child(cfg)), flush=True)
        return 0
    if args.scaling:
        return scaling(args)
    images = 20_000 if args.full else args.images
    started = time.perf_counter()
    files = shards_for(args.dir, images)
    shard_bytes = sum(os.path.getsize(p) for p in files)
    run_line = (f"`PYTHONPATH=src python benchmarks/bench_images.py --images {images} "
                f"--epochs {args.epochs} --repeats {args.repeats} --budget {args.budget}"
                + (f" --sides '{args.sides}'" if args.sides else "")
                + (f" --out {args.out}" if args.out != "images" else "") + "`")
    info, sections = report_head("Image pipeline: headrace vs tf.data vs PyTorch", sys.executable,
                                 run_line)
    chosen = [side for side in SIDES if args.sides is None or side in args.sides.split(",")]
    results: dict[str, list[dict[str, Any]]] = {side: [] for side in chosen}
    for _ in range(args.repeats):
        for side in chosen:
            results[side].append(measure_side(
                {"side": side, "files": files, "epochs": args.epochs, "budget": args.budget},
                peak=not args.no_peak))

    def best(side: str, key: str) -> float | None:
        values = [r[key] for r in results.get(side, []) if r.get(key) is not None]
        if not values:
            return None
        values.sort()
        return values[len(values) // 2]

    rows = []
    for side in chosen:
        rate, cpu, peak = (best(side, "images_per_s"), best(side, "cpu_s_per_image"),
                           best(side, "peak_pss_mib"))
        base = baseline_of(side)
        base_cpu = best(base, "cpu_s_per_image")
        rows.append([side, f"{rate:.0f}" if rate else "error",
                     f"{cpu * 1e3:.2f}" if cpu else "", f"{peak:.0f}" if peak else "",
                     fmt_ratio(rate, best(base, "images_per_s")),
                     # CPU per image, the baseline's over the side's: images/s per core
                     fmt_ratio(base_cpu, cpu) if cpu else "",
                     fmt_ratio(peak, best(base, "peak_pss_mib"))])
    sections += [
        "## Results",
        "",
        f"{images} JPEGs ({shard_bytes / images / 1024:.0f} KB on average, {SHARDS} shards), "
        f"{args.epochs} epochs, batches of {BATCH} x {SIZE}x{SIZE}x3 float32; medians of "
        f"{args.repeats} round(s).",
        "",
        md_table(["side", "images/s", "CPU ms / image (tree)", "peak Pss anon+shmem MiB (tree)",
                  "images/s vs tf.data", "images per CPU-s vs tf.data", "peak vs tf.data"],
                 rows),
        "",
        f"Ratios against {BASELINE} (the Inception-crop sides), and against "
        f"{PLAIN_BASELINE} (the plain tf.image sides: decode_jpeg -> random_crop -> "
        f"random_flip_left_right -> convert_image_dtype). On a loaded machine wall-clock "
        f"rates follow the other jobs; images per CPU-second (the tree's) much less. "
        f"Targets (issue 24): >= 1x tf.data's images/s for the plain pipeline, >= 1.5x "
        f"tf.data (decode_and_crop_jpeg) for the fused crop path, <= 0.5x its peak memory, "
        f"budget {args.budget} held.",
        "",
    ]
    report = {"machine": info, "images": images, "epochs": args.epochs, "results": results}
    write_report(args.out, sections, report, started)
    return 0


def scaling(args: argparse.Namespace) -> int:
    """How the rate grows with cores: headrace's Inception-crop pipeline and the plain
    tf.image one, on N worker processes and on N threads, for each N of ``--scaling``.
    N=1 is the one-core reference (the many-core target: >= 10x one core)."""
    from _harness import md_table, report_head, write_report

    counts = [int(n) for n in args.scaling.split(",")]
    started = time.perf_counter()
    files = shards_for(args.dir, args.images)
    info, sections = report_head(
        "Image pipeline: scaling with cores", sys.executable,
        f"`PYTHONPATH=src python benchmarks/bench_images.py --images {args.images} "
        f"--seconds {args.seconds:g} --scaling {args.scaling} --budget {args.budget}"
        + (" --no-peak" if args.no_peak else "") + f" --out {args.out}`")
    rows, results = [], []
    for pipeline in ("inception", "plain"):
        for workers in ("processes", "threads"):
            one = None
            for n in counts:
                part = measure_side(
                    {"side": f"headrace {pipeline} ({n} {workers})", "pipeline": pipeline,
                     "workers": workers, "calls": n, "files": files, "seconds": args.seconds,
                     "budget": args.budget}, peak=not args.no_peak, timeout=900)
                part.update(pipeline=pipeline, workers=workers, calls=n)
                results.append(part)
                print(f"    {part.get('images_per_s', 0):.0f} images/s, "
                      f"{(part.get('cpu_s_per_image') or 0) * 1e3:.2f} CPU ms/image",
                      file=sys.stderr, flush=True)
                rate = part.get("images_per_s")
                if n == counts[0]:
                    one = rate
                cpu, peak = part.get("cpu_s_per_image"), part.get("peak_pss_mib")
                rows.append([pipeline, workers, n, f"{rate:.0f}" if rate else "error",
                             f"{rate / one:.2f}x" if rate and one else "",
                             f"{cpu * 1e3:.2f}" if cpu else "", f"{peak:.0f}" if peak else ""])
    sections += [
        "## Results", "",
        f"{args.images} JPEGs in {SHARDS} shards, repeated; each side timed for "
        f"{args.seconds:g} s after its first batch; "
        f"batches of {BATCH} x {SIZE}x{SIZE}x3 float32; budget {args.budget}. "
        "`inception`: parse + `InceptionCrop` (the fused crop, windowed decode); `plain`: "
        "decode_jpeg -> random_crop -> random_flip_left_right -> convert_image_dtype. "
        f"The speed-up is against N={counts[0]} of the same row group.", "",
        md_table(["pipeline", "workers", "N", "images/s", f"vs N={counts[0]}",
                  "CPU ms / image (tree)", "peak Pss anon+shmem MiB (tree)"], rows), "",
    ]
    write_report(args.out, sections, {"machine": info, "images": args.images,
                                      "results": results}, started)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

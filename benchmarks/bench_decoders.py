"""Which JPEG decoder for ``headrace.image``: full-size and DCT-scaled decodes side by side.

Synthetic ImageNet-like JPEGs (about 500x375, quality 90, ~100-130 KB: smooth
shapes plus sensor-like noise), decoded by Pillow, simplejpeg, PyTurboJPEG,
OpenCV and TensorFlow in one process, interleaved repeats, medians. Two cases:
the full image (what ``decode_jpeg`` needs) and a reduced decode at least
224 pixels on the short side... the random-resized-crop fast path (1/2 scale
here: 250x188 would be below 224, so the scale is the largest of 1/8..1/1 that
keeps the crop >= 224, which for a whole 500x375 image is 1/1 — we report the
1/2 scale as the typical crop case: a crop of half the area decoded for 224).

    PYTHONPATH=src python benchmarks/bench_decoders.py [--count 200] [--repeats 5]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).parent / "results"


def synthetic_jpegs(count: int, seed: int = 0, quality: int = 90) -> list[bytes]:
    """ImageNet-like JPEGs: smooth colour fields, a few shapes, noise; ~500x375."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        height = int(rng.integers(333, 417))
        width = int(rng.integers(450, 550))
        if rng.random() < 0.3:
            height, width = width, height
        y, x = np.mgrid[0:height, 0:width].astype(np.float32)
        image = np.empty((height, width, 3), np.float32)
        for c in range(3):
            fx, fy, phase = [*rng.uniform(0.005, 0.05, 2).tolist(), rng.uniform(0, 6.3)]
            image[..., c] = 128 + 80 * np.sin(x * fx + phase) * np.cos(y * fy)
        for _ in range(6):
            cy, cx, r = rng.integers(0, height), rng.integers(0, width), rng.integers(10, 120)
            mask = (y - cy) ** 2 + (x - cx) ** 2 < r * r
            image[mask] = rng.uniform(0, 255, 3)
        image += rng.normal(0, 20, image.shape)
        pixels = np.clip(image, 0, 255).astype(np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, "JPEG", quality=quality)
        out.append(buffer.getvalue())
    return out


def decoders(scale: int) -> dict[str, Callable[[bytes], np.ndarray]]:
    """Each decoder at 1/``scale`` of the full size (DCT scaling where it has it)."""
    found: dict[str, Callable[[bytes], np.ndarray]] = {}
    try:
        from PIL import Image

        def pillow(data: bytes) -> np.ndarray:
            image = Image.open(io.BytesIO(data))
            if scale > 1:
                image.draft("RGB", (image.width // scale, image.height // scale))
            return np.asarray(image.convert("RGB"))

        found["pillow"] = pillow
    except ImportError:
        pass
    try:
        import simplejpeg

        def simple(data: bytes) -> np.ndarray:
            if scale == 1:
                return simplejpeg.decode_jpeg(data, fastdct=True, fastupsample=False)
            height, width, _, _ = simplejpeg.decode_jpeg_header(data)
            return simplejpeg.decode_jpeg(
                data, fastdct=True, fastupsample=False,
                min_height=height // scale, min_width=width // scale,
            )

        found["simplejpeg"] = simple
    except ImportError:
        pass
    try:
        from turbojpeg import TJPF_RGB, TurboJPEG

        try:
            turbo = TurboJPEG()
        except RuntimeError:  # Debian ships only the versioned name
            turbo = TurboJPEG("/usr/lib/x86_64-linux-gnu/libturbojpeg.so.0")

        def pyturbojpeg(data: bytes) -> np.ndarray:
            return turbo.decode(data, pixel_format=TJPF_RGB,
                                scaling_factor=None if scale == 1 else (1, scale))

        pyturbojpeg(synthetic_jpegs(1)[0])
        found["pyturbojpeg"] = pyturbojpeg
    except Exception:
        pass
    try:
        import cv2

        cv2.setNumThreads(1)
        flag = {1: cv2.IMREAD_COLOR, 2: cv2.IMREAD_REDUCED_COLOR_2,
                4: cv2.IMREAD_REDUCED_COLOR_4, 8: cv2.IMREAD_REDUCED_COLOR_8}[scale]

        def opencv(data: bytes) -> np.ndarray:
            bgr = cv2.imdecode(np.frombuffer(data, np.uint8), flag)
            return bgr[..., ::-1]

        found["opencv"] = opencv
    except ImportError:
        pass
    if scale == 1:
        try:
            os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
            import tensorflow as tf

            tf.config.threading.set_inter_op_parallelism_threads(1)
            tf.config.threading.set_intra_op_parallelism_threads(1)

            def tensorflow(data: bytes) -> np.ndarray:
                return tf.io.decode_jpeg(data, channels=3).numpy()

            found["tensorflow"] = tensorflow
        except ImportError:
            pass
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    jpegs = synthetic_jpegs(args.count)
    rows = []
    reference = decoders(1).get("tensorflow")
    for scale in (1, 2, 4):
        found = decoders(scale)
        times: dict[str, list[float]] = {name: [] for name in found}
        for _ in range(args.repeats):  # interleaved: the load on a shared box hits all alike
            for name, decode in found.items():
                start = time.process_time()
                for data in jpegs:
                    decode(data)
                times[name].append(time.process_time() - start)
        for name, spent in times.items():
            seconds = statistics.median(spent)
            diff = None
            if scale == 1 and reference is not None and name != "tensorflow":
                diff = max(
                    int(np.abs(found[name](d).astype(int) - reference(d).astype(int)).max())
                    for d in jpegs[:20]
                )
            rows.append({"decoder": name, "scale": f"1/{scale}",
                         "images_per_cpu_s": round(args.count / seconds),
                         "max_abs_diff_vs_tf": diff})
    sizes = [len(d) for d in jpegs]
    meta = {"machine": f"{platform.node()} {os.cpu_count()} CPUs (shared, loaded)",
            "jpegs": args.count, "mean_kb": round(statistics.mean(sizes) / 1024, 1),
            "load": os.getloadavg()[0], "repeats": args.repeats}
    lines = ["# JPEG decoders (one thread each, CPU-seconds; median of interleaved repeats)", "",
             f"{meta}", "", "| decoder | scale | images / CPU-s | max abs diff vs tf (full size) |",
             "|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['decoder']} | {row['scale']} | {row['images_per_cpu_s']} | "
                     f"{'' if row['max_abs_diff_vs_tf'] is None else row['max_abs_diff_vs_tf']} |")
    lines += ["", "Reproduce: `PYTHONPATH=src python benchmarks/bench_decoders.py "
              f"--count {args.count} --repeats {args.repeats}`"]
    print("\n".join(lines))
    (RESULTS / "decoders.md").write_text("\n".join(lines) + "\n")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "decoders.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

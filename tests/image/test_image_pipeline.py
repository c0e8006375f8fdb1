"""headrace.image in pipelines: stateless augmentation (G3, G4), errors naming the record
(G5), decoded images booked before they exist (G1), and the random ops' own rules."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path
from typing import Any

import image_fns
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from image_fns import encode, jpeg, photo

import headrace as hr
import headrace.image as hi
from headrace.testing import assert_checkpoint_roundtrip, assert_elements_equal

MiB = 1 << 20
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def jpeg_dataset(count: int, height: int = 60, width: int = 80) -> hr.Dataset:
    records = np.empty(count, object)
    records[:] = [jpeg(height + i % 7, width + 3 * (i % 5), seed=i) for i in range(count)]
    return hr.Dataset.from_tensor_slices(records)


# --------------------------------------------------------------------------- random ops


@SETTINGS
@given(a=st.integers(0, 2**63), b=st.integers(0, 2**63), height=st.integers(1, 40),
       width=st.integers(1, 40))
def test_stateless_ops_depend_only_on_the_seed_pair(a: int, b: int, height: int, width: int) -> None:
    image = photo(height, width)
    for op in (
        lambda s: hi.random_flip_left_right(image, s),
        lambda s: hi.random_flip_up_down(image, s),
        lambda s: hi.random_crop(image, (max(1, height // 2), max(1, width // 2), 3), s),
        lambda s: hi.random_brightness(image, 0.3, s),
        lambda s: hi.random_contrast(image, 0.5, 1.5, s),
        lambda s: hi.random_resized_crop(image, (8, 8), seed=s),
    ):
        assert np.array_equal(op((a, b)), op((a, b)))
    stateless = hi.stateless_random_crop(image, (1, 1, 3), (a, b))
    assert np.array_equal(stateless, hi.random_crop(image, (1, 1, 3), (a, b)))


def test_flips_are_fair_and_ops_of_one_seed_are_independent() -> None:
    image = photo(4, 5)
    flips = [not np.array_equal(hi.random_flip_left_right(image, (7, i)), image)
             for i in range(2000)]
    assert 0.45 < np.mean(flips) < 0.55
    ups = [not np.array_equal(hi.random_flip_up_down(image, (7, i)), image) for i in range(2000)]
    assert 0.4 < np.corrcoef(flips, ups)[0, 1] + 0.5 < 0.6  # uncorrelated streams
    batch = hi.random_flip_left_right(np.stack([image] * 64), (1, 2))
    flipped = [not np.array_equal(one, image) for one in batch]
    assert 10 < sum(flipped) < 54  # each image of a batch decides alone


def test_seeds_are_checked() -> None:
    with pytest.raises(hr.InvalidArgumentError, match="pair of ints"):
        hi.random_flip_left_right(photo(2, 2), seed=(1, 2, 3))
    with pytest.raises(hr.InvalidArgumentError, match="pair of ints"):
        hi.stateless_random_flip_left_right(photo(2, 2), seed=None)
    with pytest.raises(hr.InvalidArgumentError, match=r"value\.shape >= size"):
        hi.random_crop(photo(2, 2), (3, 2, 3))


@SETTINGS
@given(height=st.integers(1, 500), width=st.integers(1, 500),
       low_area=st.floats(0.05, 1.0), covered=st.floats(0.0, 1.0),
       low_ratio=st.floats(0.3, 3.0), seed=st.integers(0, 2**32))
def test_sample_distorted_bounding_box_follows_its_constraints(
    height: int, width: int, low_area: float, covered: float, low_ratio: float, seed: int
) -> None:
    objects = np.array([[[0.1, 0.2, 0.7, 0.9]]], np.float32)
    begin, size, boxes = hi.sample_distorted_bounding_box(
        [height, width, 3], objects, seed=(seed, 1), min_object_covered=covered,
        aspect_ratio_range=(low_ratio, low_ratio * 1.5), area_range=(low_area, 1.0),
    )
    y, x, _ = begin.tolist()
    h, w, channels = size.tolist()
    assert channels == -1 and y >= 0 and x >= 0 and y + h <= height and x + w <= width
    assert np.allclose(boxes, [[[y / height, x / width, (y + h) / height, (x + w) / width]]])
    if (h, w) != (height, width):  # a sampled box (the whole image is the fallback)
        assert low_area * height * width <= h * w
        oy0, ox0, oy1, ox1 = objects[0, 0] * [height, width, height, width]
        inter = max(0.0, min(y + h, oy1) - max(y, oy0)) * max(0.0, min(x + w, ox1) - max(x, ox0))
        assert inter / ((oy1 - oy0) * (ox1 - ox0)) >= covered - 1e-6


@SETTINGS
@given(height=st.integers(1, 900), width=st.integers(1, 900), seed=st.integers(0, 2**32))
def test_random_resized_crop_box_lies_inside_with_area_and_ratio_in_range(
    height: int, width: int, seed: int
) -> None:
    y, x, h, w = hi.random_resized_crop_box(height, width, (0.08, 1.0), (3 / 4, 4 / 3), (seed, 0))
    assert y >= 0 and x >= 0 and h > 0 and w > 0 and y + h <= height and x + w <= width


def test_random_resized_crop_from_jpeg_bytes_decodes_small_and_keeps_the_box() -> None:
    y, x = np.mgrid[0:600, 0:800].astype(np.float32)
    smooth = np.stack([128 + 100 * np.sin(x / 37 + c) * np.cos(y / 53) for c in range(3)], -1)
    data = encode(smooth.astype(np.uint8), "JPEG", quality=90)
    for index in range(20):
        seed = (5, index)
        fast = hi.random_resized_crop(data, (48, 48), seed=seed)
        full = hi.random_resized_crop(data, (48, 48), seed=seed, reduced_decode=False)
        decoded = hi.random_resized_crop(hi.decode_jpeg(data), (48, 48), seed=seed)
        assert fast.shape == full.shape == (48, 48, 3) and fast.dtype == np.float32
        assert np.array_equal(full, decoded)  # bytes and pixels: the same box
        y0, x0, h, w = hi.random_resized_crop_box(600, 800, seed=seed)
        exact = hi.resize(hi.decode_jpeg(data)[y0 : y0 + h, x0 : x0 + w], (48, 48),
                          antialias=True)
        # Pillow's resampler, rounded to uint8; on the border it also weighs the pixels
        # just outside the box (the crop-then-resize sees none)
        assert np.abs(full - exact)[1:-1, 1:-1].max() <= 1
        assert np.abs(full - exact).max() <= 4
        plain = hi.random_resized_crop(data, (48, 48), seed=seed, antialias=False,
                                       reduced_decode=False)
        # tf.image.resize of the integer crop (the C path: float32 weights, NumPy's float64)
        np.testing.assert_allclose(
            plain, hi.resize(hi.decode_jpeg(data)[y0 : y0 + h, x0 : x0 + w], (48, 48)), atol=2e-3)
        # a reduced DCT: the same box, resampled at its sub-pixel place in the smaller image
        assert np.mean(np.abs(fast - exact)) < 1.5


# --------------------------------------------------------------------------- G3 / G4


@pytest.mark.parametrize(
    "parallel, workers", [(None, None), (1, "threads"), (2, "threads"), (1, "processes"),
                          (2, "processes")],
)
def test_augmentation_does_not_depend_on_the_workers(parallel: int | None, workers: str) -> None:
    base = jpeg_dataset(24).enumerate()
    reference = list(base.map(image_fns.augment))
    mapped = base.map(image_fns.augment, num_parallel_calls=parallel, workers=workers)
    actual = list(mapped)
    assert len(actual) == 24
    for index, (a, e) in enumerate(zip(actual, reference, strict=True)):
        assert_elements_equal(a, e, where=f"element {index}")
    assert not all(np.array_equal(actual[0], other) for other in actual[1:])


def test_augmented_pipeline_checkpoints_round_trip() -> None:
    ds = (
        jpeg_dataset(14)
        .enumerate()
        .shuffle(6, seed=3)
        .map(image_fns.augment, num_parallel_calls=2)
        .batch(4)
    )
    assert_checkpoint_roundtrip(ds, max_checkpoints=6)


# --------------------------------------------------------------------------- G5 errors


def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def bomb_png(side: int = 60_000) -> bytes:
    """A valid PNG header declaring side x side pixels, with one small IDAT."""
    header = png_chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0))
    return b"\x89PNG\r\n\x1a\n" + header + png_chunk(b"IDAT", zlib.compress(b"\0" * 100)) + \
        png_chunk(b"IEND", b"")


def lying_jpeg() -> bytes:
    """A JPEG whose frame header claims twice its real height."""
    data = bytearray(jpeg(40, 50))
    sof = data.index(b"\xff\xc0")
    struct.pack_into(">H", data, sof + 5, 80)
    return bytes(data)


BAD = {
    "truncated": (jpeg(64, 64, seed=9)[:700], r"invalid or truncated JPEG"),
    "bomb": (bomb_png(), r"60000x60000 = 3,600,000,000 pixels, more than max_pixels"),
    "lying": (lying_jpeg(), r"invalid or truncated JPEG .*header 80x50"),
    "not an image": (b"hello world", r"unknown image format"),
    "no frame header": (b"\xff\xd8\xff\xe0\x00\x04ab\xff\xda", r"no frame header"),
}


@pytest.mark.parametrize("workers", [None, "threads", "processes"])
def test_bad_images_raise_in_their_place_naming_the_element_and_nothing_is_lost(
    workers: str | None,
) -> None:
    good = [jpeg(20, 30, seed=i) for i in range(len(BAD) + 1)]
    records: list[bytes] = []
    for position, (data, _) in enumerate(BAD.values()):
        records += [good[position], data]
    records.append(good[-1])
    array = np.empty(len(records), object)
    array[:] = records
    ds = hr.Dataset.from_tensor_slices(array).map(
        image_fns.decode_rgb, num_parallel_calls=2 if workers else None, workers=workers,
        output_nbytes=image_fns.rgb_nbytes,
    )
    outputs, errors = image_fns.drain(ds)
    assert [o.shape for o in outputs] == [(20, 30, 3)] * len(good)
    for output, data in zip(outputs, good, strict=True):
        assert np.array_equal(output, hi.decode_jpeg(data))
    assert len(errors) == len(BAD)
    for number, (error, (name, (_, pattern))) in enumerate(zip(errors, BAD.items(), strict=True)):
        assert isinstance(error, ValueError), name
        assert __import__("re").search(pattern, str(error)), (name, str(error))
        notes = getattr(error, "__notes__", [])
        assert any(f"on element {2 * number + 1}" in note for note in notes), (name, notes)


def test_max_pixels_refuses_from_the_header_before_decoding() -> None:
    data = encode(photo(300, 400), "PNG")
    assert hi.decoded_nbytes(data) == 300 * 400 * 3
    with pytest.raises(hi.InvalidImageError, match="300x400 = 120,000 pixels, more than max_pixels=100,000"):
        hi.decode_png(data, max_pixels=100_000)
    with pytest.raises(hi.InvalidImageError, match="max_pixels"):
        hi.random_resized_crop(jpeg(300, 400), (8, 8), seed=(1, 1), max_pixels=1000)
    assert hi.decode_image(data, max_pixels=None).shape == (300, 400, 3)
    assert hi.decoded_nbytes(b"not an image") == 0
    assert hi.decoded_nbytes(bomb_png()) == 0  # refused by the decoder: nothing to book


# --------------------------------------------------------------------------- G1 booking


def test_a_parallel_decode_is_booked_at_its_decoded_size_before_it_runs() -> None:
    held: list[tuple[int, int]] = []  # (budget used while decoding, decoded bytes)
    running: dict[str, Any] = {}

    def decode(data: bytes) -> np.ndarray:
        held.append((running["iterator"].context.budget.used, hi.decoded_nbytes(data)))
        return hi.decode_jpeg(data)

    for hint in (image_fns.rgb_nbytes, None):
        held.clear()
        ds = jpeg_dataset(8, 200, 300).map(decode, num_parallel_calls=1,
                                           output_nbytes=hint)
        with iter(ds.with_options(hr.Options(memory_budget="64MiB"))) as iterator:
            running["iterator"] = iterator
            list(iterator)
        if hint is not None:
            assert all(used >= nbytes for used, nbytes in held), held
        else:  # the first call is booked at its input's size only: what the hint fixes
            assert held[0][0] < held[0][1]


@pytest.mark.parametrize("workers, budget_mib", [("threads", 24), ("processes", 24)])
def test_shuffle_of_decoded_images_and_deep_prefetch_hold_the_budget(
    workers: str, budget_mib: int
) -> None:
    """In a fresh process: 80 decoded images of ~1.4 MiB (112 MiB in all) through a
    shuffle of 1000 and a prefetch of 1000 on a 24 MiB budget, decoded on 2 threads or
    2 worker processes: booked bytes never past the budget, and the measured growth of
    the process tree's Pss_Anon + Pss_Shmem within budget + 10% + 64 MiB — plus, with
    processes, the workers' own interpreters (numpy, Pillow, simplejpeg imported: about
    25 MiB each), which no booking covers (see headrace._transforms.process_map)."""
    script = textwrap.dedent(
        """
        import json, threading, time, warnings, os
        import numpy as np
        import headrace as hr
        import headrace.image as hi
        import image_fns
        from headrace._workers.memory import tree_charged

        records = np.empty(80, object)
        records[:] = [image_fns.jpeg(600 + i % 5, 800, seed=i % 7) for i in range(80)]
        budget = BUDGET << 20
        ds = (
            hr.Dataset.from_tensor_slices(records)
            .map(image_fns.decode_rgb, num_parallel_calls=2, workers=WORKERS,
                 output_nbytes=image_fns.rgb_nbytes)
            .shuffle(1000, seed=1)
            .prefetch(1000)
            .with_options(hr.Options(memory_budget=budget, warn_on_shrink=False))
        )
        peak, done = [0], threading.Event()
        base = tree_charged(os.getpid())

        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], tree_charged(os.getpid()) - base)
                time.sleep(0.005)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        count = 0
        with iter(ds) as iterator:
            for image in iterator:
                assert image.shape[2] == 3
                count += 1
                time.sleep(0.002)
            booked = iterator.context.budget.peak
            total = iterator.context.budget.total
            interpreters = sum(w.uss for s in iterator.stats().workers for w in s.processes)
        done.set()
        sampler.join()
        print(json.dumps({"count": count, "peak": peak[0], "booked": booked, "total": total,
                          "bound": int(budget * 1.1) + (64 << 20) + interpreters}))
        """
    ).replace("BUDGET", str(budget_mib)).replace("WORKERS", repr(workers))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, timeout=240, cwd=str(Path(__file__).parent))
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["count"] == 80
    assert 0 < result["booked"] <= result["total"]
    assert result["peak"] <= result["bound"], result

"""headrace.image's padding, rotation and colour operations against tf.image itself, on
random images: uint8 and float32, single (H, W, C) and batched (N, H, W, C).

Tolerances: integer outputs are equal; float outputs within 4 float32 ulps of the
output's range (``resize_with_pad`` and ``adjust_gamma`` round in another order, and
``total_variation`` sums in another order: 1 or 2 ulps are seen); the rest are equal.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from typing import Any

import numpy as np
import pytest
import tensorflow as tf

import headrace as hr
import headrace.image as hi
import headrace.tf_compat as htf

pytestmark = pytest.mark.tf

CASES = [(dtype, batched, seed) for dtype in ("uint8", "float32") for batched in (False, True)
         for seed in range(3)]


def image_for(dtype: str, batched: bool, seed: int) -> Any:
    rng = np.random.default_rng(seed)
    height, width = int(rng.integers(1, 12)), int(rng.integers(1, 12))
    shape = (int(rng.integers(1, 4)), height, width, 3) if batched else (height, width, 3)
    if dtype == "uint8":
        image = rng.integers(0, 256, shape).astype(np.uint8)
        image[..., :2, :, 1] = image[..., :2, :, 0]  # ties between channels, and greys
        image[..., :1, :, 2] = image[..., :1, :, 0]
        return image
    image = rng.random(shape, dtype=np.float32)
    image[..., :1, :, 1] = image[..., :1, :, 0]
    return image


def same(ours: Any, theirs: Any) -> None:
    theirs = theirs.numpy()
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    if ours.dtype.kind in "uib":
        assert np.array_equal(ours, theirs)
    else:
        scale = np.float32(max(1.0, float(np.abs(theirs).max()) if theirs.size else 1.0))
        assert np.all(np.abs(ours - theirs) <= 4 * np.spacing(scale)), np.abs(ours - theirs).max()


@pytest.mark.parametrize(("dtype", "batched", "seed"), CASES)
def test_geometry_matches_tensorflow(dtype: str, batched: bool, seed: int) -> None:
    image = image_for(dtype, batched, seed)
    height, width = image.shape[-3], image.shape[-2]
    rng = np.random.default_rng(100 + seed)
    for _ in range(4):
        th, tw = int(rng.integers(1, 16)), int(rng.integers(1, 16))
        same(hi.resize_with_crop_or_pad(image, th, tw),
             tf.image.resize_with_crop_or_pad(image, th, tw))
        try:
            theirs = tf.image.resize_with_pad(image, th, tw)
        except tf.errors.InvalidArgumentError:  # a side that rounds down to 0 pixels
            with pytest.raises(hr.InvalidArgumentError, match="size must be two positive"):
                hi.resize_with_pad(image, th, tw)
        else:
            same(hi.resize_with_pad(image, th, tw), theirs)
        oh, ow = int(rng.integers(0, 4)), int(rng.integers(0, 4))
        same(hi.pad_to_bounding_box(image, oh, ow, height + oh + 1, width + ow),
             tf.image.pad_to_bounding_box(image, oh, ow, height + oh + 1, width + ow))
    for k in range(-1, 6):
        same(hi.rot90(image, k), tf.image.rot90(image, k))
    same(hi.transpose(image), tf.image.transpose(image))
    same(hi.flip_left_right(image), tf.image.flip_left_right(image))
    same(hi.flip_up_down(image), tf.image.flip_up_down(image))


@pytest.mark.parametrize(("dtype", "batched", "seed"), CASES)
def test_colour_matches_tensorflow(dtype: str, batched: bool, seed: int) -> None:
    image = image_for(dtype, batched, seed)
    rng = np.random.default_rng(200 + seed)
    for delta in [-1.0, -0.5, float(rng.uniform(-1, 1)), 0.0, float(rng.uniform(0, 0.5)), 1.0]:
        same(hi.adjust_hue(image, delta), tf.image.adjust_hue(image, delta))
    for factor in [0.0, float(rng.uniform(0, 1)), 1.0, float(rng.uniform(1, 4))]:
        same(hi.adjust_saturation(image, factor), tf.image.adjust_saturation(image, factor))
    for gamma, gain in [(1.0, 1.0), (0.5, 1.0), (float(rng.uniform(0, 3)), float(rng.uniform(0.5, 2)))]:
        same(hi.adjust_gamma(image, gamma, gain), tf.image.adjust_gamma(image, gamma, gain))
    gray = hi.rgb_to_grayscale(image)
    same(gray, tf.image.rgb_to_grayscale(image))
    same(hi.grayscale_to_rgb(gray), tf.image.grayscale_to_rgb(tf.constant(gray)))
    flt = hi.convert_image_dtype(image, np.float32)
    same(hi.rgb_to_hsv(flt), tf.image.rgb_to_hsv(flt))
    for ours, theirs in [(hi.rgb_to_yiq, tf.image.rgb_to_yiq), (hi.yiq_to_rgb, tf.image.yiq_to_rgb),
                         (hi.rgb_to_yuv, tf.image.rgb_to_yuv), (hi.yuv_to_rgb, tf.image.yuv_to_rgb)]:
        same(ours(flt), theirs(tf.constant(flt)))
    hsv = np.random.default_rng(seed).random(image.shape, dtype=np.float32)
    same(hi.hsv_to_rgb(hsv), tf.image.hsv_to_rgb(hsv))
    signed = image.astype(np.int32) if dtype == "uint8" else image
    same(hi.total_variation(signed), tf.image.total_variation(tf.constant(signed)))
    same(hi.adjust_brightness(image, 0.1), tf.image.adjust_brightness(image, 0.1))


def test_bad_arguments_are_refused_naming_them() -> None:
    image = np.zeros((4, 5, 3), np.uint8)
    with pytest.raises(hr.InvalidArgumentError, match=r"pad_to_bounding_box.*does not fit"):
        hi.pad_to_bounding_box(image, 1, 0, 4, 5)
    with pytest.raises(hr.InvalidArgumentError, match="pad_to_bounding_box: offsets"):
        hi.pad_to_bounding_box(image, -1, 0, 8, 8)
    with pytest.raises(hr.InvalidArgumentError, match="resize_with_crop_or_pad: target size"):
        hi.resize_with_crop_or_pad(image, 0, 3)
    with pytest.raises(hr.InvalidArgumentError, match="adjust_hue: the last dimension"):
        hi.adjust_hue(np.zeros((4, 5, 1), np.uint8), 0.1)
    with pytest.raises(hr.InvalidArgumentError, match="adjust_hue: delta"):
        hi.adjust_hue(image, 1.5)
    with pytest.raises(hr.InvalidArgumentError, match="rgb_to_hsv: expects a float"):
        hi.rgb_to_hsv(image)
    with pytest.raises(hr.InvalidArgumentError, match="rgb_to_yuv: expects a float"):
        hi.rgb_to_yuv(image)
    with pytest.raises(hr.InvalidArgumentError, match="grayscale_to_rgb"):
        hi.grayscale_to_rgb(image)
    with pytest.raises(hr.InvalidArgumentError, match="total_variation: expects float"):
        hi.total_variation(image)
    with pytest.raises(hr.InvalidArgumentError, match="adjust_gamma: gamma"):
        hi.adjust_gamma(image, -1)
    with pytest.raises(hr.InvalidArgumentError, match=r"random_hue: max_delta"):
        hi.random_hue(image, 0.6)
    with pytest.raises(hr.InvalidArgumentError, match="random_saturation: upper"):
        hi.random_saturation(image, 2, 1)
    with pytest.raises(hr.InvalidArgumentError, match="stateless_random_hue: seed"):
        hi.stateless_random_hue(image, 0.1, seed=3)


def test_random_forms_are_their_adjustment_with_a_seeded_factor() -> None:
    """random_hue / random_saturation (and the stateless forms) are deterministic for a
    seed, differ between seeds, and only change what their adjustment changes: hue
    keeps each pixel's smallest and largest channel, saturation keeps the largest."""
    image = np.random.default_rng(5).random((6, 7, 3), dtype=np.float32)
    for name, fn in [("hue", lambda s: hi.stateless_random_hue(image, 0.4, seed=s)),
                     ("saturation", lambda s: hi.stateless_random_saturation(image, 0.2, 3, seed=s))]:
        outputs = [fn((1, i)) for i in range(4)]
        assert np.array_equal(outputs[0], fn((1, 0))), name
        assert all(not np.array_equal(outputs[0], other) for other in outputs[1:]), name
        for out in outputs:
            np.testing.assert_allclose(out.max(-1), image.max(-1), rtol=1e-6)
            if name == "hue":
                np.testing.assert_allclose(out.min(-1), image.min(-1), rtol=1e-6)
    # in a pipeline, an int seed draws per element and again the same on a new pass
    dataset = hr.Dataset.from_tensors(image).repeat(3).map(
        lambda x: hi.random_hue(x, 0.5, seed=7))
    first, second = list(dataset), list(dataset)
    assert all(np.array_equal(a, b) for a, b in zip(first, second, strict=True))
    assert not np.array_equal(first[0], first[1])


def test_tf_compat_exposes_tf_images_names() -> None:
    """The audit against tf.image's public names: everything a tf.data pipeline reaches
    for is here; what is left are detection, encoding and metric ops."""
    public = {name for name in dir(tf.image) if not name.startswith("_")}
    missing = {name for name in public if name not in dir(htf.image)}
    assert missing == {
        "adjust_jpeg_quality", "combined_non_max_suppression", "crop_and_resize",
        "decode_jxl", "decode_webp", "draw_bounding_boxes", "encode_jpeg", "encode_png",
        "extract_glimpse", "extract_patches", "generate_bounding_box_proposals",
        "image_gradients", "non_max_suppression", "non_max_suppression_overlaps",
        "non_max_suppression_padded", "non_max_suppression_with_scores", "psnr",
        "random_jpeg_quality", "sobel_edges", "ssim", "ssim_multiscale",
        "stateless_random_jpeg_quality",
    }
    for name in dir(htf.image):
        assert getattr(htf.image, name) is getattr(hi, name)

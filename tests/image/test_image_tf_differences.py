"""The two image differences from TensorFlow that docs/differences.md lists, held to
what it says: ``decode_and_crop_jpeg`` is ``decode_jpeg`` then the crop at every
window (TensorFlow's op is not, at iMCU boundaries), and an out-of-range float to
integer conversion without ``saturate`` is NumPy's cast, where TensorFlow's depends
on the tensor's length; with ``saturate`` both agree."""

from __future__ import annotations

import io
import random
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

import headrace.image as hi


def _jpeg(rng: random.Random, height: int, width: int, subsampling: int) -> bytes:
    pixels = np.random.default_rng(rng.randrange(2**32)).integers(
        0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=90, subsampling=subsampling)
    return out.getvalue()


@pytest.mark.parametrize("seed", range(4))
def test_decode_and_crop_is_the_crop_of_the_whole_decode_at_every_window(seed: int) -> None:
    rng = random.Random(seed)
    data = _jpeg(rng, rng.randint(33, 90), rng.randint(33, 120), rng.choice([0, 1, 2]))
    whole = np.asarray(hi.decode_jpeg(data, channels=3))
    height, width = whole.shape[:2]
    # windows starting on iMCU boundaries (where TensorFlow's own op differs) and off them
    for x in sorted({0, 8, 16, 32, rng.randrange(width - 1)}):
        if x >= width - 1:
            continue
        y = rng.randrange(height - 1)
        h, w = rng.randint(1, height - y), rng.randint(1, width - x)
        crop = np.asarray(hi.decode_and_crop_jpeg(data, [y, x, h, w], channels=3))
        assert np.array_equal(crop, whole[y:y + h, x:x + w]), (seed, y, x, h, w)


@pytest.mark.parametrize("length", [1, 8, 16, 17, 64])
def test_an_out_of_range_float_to_integer_is_numpys_cast_and_saturate_is_tensorflows(
    length: int,
) -> None:
    image = np.ones(length, np.float16)  # 1.0 scales to 32768 in float16
    assert np.asarray(hi.convert_image_dtype(image, np.int16)).tolist() == [-32768] * length
    ours = np.asarray(hi.convert_image_dtype(image, np.int16, saturate=True))
    theirs = tf.image.convert_image_dtype(image, tf.int16, saturate=True).numpy()
    assert ours.tolist() == theirs.tolist() == [32752] * length


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_float_to_int64_saturates_below_two_to_the_63_where_tensorflow_overflows(
    dtype: Any,
) -> None:
    image = np.ones((4, 1, 1), dtype)
    top = int(np.nextafter(dtype(2.0**63), dtype(0)))  # the largest float below 2^63
    ours = np.asarray(hi.convert_image_dtype(image, np.int64, saturate=True))
    theirs = tf.image.convert_image_dtype(image, tf.int64, saturate=True).numpy()
    assert ours.reshape(-1).tolist() == [top] * 4
    assert theirs.reshape(-1).tolist() == [-(2**63)] * 4  # its clamp's top, overflowed

"""headrace.image against tf.image itself: decoded pixels, resize, dtype rules, crops.

Tolerances, stated once: JPEG pixels are *equal* (at a reduced ``ratio``, for images of at least 8 * ratio
pixels a side: both run libjpeg-turbo's fast
integer IDCT with fancy upsampling); PNG pixels equal, except luma from RGB
(channels=1) within 1 level (libpng's and Pillow's weights round differently);
resize within 5e-3 on 0-255 values (2e-5 of the range: float32 rounding of
the same weights summed in another order); convert_image_dtype, central_crop,
flips and brightness exactly; contrast within 1 level (the channel mean, summed in
float32 in another order, can tip a truncation); per_image_standardization within 1e-5.
"""

from __future__ import annotations

import io
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from image_fns import encode, jpeg, photo

import headrace.image as hi
import headrace.tf_compat as htf
from headrace.image._native import jpeg_module

SETTINGS = settings(max_examples=30, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
sizes = st.integers(1, 48)


@SETTINGS
@given(height=st.integers(1, 80), width=st.integers(1, 80), quality=st.integers(30, 100),
       subsampling=st.sampled_from([0, 1, 2]), grey=st.booleans(),
       channels=st.sampled_from([0, 1, 3]), ratio=st.sampled_from([1, 2, 4, 8]),
       seed=st.integers(0, 2**16))
def test_decode_jpeg_gives_tensorflows_pixels(
    height: int, width: int, quality: int, subsampling: int, grey: bool, channels: int,
    ratio: int, seed: int,
) -> None:
    image = photo(height, width, 1 if grey else 3, seed)
    data = encode(image, "JPEG", quality=quality, subsampling=subsampling)
    mine = hi.decode_jpeg(data, channels=channels, ratio=ratio)
    theirs = tf.io.decode_jpeg(data, channels=channels, ratio=ratio).numpy()
    assert mine.dtype == np.uint8
    assert mine.shape == theirs.shape
    if min(height, width) >= 8 * ratio or jpeg_module() is not None:
        assert np.array_equal(mine, theirs)
    # else (simplejpeg's path): libjpeg's 1/2..1/8 scales give the same tiny size, and
    # simplejpeg picks the smallest scale (documented): same shape, coarser DCT
    assert hi.decoded_nbytes(data, channels, ratio=ratio) == mine.nbytes
    assert list(hi.extract_jpeg_shape(data)) == [*list(tf.io.extract_jpeg_shape(data).numpy()[:2]), 1 if grey else 3]


@SETTINGS
@given(height=sizes, width=sizes, stored=st.sampled_from([1, 2, 3, 4]),
       channels=st.sampled_from([0, 1, 3, 4]), seed=st.integers(0, 2**16))
def test_decode_png_gives_tensorflows_pixels(
    height: int, width: int, stored: int, channels: int, seed: int
) -> None:
    data = encode(photo(height, width, stored, seed), "PNG")
    mine = hi.decode_png(data, channels=channels)
    theirs = tf.io.decode_png(data, channels=channels).numpy()
    assert mine.shape == theirs.shape and mine.dtype == theirs.dtype
    tolerance = 1 if channels == 1 and stored >= 3 else 0
    assert np.abs(mine.astype(int) - theirs).max() <= tolerance
    assert hi.decoded_nbytes(data, channels) == mine.nbytes
    again = hi.decode_image(data, channels or None, dtype=np.float32)
    assert np.allclose(again, tf.io.decode_image(data, channels or None, np.float32).numpy(),
                       atol=1 / 255 if tolerance else 0)


def test_decode_image_sniffs_every_format_and_gif_frames() -> None:
    from PIL import Image

    frames = [Image.fromarray(photo(12, 9, 3, seed)) for seed in range(3)]
    buffer = io.BytesIO()
    frames[0].save(buffer, "GIF", save_all=True, append_images=frames[1:])
    gif = buffer.getvalue()
    mine, theirs = hi.decode_image(gif), tf.io.decode_image(gif).numpy()
    assert mine.shape == theirs.shape == (3, 12, 9, 3)
    assert np.array_equal(mine, theirs)
    assert hi.decoded_nbytes(gif) == mine.nbytes
    assert hi.decode_image(gif, expand_animations=False).shape == (12, 9, 3)
    bmp = encode(photo(7, 5), "BMP")
    assert np.array_equal(hi.decode_image(bmp), tf.io.decode_image(bmp).numpy())
    data = jpeg(20, 30)
    assert np.array_equal(hi.decode_image(data), tf.io.decode_image(data).numpy())
    assert hi.is_jpeg(data) and not hi.is_jpeg(bmp)
    # tf.io.decode_jpeg decodes PNGs too (one op for all formats)
    png = encode(photo(6, 6), "PNG")
    assert np.array_equal(hi.decode_jpeg(png), tf.io.decode_jpeg(png).numpy())


@SETTINGS
@given(height=st.integers(8, 40), width=st.integers(8, 40), top=st.integers(0, 7),
       left=st.integers(0, 7), seed=st.integers(0, 100))
def test_decode_and_crop_jpeg_is_the_window_of_the_decoded_image(
    height: int, width: int, top: int, left: int, seed: int
) -> None:
    data = jpeg(height, width, seed)
    window = [top, left, height - top, width - left]
    mine = hi.decode_and_crop_jpeg(data, window, channels=3)
    full = tf.io.decode_jpeg(data, channels=3).numpy()
    assert np.array_equal(mine, full[top:, left:])
    # TensorFlow's own decode_and_crop upsamples chroma from the window's edge, so it
    # differs from its decode_jpeg at the window's border; inside, all agree.
    theirs = tf.image.decode_and_crop_jpeg(data, window, channels=3).numpy()
    assert mine.shape == theirs.shape
    assert np.array_equal(mine[2:-2, 2:-2], theirs[2:-2, 2:-2]) or np.mean(
        np.abs(mine.astype(int) - theirs)) < 8
    with pytest.raises(hi.InvalidImageError, match="crop window"):
        hi.decode_and_crop_jpeg(data, [0, 0, height + 1, width])


@SETTINGS
@given(height=sizes, width=sizes, channels=st.sampled_from([1, 3]),
       out_h=st.integers(1, 64), out_w=st.integers(1, 64),
       method=st.sampled_from(["bilinear", "area", "nearest"]), antialias=st.booleans(),
       dtype=st.sampled_from([np.uint8, np.float32]), batch=st.booleans(),
       preserve=st.booleans(), seed=st.integers(0, 2**16))
def test_resize_matches_tf_image_resize(
    height: int, width: int, channels: int, out_h: int, out_w: int, method: str,
    antialias: bool, dtype: type, batch: bool, preserve: bool, seed: int,
) -> None:
    image = photo(height, width, channels, seed).astype(dtype)
    if batch:
        image = np.stack([image, image[::-1]])
    try:
        theirs = tf.image.resize(image, (out_h, out_w), method, preserve_aspect_ratio=preserve,
                                 antialias=antialias).numpy()
    except tf.errors.InvalidArgumentError:  # an aspect ratio that rounds a side to 0
        with pytest.raises(hi.InvalidImageError.__base__, match="must be positive"):
            hi.resize(image, (out_h, out_w), method, preserve_aspect_ratio=preserve)
        return
    mine = hi.resize(image, (out_h, out_w), method, preserve_aspect_ratio=preserve,
                     antialias=antialias)
    assert mine.shape == theirs.shape
    assert mine.dtype == theirs.dtype
    np.testing.assert_allclose(mine, theirs, rtol=0, atol=5e-3)


DTYPES = [np.uint8, np.uint16, np.int8, np.int16, np.int32, np.float16, np.float32, np.float64]


@settings(max_examples=120, deadline=None)
@given(source=st.sampled_from(DTYPES), target=st.sampled_from(DTYPES), saturate=st.booleans(),
       seed=st.integers(0, 2**16))
def test_convert_image_dtype_is_exactly_tensorflows(
    source: type, target: type, saturate: bool, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    if np.dtype(source).kind == "f":
        # out of [0, 1] only when saturating (an unsaturated cast of those is undefined in C++)
        low, high = (-0.5, 1.5) if saturate else (0.0, 1.0)
        if np.dtype(target).kind == "i" and not saturate:
            low = -1.0
        values = rng.uniform(low, high, (4, 5, 3)).astype(source)
    else:
        info = np.iinfo(source)
        values = rng.integers(info.min, int(info.max) + 1, (4, 5, 3)).astype(source)
        values.flat[:2] = [info.min, info.max]
    mine = hi.convert_image_dtype(values, target, saturate)
    theirs = tf.image.convert_image_dtype(values, tf.as_dtype(target), saturate).numpy()
    assert mine.dtype == theirs.dtype
    assert np.array_equal(mine, theirs, equal_nan=True)


@SETTINGS
@given(height=st.integers(40, 200), width=st.integers(40, 200), channels=st.sampled_from([1, 3]),
       flip=st.booleans(), seed=st.integers(0, 2**16), data=st.data())
def test_convert_image_dtype_of_a_cropped_mirrored_view_is_exactly_tensorflows(
    height: int, width: int, channels: int, flip: bool, seed: int, data: st.DataObject,
) -> None:
    """The pipeline's shape of the op: a random crop (a view), maybe mirrored (a view
    with a negative stride), to float32; large enough to take the C pass."""
    image = np.random.default_rng(seed).integers(0, 256, (height, width, channels), np.uint8)
    top, left = data.draw(st.integers(0, height - 32)), data.draw(st.integers(0, width - 32))
    view = image[top : top + data.draw(st.integers(32, height - top)),
                 left : left + data.draw(st.integers(32, width - left))]
    if flip:
        view = view[:, ::-1]
    mine = hi.convert_image_dtype(view, np.float32)
    theirs = tf.image.convert_image_dtype(tf.constant(view), tf.float32).numpy()
    assert mine.dtype == np.float32 and mine.flags.c_contiguous
    assert np.array_equal(mine, theirs)


@SETTINGS
@given(height=sizes, width=sizes, fraction=st.floats(0.01, 1.0), seed=st.integers(0, 99))
def test_crops_and_colour_ops_match_tensorflow(
    height: int, width: int, fraction: float, seed: int
) -> None:
    image = photo(height, width, 3, seed)
    assert np.array_equal(hi.central_crop(image, fraction),
                          tf.image.central_crop(image, fraction).numpy())
    assert np.array_equal(hi.flip_left_right(image), tf.image.flip_left_right(image).numpy())
    assert np.array_equal(hi.flip_up_down(image), tf.image.flip_up_down(image).numpy())
    delta = fraction - 0.5
    assert np.array_equal(hi.adjust_brightness(image, delta),
                          tf.image.adjust_brightness(image, delta).numpy())
    factor = 3 * fraction
    contrast = hi.adjust_contrast(image, factor).astype(int)
    assert np.abs(contrast - tf.image.adjust_contrast(image, factor).numpy()).max() <= 1
    np.testing.assert_allclose(hi.per_image_standardization(image),
                               tf.image.per_image_standardization(image).numpy(), atol=1e-5)


def test_tf_compat_names_are_headraces() -> None:
    assert htf.io.decode_jpeg is hi.decode_jpeg
    assert htf.image.resize is hi.resize
    assert htf.image.convert_image_dtype is hi.convert_image_dtype
    assert htf.image.stateless_random_flip_left_right is hi.stateless_random_flip_left_right
    assert htf.image.rgb_to_hsv is hi.rgb_to_hsv
    with pytest.raises(htf.NotSupportedError, match=r"tf\.image\.ssim"):
        htf.image.ssim  # noqa: B018

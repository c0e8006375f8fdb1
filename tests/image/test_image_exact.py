"""Decoded pixels against TensorFlow's decoders, bit for bit, over drawn files.

The generators draw what users' files hold and Pillow's encoder does not write: PNGs of
every colour type and bit depth (1-16), palettes, tRNS chunks (grey, RGB, palette), rows
filtered or not (written byte by byte in ``image_fns``); JPEGs grey, RGB and CMYK;
BMPs of 8, 24 and 32 bits, bottom-up and top-down. The oracle is TensorFlow itself:
for every ``channels`` and ``dtype`` either both decode to equal arrays (dtype, shape,
values) or both refuse. Truncation: a file cut at a random byte, or a PNG whose image
data stops after some rows, raises :class:`InvalidImageError` wherever TensorFlow
raises.
"""

from __future__ import annotations

import io
import os
from functools import partial
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from image_fns import photo, random_png, write_bmp, write_png

import headrace as hr
import headrace.image as hi
from headrace._errors import InvalidArgumentError

SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
seeds = st.integers(0, 2**32 - 1)


def both(mine: Any, theirs: Any, data: bytes) -> None:
    """Run both decoders: equal arrays, or both refuse (ours with a ValueError)."""
    try:
        expected = theirs().numpy()
    except (tf.errors.InvalidArgumentError, ValueError):
        expected = None
    if expected is None:
        with pytest.raises(ValueError):
            mine()
        return
    got = mine()
    assert got.dtype == expected.dtype and got.shape == expected.shape, (got.shape, expected.shape)
    if not np.array_equal(got, expected):
        wrong = np.argwhere(got != expected)[:3]
        raise AssertionError(f"{len(np.argwhere(got != expected))} values differ, first at "
                             f"{wrong.tolist()}: {got[tuple(wrong[0])]} != "
                             f"{expected[tuple(wrong[0])]}")


@SETTINGS
@given(seed=seeds)
def test_png_of_every_depth_and_colour_type_is_tensorflows(seed: int) -> None:
    rng = np.random.default_rng(seed)
    data, _ = random_png(rng)
    for channels in (0, 1, 2, 3, 4):
        for dtype, tf_dtype in ((np.uint8, tf.uint8), (np.uint16, tf.uint16)):
            both(partial(hi.decode_png, data, channels, dtype),
                 partial(tf.io.decode_png, data, channels, tf_dtype), data)
    for dtype, tf_dtype in ((np.float32, tf.float32), (np.uint16, tf.uint16)):
        both(partial(hi.decode_image, data, None, dtype),
             partial(tf.io.decode_image, data, None, tf_dtype), data)
    header = hi.read_header(data)
    decoded = hi.decode_png(data)
    assert hi.decoded_nbytes(data) == decoded.nbytes, header


def test_sixteen_bit_colour_keeps_every_bit_and_grey_scales_to_rgb() -> None:
    """The two cases of the issue, named: 16-bit RGB at uint16 keeps its low byte; a
    16-bit grey asked for 3 channels is replicated, not clamped."""
    rng = np.random.default_rng(5)
    rgb = rng.integers(0, 65536, (9, 7, 3))
    data = write_png(rgb, 16, 2)
    assert np.array_equal(hi.decode_png(data, dtype=np.uint16), rgb)
    assert np.array_equal(hi.decode_png(data), rgb >> 8)
    grey = rng.integers(0, 65536, (9, 7, 1))
    data = write_png(grey, 16, 0)
    assert np.array_equal(hi.decode_png(data, 3, np.uint16), np.repeat(grey, 3, axis=2))
    assert np.array_equal(hi.decode_png(data, 3), np.repeat(grey >> 8, 3, axis=2))


@SETTINGS
@given(seed=seeds, mode=st.sampled_from(["CMYK", "L", "RGB"]), quality=st.integers(40, 100))
def test_jpeg_grey_rgb_and_cmyk_are_tensorflows(seed: int, mode: str, quality: int) -> None:
    from PIL import Image

    rng = np.random.default_rng(seed)
    height, width = (int(v) for v in rng.integers(1, 40, 2))
    stored = {"CMYK": 4, "L": 1, "RGB": 3}[mode]
    pixels = photo(height, width, 4 if stored == 4 else stored, seed)
    buffer = io.BytesIO()
    Image.fromarray(pixels[:, :, 0] if stored == 1 else pixels, mode).save(
        buffer, "JPEG", quality=quality)
    data = buffer.getvalue()
    for channels in (0, 1, 3):
        both(partial(hi.decode_jpeg, data, channels), partial(tf.io.decode_jpeg, data, channels),
             data)
        both(partial(hi.decode_image, data, channels or None),
             partial(tf.io.decode_image, data, channels or None), data)


@SETTINGS
@given(seed=seeds, height=st.integers(1, 20), width=st.integers(1, 20))
def test_small_cmyk_jpeg_at_every_ratio_is_tensorflows(seed: int, height: int,
                                                       width: int) -> None:
    """CMYK at 1/2, 1/4, 1/8 in the DCT: an image of a few pixels has several scales
    that give its reduced size, and only libjpeg's own 1/ratio gives TensorFlow's
    pixels (simplejpeg took another: 3 of 180 small files differed)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 4), dtype=np.uint8), "CMYK").save(
        buffer, "JPEG", quality=int(rng.integers(40, 101)))
    data = buffer.getvalue()
    for ratio in (1, 2, 4, 8):
        for channels in (0, 1, 3):
            both(partial(hi.decode_jpeg, data, channels, ratio),
                 partial(tf.io.decode_jpeg, data, channels, ratio), data)


@settings(SETTINGS, max_examples=15)
@given(seed=seeds, frames=st.integers(1, 3))
def test_gif_with_every_channels_is_tensorflows_or_refused_as_tensorflow(
        seed: int, frames: int) -> None:
    """A GIF is RGB only: channels 1 or 4 is refused by every op that takes GIF bytes,
    as TensorFlow refuses it (headrace returned 3 channels for 4, or converted), and so
    is an animation by the ops that return one image (it decoded the first frame)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    height, width = (int(v) for v in rng.integers(1, 12, 2))
    images = [Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
              .convert("P") for _ in range(frames)]
    buffer = io.BytesIO()
    images[0].save(buffer, "GIF", save_all=True, append_images=images[1:])
    data = buffer.getvalue()
    for channels in (0, 1, 3, 4):
        for expand in (True, False):
            both(partial(hi.decode_image, data, channels or None, expand_animations=expand),
                 partial(tf.io.decode_image, data, channels or None,
                         expand_animations=expand), data)
        both(partial(hi.decode_png, data, channels), partial(tf.io.decode_png, data, channels),
             data)
        both(partial(hi.decode_jpeg, data, channels),
             partial(tf.io.decode_jpeg, data, channels), data)


@SETTINGS
@given(seed=seeds, stored=st.sampled_from([1, 3, 4]), top_down=st.booleans())
def test_bmp_of_8_24_32_bits_is_tensorflows(seed: int, stored: int, top_down: bool) -> None:
    rng = np.random.default_rng(seed)
    height, width = (int(v) for v in rng.integers(1, 20, 2))
    data = write_bmp(rng.integers(0, 256, (height, width, stored)).astype(np.uint8),
                     top_down=top_down)
    for channels in (0, 1, 3, 4):
        both(partial(hi.decode_bmp, data, channels), partial(tf.io.decode_bmp, data, channels),
             data)
    for dtype, tf_dtype in ((np.uint8, tf.uint8), (np.uint16, tf.uint16), (np.float32, tf.float32)):
        if top_down and dtype != np.uint8:  # TensorFlow's kernel crashes there (it
            # allocates height * width * channels with the negative height): its uint8
            # pixels, converted as its decode_image converts them
            both(partial(hi.decode_image, data, None, dtype),
                 partial(_converted_bmp, data, tf_dtype), data)
            continue
        both(partial(hi.decode_image, data, None, dtype),
             partial(tf.io.decode_image, data, None, tf_dtype), data)


def _converted_bmp(data: bytes, dtype: Any) -> Any:
    return tf.image.convert_image_dtype(tf.io.decode_bmp(data), dtype)


def _encoded(rng: np.random.Generator, kind: str) -> bytes:
    from PIL import Image

    height, width = (int(v) for v in rng.integers(4, 48, 2))
    pixels = photo(height, width, 3, int(rng.integers(1 << 16)))
    if kind == "png":
        return random_png(rng, 24)[0]
    if kind == "bmp":
        return write_bmp(pixels)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, {"jpeg": "JPEG", "gif": "GIF"}[kind])
    return buffer.getvalue()


@SETTINGS
@given(seed=seeds, kind=st.sampled_from(["png", "jpeg", "bmp", "gif"]))
def test_a_file_cut_anywhere_raises_where_tensorflow_raises(seed: int, kind: str) -> None:
    rng = np.random.default_rng(seed)
    data = _encoded(rng, kind)
    cut = int(rng.integers(1, len(data)))
    cut_data = data[:cut]
    decoders = {"png": (hi.decode_png, tf.io.decode_png), "jpeg": (hi.decode_jpeg, tf.io.decode_jpeg),
                "bmp": (hi.decode_bmp, tf.io.decode_bmp), "gif": (hi.decode_gif, tf.io.decode_gif)}
    mine, theirs = decoders[kind]
    try:
        expected = theirs(cut_data).numpy()
    except tf.errors.InvalidArgumentError:
        expected = None
    if expected is None:
        with pytest.raises(hi.InvalidImageError):
            mine(cut_data)
    else:  # (a GIF missing only its trailer decodes in both)
        assert np.array_equal(mine(cut_data), expected)


@SETTINGS
@given(seed=seeds)
def test_png_whose_image_data_stops_early_is_refused_not_black(seed: int) -> None:
    """A well-formed PNG (chunks, CRCs, IEND) whose zlib stream holds only the first rows:
    libpng refuses it; Pillow alone decoded it with the other rows black."""
    rng = np.random.default_rng(seed)
    height, width = int(rng.integers(2, 300)), int(rng.integers(1, 40))
    colour = int(rng.choice([0, 2, 6]))
    samples = rng.integers(0, 256, (height, width, {0: 1, 2: 3, 6: 4}[colour]))
    rows = int(rng.integers(0, height))
    data = write_png(samples, 8, colour, rows=rows)
    with pytest.raises(tf.errors.InvalidArgumentError):
        tf.io.decode_png(data)
    with pytest.raises(hi.InvalidImageError, match=f"{rows} of {height} rows"):
        hi.decode_png(data)
    # in a pipeline the error names the element and where it came from, and the
    # iteration goes on to the next element
    good = write_png(samples, 8, colour)
    ds = hr.Dataset.from_tensor_slices(np.array([good, data, good], dtype=object)).map(
        hi.decode_png)
    outputs: list[Any] = []
    with iter(ds) as iterator:
        outputs.append(next(iterator))
        with pytest.raises(hi.InvalidImageError) as raised:
            next(iterator)
        outputs.append(next(iterator))
    assert "element 1" in "\n".join(getattr(raised.value, "__notes__", []))
    assert all(np.array_equal(output, samples) for output in outputs)


def test_decode_png_refuses_two_channels_as_tensorflow() -> None:
    data = write_png(np.zeros((2, 2, 2), int), 8, 4)
    with pytest.raises(InvalidArgumentError, match="channels"):
        hi.decode_png(data, channels=2)

"""The windowed JPEG decode + resample in C (``headrace.image._jpeg``) against the
Python paths it replaces: generated images (sizes, subsampling, progressive, grey),
boxes, scales, flips and normalisations; truncated and corrupted files."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from image_fns import encode, photo

import headrace.image as hi
from headrace._errors import InvalidArgumentError
from headrace.image._native import jpeg_module
from headrace.image._random import _fast_resize
from headrace.io._native import set_native_enabled

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
native = jpeg_module()


@pytest.fixture
def python_path() -> Iterator[None]:
    previous = set_native_enabled(False)
    try:
        yield
    finally:
        set_native_enabled(previous)


def test_the_test_environment_built_the_extension() -> None:
    # scripts/_venv.sh installs libjpeg's headers, so the C path is what these tests and
    # the image tests prove; a silent fallback to Python would leave it untested (and an
    # extension built from an older jpeg.c, without the whole decode and float pass)
    assert native is not None
    assert hasattr(native, "decode") and hasattr(native, "to_float")


@st.composite
def jpegs(draw: st.DrawFn) -> tuple[bytes, np.ndarray, int]:
    height, width = draw(st.integers(1, 300)), draw(st.integers(1, 300))
    grey = draw(st.booleans())
    image = photo(height, width, 1 if grey else 3, seed=draw(st.integers(0, 99)))
    data = encode(image, "JPEG", quality=draw(st.integers(40, 100)),
                  subsampling=draw(st.sampled_from([0, 1, 2])),
                  progressive=draw(st.booleans()))
    return data, image, 1 if grey else 3


@st.composite
def boxes(draw: st.DrawFn, height: int, width: int) -> tuple[float, float, float, float]:
    top = draw(st.floats(0, height - 0.25))
    left = draw(st.floats(0, width - 0.25))
    bottom = draw(st.floats(top + 0.25, height))
    right = draw(st.floats(left + 0.25, width))
    return top, left, bottom, right


@SETTINGS
@given(case=jpegs(), data=st.data(), out_h=st.integers(1, 96), out_w=st.integers(1, 96),
       denom=st.sampled_from([1, 2, 4, 8]), flip=st.booleans(), channels=st.sampled_from([1, 3]),
       antialias=st.booleans())
def test_window_decode_equals_the_resample_of_the_whole_decode(
    case: tuple[bytes, np.ndarray, int], data: st.DataObject, out_h: int, out_w: int,
    denom: int, flip: bool, channels: int, antialias: bool,
) -> None:
    """Decoding only the window (skipped rows, cropped iMCU columns, early stop) changes
    no value: the result is the resample of the whole image decoded at that scale."""
    assert native is not None
    encoded, _, _ = case
    whole = hi.decode_jpeg(encoded, channels=channels, ratio=denom)
    box = data.draw(boxes(whole.shape[0], whole.shape[1]))
    mul = data.draw(st.lists(st.floats(-2, 2), min_size=channels, max_size=channels))
    add = data.draw(st.lists(st.floats(-2, 2), min_size=channels, max_size=channels))
    window = np.empty((out_h, out_w, channels), np.float32)
    assert native.crop_resize(encoded, window, box, window.shape, denom, antialias, flip, mul,
                              add, True)
    expected = np.empty_like(window)
    native.resample(whole, whole.shape, expected, box, expected.shape, antialias, flip, mul,
                    add)
    np.testing.assert_array_equal(window, expected)
    # a uint8 output is the float one rounded and clamped (no float image to convert)
    small = np.empty(window.shape, np.uint8)
    assert native.crop_resize(encoded, small, box, small.shape, denom, antialias, flip, mul,
                              add, True)
    np.testing.assert_array_equal(small, np.clip(np.floor(window + np.float32(0.5)), 0, 255))


@SETTINGS
@given(height=st.integers(1, 120), width=st.integers(1, 120), out_h=st.integers(1, 64),
       out_w=st.integers(1, 64), channels=st.sampled_from([1, 3]), data=st.data())
def test_resample_is_the_antialiased_bilinear_resize_of_the_crop(
    height: int, width: int, out_h: int, out_w: int, channels: int, data: st.DataObject
) -> None:
    """On an integer box the C filter is ``resize(crop, antialias=True)`` (TensorFlow's
    ScaleAndTranslate triangle kernel), up to the pixels just outside the box that the
    resample of a box inside a bigger image may weigh on its border."""
    pixels = photo(height, width, channels, seed=height * width)
    top = data.draw(st.integers(0, height - 1))
    left = data.draw(st.integers(0, width - 1))
    bottom = data.draw(st.integers(top + 1, height))
    right = data.draw(st.integers(left + 1, width))
    fast = _fast_resize(pixels, (top, left, bottom, right), out_h, out_w)
    assert fast is not None and fast.shape == (out_h, out_w, channels)
    exact = hi.resize(pixels[top:bottom, left:right], (out_h, out_w), antialias=True)
    # outputs whose filter footprint lies inside the box: the same weights (float32 here,
    # float64 in NumPy); the others also weigh pixels just outside the box
    rows = footprint_inside(out_h, top, bottom)
    cols = footprint_inside(out_w, left, right)
    np.testing.assert_allclose(fast[rows][:, cols], exact[rows][:, cols], atol=2e-3)
    if (top, left, bottom, right) == (0, 0, height, width):
        np.testing.assert_allclose(fast, exact, atol=2e-3)
    # non-negative weights summing to 1: within the input's range, up to float32 rounding
    assert fast.min() >= 0 and fast.max() <= np.float32(255) * (1 + 4e-7)


def footprint_inside(count: int, low: int, high: int) -> list[int]:
    scale = (high - low) / count
    support = max(scale, 1.0)
    return [i for i in range(count)
            if low + (i + 0.5) * scale - support >= low - 0.5
            and low + (i + 0.5) * scale + support <= high + 0.5]


@SETTINGS
@given(height=st.integers(1, 120), width=st.integers(1, 120), out_h=st.integers(1, 64),
       out_w=st.integers(1, 64), channels=st.sampled_from([1, 3]), data=st.data())
def test_plain_bilinear_resample_is_tf_resize_of_the_integer_crop(
    height: int, width: int, out_h: int, out_w: int, channels: int, data: st.DataObject
) -> None:
    """Without antialias the box is a crop: TensorFlow's half-pixel bilinear resize of the
    box's pixels alone (edge pixels repeat at the crop's border, not the image's)."""
    assert native is not None
    pixels = photo(height, width, channels, seed=height + width)
    top = data.draw(st.integers(0, height - 1))
    left = data.draw(st.integers(0, width - 1))
    bottom = data.draw(st.integers(top + 1, height))
    right = data.draw(st.integers(left + 1, width))
    out = np.empty((out_h, out_w, channels), np.float32)
    native.resample(pixels, pixels.shape, out, (top, left, bottom, right), out.shape, False,
                    False, [1.0] * channels, [0.0] * channels)
    expected = hi.resize(pixels[top:bottom, left:right], (out_h, out_w))
    np.testing.assert_allclose(out, expected, atol=2e-3)


@SETTINGS
@given(case=jpegs(), indices=st.lists(st.integers(0, 10**6), min_size=1, max_size=6),
       antialias=st.booleans(), flip=st.booleans())
def test_inception_crop_of_a_batch_is_the_stack_of_its_elements(
    case: tuple[bytes, np.ndarray, int], indices: list[int], antialias: bool, flip: bool
) -> None:
    encoded, _, _ = case
    crop = hi.InceptionCrop((20, 24), seed=5, antialias=antialias, flip=flip, mean=0.5, std=0.25)
    images = np.empty(len(indices), object)
    images[:] = [encoded] * len(indices)
    batch = crop.batch(np.asarray(indices), images)
    assert batch.shape == (len(indices), 20, 24, 3) and batch.dtype == np.float32
    np.testing.assert_array_equal(batch, np.stack([crop(i, encoded) for i in indices]))
    with pytest.raises(InvalidArgumentError, match="2 indices for 1 images"):
        crop.batch([1, 2], images[:1])


@SETTINGS
@given(case=jpegs(), index=st.integers(0, 10**6), size=st.integers(1, 80))
def test_random_resized_crop_and_inception_crop_agree_with_the_python_path(
    case: tuple[bytes, np.ndarray, int], index: int, size: int
) -> None:
    encoded, _, _ = case
    seed = (3, index)
    crop = hi.InceptionCrop((size, size + 1), seed=11, mean=[0.5, 0.4, 0.3], std=[0.2, 0.3, 0.1])
    fast = hi.random_resized_crop(encoded, (size, size + 1), seed=seed)
    fast_plain = hi.random_resized_crop(encoded, (size, size + 1), seed=seed, antialias=False)
    fast_inception = crop(index, encoded)
    previous = set_native_enabled(False)
    try:
        slow = hi.random_resized_crop(encoded, (size, size + 1), seed=seed)
        slow_plain = hi.random_resized_crop(encoded, (size, size + 1), seed=seed,
                                            antialias=False)
        slow_inception = crop(index, encoded)
    finally:
        set_native_enabled(previous)
    # Pillow rounds its result to uint8; the C path keeps the float
    assert fast.shape == slow.shape and np.abs(fast - slow).max() <= 1.0 + 1e-3
    # NumPy's resize of the integer crop, float64 against float32
    np.testing.assert_allclose(fast_plain, slow_plain, atol=2e-3)
    assert np.abs(fast_inception - slow_inception).max() <= (1.0 + 1e-3) / 255 / 0.1
    assert fast_inception.dtype == np.float32 and fast_inception.shape == (size, size + 1, 3)


@SETTINGS
@given(case=jpegs(), data=st.data(), ratio=st.sampled_from([1, 2, 4, 8]),
       channels=st.sampled_from([0, 1, 3]))
def test_decode_and_crop_decodes_the_window_to_the_same_pixels(
    case: tuple[bytes, np.ndarray, int], data: st.DataObject, ratio: int, channels: int
) -> None:
    encoded, _, _ = case
    whole = hi.decode_jpeg(encoded, channels=channels, ratio=ratio)
    y = data.draw(st.integers(0, whole.shape[0] - 1))
    x = data.draw(st.integers(0, whole.shape[1] - 1))
    h = data.draw(st.integers(1, whole.shape[0] - y))
    w = data.draw(st.integers(1, whole.shape[1] - x))
    window = hi.decode_and_crop_jpeg(encoded, [y, x, h, w], channels=channels, ratio=ratio)
    assert window.dtype == np.uint8
    np.testing.assert_array_equal(window, whole[y : y + h, x : x + w])


@SETTINGS
@given(case=jpegs(), data=st.data())
def test_a_truncated_jpeg_is_an_error_wherever_the_window_lies(
    case: tuple[bytes, np.ndarray, int], data: st.DataObject
) -> None:
    """Stopping after the window must not hide a file cut short below it."""
    encoded, _, _ = case
    cut = data.draw(st.integers(2, len(encoded) - 3))
    index = data.draw(st.integers(0, 1000))
    with pytest.raises(hi.InvalidImageError, match=r"JPEG|image format|header"):
        hi.random_resized_crop(encoded[:cut], (16, 16), seed=(1, index))
    with pytest.raises(hi.InvalidImageError, match=r"JPEG|image format|header"):
        hi.decode_and_crop_jpeg(encoded[:cut], [0, 0, 1, 1])


@SETTINGS
@given(case=jpegs(), data=st.data())
def test_corrupted_bytes_give_a_result_or_a_clear_error_never_a_crash(
    case: tuple[bytes, np.ndarray, int], data: st.DataObject
) -> None:
    encoded = bytearray(case[0])
    for _ in range(data.draw(st.integers(1, 8))):
        encoded[data.draw(st.integers(0, len(encoded) - 1))] = data.draw(st.integers(0, 255))
    try:
        out = hi.random_resized_crop(bytes(encoded), (16, 16), seed=(1, 2))
    except (hi.InvalidImageError, InvalidArgumentError) as error:
        assert str(error)
    else:
        assert out.shape == (16, 16, 3) and np.isfinite(out).all()


def test_cmyk_window_decode_is_the_resample_of_tensorflows_pixels() -> None:
    """A CMYK JPEG decodes natively at every DCT scale (TensorFlow's CMYK -> RGB): the
    window equals the resample of tf.io.decode_jpeg's pixels at that ratio; luma of
    CMYK is left to the Python path (which refuses it, as TensorFlow)."""
    import io
    import os

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf
    from PIL import Image

    assert native is not None
    rng = np.random.default_rng(7)
    for case in range(6):
        height, width = (int(v) for v in rng.integers(1, 60, 2))
        buffer = io.BytesIO()
        Image.fromarray(photo(height, width, 3, seed=case)).convert("CMYK").save(
            buffer, "JPEG", quality=int(rng.integers(50, 100)))
        data = buffer.getvalue()
        denom = int(rng.choice([1, 2, 4, 8]))
        whole = tf.io.decode_jpeg(data, ratio=denom).numpy()
        box = (0.0, 0.0, float(whole.shape[0]), float(whole.shape[1]))
        for antialias in (True, False):
            out = np.empty((5, 4, 3), np.float32)
            assert native.crop_resize(data, out, box, out.shape, denom, antialias, False,
                                      [1] * 3, [0] * 3, True)
            expected = np.empty_like(out)
            native.resample(whole, whole.shape, expected, box, expected.shape, antialias,
                            False, [1] * 3, [0] * 3)
            np.testing.assert_array_equal(out, expected)
        grey = np.empty((5, 4, 1), np.float32)
        assert not native.crop_resize(data, grey, box, grey.shape, denom, True, False, [1],
                                      [0], True)
    result = hi.random_resized_crop(data, (8, 8), seed=(1, 1))
    assert result.shape == (8, 8, 3)


@SETTINGS
@given(case=jpegs(), channels=st.sampled_from([0, 1, 3]))
def test_whole_decode_equals_simplejpegs(case: tuple[bytes, np.ndarray, int],
                                         channels: int) -> None:
    """decode_jpeg at scale 1 decodes in C (straight into the array): the pixels
    of the simplejpeg path it replaces, bit for bit."""
    encoded, _, stored = case
    mine = hi.decode_jpeg(encoded, channels=channels)
    previous = set_native_enabled(False)
    try:
        theirs = hi.decode_jpeg(encoded, channels=channels)
    finally:
        set_native_enabled(previous)
    assert mine.dtype == np.uint8 and mine.flags.c_contiguous
    assert mine.shape == theirs.shape == (*theirs.shape[:2], channels or stored)
    np.testing.assert_array_equal(mine, theirs)


@SETTINGS
@given(case=jpegs(), data=st.data(), ratio=st.sampled_from([1, 2, 4, 8]))
def test_a_truncated_jpeg_is_an_error_of_the_whole_decode(
    case: tuple[bytes, np.ndarray, int], data: st.DataObject, ratio: int
) -> None:
    """Strict by default, as tf.io.decode_jpeg; try_recover_truncated still decodes."""
    encoded, _, _ = case
    cut = encoded[: data.draw(st.integers(2, len(encoded) - 3))]
    with pytest.raises(hi.InvalidImageError, match=r"decode_jpeg: .*(JPEG|image format|header)"):
        hi.decode_jpeg(cut, ratio=ratio)
    try:
        recovered = hi.decode_jpeg(cut, ratio=ratio, try_recover_truncated=True)
    except hi.InvalidImageError:  # (a cut inside the header or the first scan's tables)
        return
    assert recovered.dtype == np.uint8 and recovered.ndim == 3


def test_to_float_takes_any_strides_and_checks_its_arguments() -> None:
    assert native is not None
    rng = np.random.default_rng(5)
    scale = float(np.float32(1 / 255))
    for _ in range(200):
        shape = tuple(int(v) for v in rng.integers(1, 12, rng.integers(1, 5)))
        base = rng.integers(0, 256, shape, dtype=np.uint8)
        view = base[tuple(slice(None, None, int(rng.choice([1, -1, 2, -3]))) for _ in shape)]
        if view.ndim >= 2 and rng.random() < 0.3:
            view = view.swapaxes(0, -1)
        out = np.empty(view.shape, np.float32)
        native.to_float(view, out, scale)
        np.testing.assert_array_equal(out, view.astype(np.float32) * np.float32(scale))
    with pytest.raises(ValueError, match="src must be uint8"):
        native.to_float(np.zeros(4, np.int8), np.empty(4, np.float32), scale)
    with pytest.raises(ValueError, match="out must hold as many float32"):
        native.to_float(np.zeros(4, np.uint8), np.empty(3, np.float32), scale)
    with pytest.raises(ValueError, match="out must hold h"):
        native.decode(encode(photo(8, 8, 3), "JPEG"), np.empty((8, 8, 2), np.uint8),
                      (8, 8, 2), 1, True)
    with pytest.raises(ValueError, match=r"the header says 9x8 at scale 1/1, the decoder "
                                          r"produced 8x8"):
        native.decode(encode(photo(8, 8, 3), "JPEG"), np.empty((9, 8, 3), np.uint8),
                      (9, 8, 3), 1, True)


@SETTINGS
@given(height=st.integers(64, 160), width=st.integers(64, 160), flip=st.booleans(),
       seed=st.integers(0, 2**16))
def test_convert_image_dtype_in_c_equals_numpys(height: int, width: int, flip: bool,
                                                seed: int) -> None:
    image = np.random.default_rng(seed).integers(0, 256, (height, width, 3), np.uint8)
    view = image[3:-5, 7:-2][:, ::-1] if flip else image[3:-5, 7:-2]
    mine = hi.convert_image_dtype(view, np.float32)
    previous = set_native_enabled(False)
    try:
        theirs = hi.convert_image_dtype(view, np.float32)
    finally:
        set_native_enabled(previous)
    np.testing.assert_array_equal(mine, theirs)
    assert mine.dtype == np.float32


def test_bad_arguments_are_clear_errors() -> None:
    assert native is not None
    encoded = encode(photo(20, 20, 3), "JPEG")
    out = np.empty((4, 4, 3), np.float32)
    for box, shape, denom, message in [
        ((0, 0, 20, 20), (4, 4, 2), 1, "channels must be 1 or 3"),
        ((0, 0, 20, 20), (5, 4, 3), 1, r"out must hold h \* w \* channels float32 or uint8"),
        ((5, 0, 5, 20), (4, 4, 3), 1, "empty box"),
        ((0, 0, 20, 20), (4, 4, 3), 3, "denom must be"),
        ((0, 0, 21, 20), (4, 4, 3), 1, r"box \(0, 0, 21, 20\) is not inside the 20x20 image"),
        ((-1, 0, 10, 20), (4, 4, 3), 1, "is not inside the 20x20 image"),
        ((0, 0, 20, 20), (4, 4, 3), 2, "is not inside the 10x10 image"),
    ]:
        with pytest.raises(ValueError, match=message):
            native.crop_resize(encoded, out, box, shape, denom, True, False, [1] * 3, [0] * 3,
                               True)


def test_threads_share_the_work_and_get_the_same_results() -> None:
    """The call releases the GIL (so a thread map uses every core); concurrent calls
    must not share any state."""
    images = [encode(photo(120 + i, 160 - i, 3, seed=i), "JPEG", quality=90) for i in range(16)]
    expected = [hi.random_resized_crop(data, (32, 32), seed=(9, i)) for i, data in
                enumerate(images)]
    results: dict[int, list[np.ndarray]] = {}

    def work(worker: int) -> None:
        results[worker] = [hi.random_resized_crop(data, (32, 32), seed=(9, i))
                           for _ in range(5) for i, data in enumerate(images)]

    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for outputs in results.values():
        for k, out in enumerate(outputs):
            np.testing.assert_array_equal(out, expected[k % len(images)])


def test_the_plain_pipeline_in_threads_gets_the_same_results() -> None:
    """decode_jpeg and convert_image_dtype run in C without the GIL: threads calling
    them at once must share no state."""
    images = [encode(photo(90 + i, 130 - i, 3, seed=i), "JPEG", quality=85) for i in range(12)]

    def plain(data: bytes) -> np.ndarray:
        return hi.convert_image_dtype(hi.decode_jpeg(data, channels=3)[5:70, ::-1],
                                      np.float32)

    expected = [plain(data) for data in images]
    results: dict[int, list[np.ndarray]] = {}

    def work(worker: int) -> None:
        results[worker] = [plain(data) for _ in range(4) for data in images]

    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 4
    for outputs in results.values():
        for k, out in enumerate(outputs):
            np.testing.assert_array_equal(out, expected[k % len(images)])


def test_python_path_switch(python_path: None) -> None:
    assert jpeg_module() is None

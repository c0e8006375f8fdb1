"""More of tf.image in NumPy: padding and resizing to a box, rotations, colour spaces
and colour adjustments, with TensorFlow's semantics (its kernels' formulas, in
float32, vectorised over every pixel).

Integer images go through float32 in [0, 1] and back as TensorFlow's wrappers do
(``convert_image_dtype``), so integer outputs equal TensorFlow's and float outputs
agree to float32 rounding. The ``random_`` forms draw their factor the way the
others in :mod:`headrace.image` do (deterministic per element, see there); they do
not reproduce TensorFlow's random streams.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from headrace._errors import InvalidArgumentError
from headrace.image._ops import convert_image_dtype, crop_to_bounding_box, image_array, resize
from headrace.image._random import random_factor, seed_generator, stateless_seed

__all__ = [
    "adjust_gamma",
    "adjust_hue",
    "adjust_saturation",
    "grayscale_to_rgb",
    "hsv_to_rgb",
    "pad_to_bounding_box",
    "random_hue",
    "random_saturation",
    "resize_with_crop_or_pad",
    "resize_with_pad",
    "rgb_to_grayscale",
    "rgb_to_hsv",
    "rgb_to_yiq",
    "rgb_to_yuv",
    "rot90",
    "stateless_random_hue",
    "stateless_random_saturation",
    "total_variation",
    "transpose",
    "yiq_to_rgb",
    "yuv_to_rgb",
]

Array = np.ndarray[Any, Any]
_F32 = np.float32


# --------------------------------------------------------------------------- geometry


def pad_to_bounding_box(image: Any, offset_height: int, offset_width: int,
                        target_height: int, target_width: int) -> Array:
    """``tf.image.pad_to_bounding_box``: ``image`` placed at the offset on zeros of
    ``target_height`` x ``target_width``, which must hold it."""
    op = "pad_to_bounding_box"
    array = image_array(image, op)
    height, width = array.shape[-3], array.shape[-2]
    if offset_height < 0 or offset_width < 0:
        raise InvalidArgumentError(
            f"{op}: offsets must be >= 0, got ({offset_height}, {offset_width})")
    if target_height < height + offset_height or target_width < width + offset_width:
        raise InvalidArgumentError(
            f"{op}: the {height}x{width} image at ({offset_height}, {offset_width}) does not "
            f"fit in {target_height}x{target_width}")
    out = np.zeros((*array.shape[:-3], target_height, target_width, array.shape[-1]),
                   dtype=array.dtype)
    out[..., offset_height : offset_height + height, offset_width : offset_width + width, :] = (
        array)
    return out


def resize_with_crop_or_pad(image: Any, target_height: int, target_width: int) -> Array:
    """``tf.image.resize_with_crop_or_pad``: centrally cropped where the image is larger
    than the target and zero-padded around where it is smaller (TensorFlow's offsets:
    the extra row or column goes to the bottom/right)."""
    op = "resize_with_crop_or_pad"
    array = image_array(image, op)
    if target_height <= 0 or target_width <= 0:
        raise InvalidArgumentError(
            f"{op}: target size must be > 0, got {target_height}x{target_width}")
    height, width = array.shape[-3], array.shape[-2]
    height_diff, width_diff = target_height - height, target_width - width
    cropped = crop_to_bounding_box(
        array, max(-height_diff // 2, 0), max(-width_diff // 2, 0),
        min(target_height, height), min(target_width, width))
    return pad_to_bounding_box(cropped, max(height_diff // 2, 0), max(width_diff // 2, 0),
                               target_height, target_width)


def resize_with_pad(image: Any, target_height: int, target_width: int,
                    method: str = "bilinear", antialias: bool = False) -> Array:
    """``tf.image.resize_with_pad``: resized to fit the target keeping the aspect ratio
    (TensorFlow's float32 arithmetic for the size and the offsets), then zero-padded
    to it; float32 as ``resize`` gives."""
    op = "resize_with_pad"
    array = image_array(image, op)
    if target_height <= 0 or target_width <= 0:
        raise InvalidArgumentError(
            f"{op}: target size must be > 0, got {target_height}x{target_width}")
    height, width = _F32(array.shape[-3]), _F32(array.shape[-2])
    f_target_height, f_target_width = _F32(target_height), _F32(target_width)
    ratio = max(width / f_target_width, height / f_target_height)
    resized_height_float, resized_width_float = height / ratio, width / ratio
    resized_height = int(np.floor(resized_height_float))
    resized_width = int(np.floor(resized_width_float))
    pad_height = max(0, int(np.floor((f_target_height - resized_height_float) / _F32(2))))
    pad_width = max(0, int(np.floor((f_target_width - resized_width_float) / _F32(2))))
    resized = resize(array, (resized_height, resized_width), method=method, antialias=antialias)
    return pad_to_bounding_box(resized, pad_height, pad_width, target_height, target_width)


def rot90(image: Any, k: int = 1) -> Array:
    """``tf.image.rot90``: rotated counter-clockwise by ``k`` quarter turns (a view)."""
    array = image_array(image, "rot90")
    return np.rot90(array, int(k) % 4, axes=(-3, -2))


def transpose(image: Any) -> Array:
    """``tf.image.transpose``: height and width swapped (a view)."""
    return np.swapaxes(image_array(image, "transpose"), -3, -2)


# --------------------------------------------------------------------------- colour spaces


def _float_image(array: Array) -> Array:
    """TensorFlow's wrappers: float16/float32 as they are, anything else to float32."""
    if array.dtype in (np.float16, np.float32):
        return array.astype(_F32)
    return convert_image_dtype(array, _F32)


def _rgb(image: Any, op: str) -> Array:
    array = np.asarray(image)
    if array.ndim < 1 or array.shape[-1] != 3:
        raise InvalidArgumentError(
            f"{op}: the last dimension must be the 3 channels R, G, B, got shape {array.shape}")
    return array


def rgb_to_grayscale(images: Any) -> Array:
    """``tf.image.rgb_to_grayscale``: ``0.2989 R + 0.5870 G + 0.1140 B`` in float32,
    back to the input's dtype, with a last dimension of 1."""
    array = _rgb(images, "rgb_to_grayscale")
    flt = convert_image_dtype(array, _F32)
    red, green, blue = flt[..., 0], flt[..., 1], flt[..., 2]
    gray = red * _F32(0.2989) + green * _F32(0.5870) + blue * _F32(0.1140)
    return convert_image_dtype(gray[..., np.newaxis], array.dtype)


def grayscale_to_rgb(images: Any) -> Array:
    """``tf.image.grayscale_to_rgb``: the one channel repeated three times."""
    array = np.asarray(images)
    if array.ndim < 2 or array.shape[-1] != 1:
        raise InvalidArgumentError(
            f"grayscale_to_rgb: the last dimension must be 1 channel, got shape {array.shape}")
    return np.repeat(array, 3, axis=-1)


def rgb_to_hsv(images: Any) -> Array:
    """``tf.image.rgb_to_hsv`` of a float image (values in [0, 1]): hue, saturation,
    value, each in [0, 1], by TensorFlow's kernel's formulas."""
    array = _rgb(images, "rgb_to_hsv")
    if array.dtype.kind != "f":
        raise InvalidArgumentError(
            f"rgb_to_hsv: expects a float image (convert_image_dtype first), got {array.dtype}")
    kind = array.dtype.type
    red, green, blue = array[..., 0], array[..., 1], array[..., 2]
    value = array.max(axis=-1)
    spread = value - array.min(axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        saturation = np.where(value > 0, spread / value, kind(0))
        norm = (kind(1) / spread) * kind(1.0 / 6.0)
        hue = np.where(red == value, norm * (green - blue), np.where(
            green == value, norm * (blue - red) + kind(2.0 / 6.0),
            norm * (red - green) + kind(4.0 / 6.0)))
    hue = np.where(spread > 0, hue, kind(0))
    hue = np.where(hue < 0, hue + kind(1), hue)
    return np.stack([hue, saturation, value], axis=-1).astype(array.dtype)


def hsv_to_rgb(images: Any) -> Array:
    """``tf.image.hsv_to_rgb``: the inverse of :func:`rgb_to_hsv`, by TensorFlow's
    kernel's formulas."""
    array = _rgb(images, "hsv_to_rgb")
    if array.dtype.kind != "f":
        raise InvalidArgumentError(f"hsv_to_rgb: expects a float image, got {array.dtype}")
    kind = array.dtype.type
    hue, saturation, value = array[..., 0], array[..., 1], array[..., 2]
    dh = hue * kind(6)
    one, two = kind(1), kind(2)
    dr = np.clip(np.abs(dh - kind(3)) - one, 0, 1)
    dg = np.clip(-np.abs(dh - two) + two, 0, 1)
    db = np.clip(-np.abs(dh - kind(4)) + two, 0, 1)
    one_s = -saturation + one
    rgb = [(one_s + saturation * d) * value for d in (dr, dg, db)]
    return np.stack(rgb, axis=-1).astype(array.dtype)


# The 3x3 matrices tf.image multiplies the channels by (rows: input channels).
_RGB_TO_YIQ = ((0.299, 0.59590059, 0.2115), (0.587, -0.27455667, -0.52273617),
               (0.114, -0.32134392, 0.31119955))
_YIQ_TO_RGB = ((1, 1, 1), (0.95598634, -0.27201283, -1.10674021),
               (0.6208248, -0.64720424, 1.70423049))
_RGB_TO_YUV = ((0.299, -0.14714119, 0.61497538), (0.587, -0.28886916, -0.51496512),
               (0.114, 0.43601035, -0.10001026))
_YUV_TO_RGB = ((1, 1, 1), (0, -0.394642334, 2.03206185), (1.13988303, -0.58062185, 0))


def _channels_times(images: Any, kernel: Any, op: str) -> Array:
    """The channels times a 3x3 matrix in the image's float dtype (TensorFlow's
    ``tensordot``, which refuses integer images)."""
    array = _rgb(images, op)
    if array.dtype.kind != "f":
        raise InvalidArgumentError(
            f"{op}: expects a float image (convert_image_dtype first), got {array.dtype}")
    product: Array = np.tensordot(array, np.asarray(kernel, dtype=array.dtype), axes=([-1], [0]))
    return product


def rgb_to_yiq(images: Any) -> Array:
    """``tf.image.rgb_to_yiq`` of a float image."""
    return _channels_times(images, _RGB_TO_YIQ, "rgb_to_yiq")


def yiq_to_rgb(images: Any) -> Array:
    """``tf.image.yiq_to_rgb``: the inverse of :func:`rgb_to_yiq`."""
    return _channels_times(images, _YIQ_TO_RGB, "yiq_to_rgb")


def rgb_to_yuv(images: Any) -> Array:
    """``tf.image.rgb_to_yuv`` of a float image."""
    return _channels_times(images, _RGB_TO_YUV, "rgb_to_yuv")


def yuv_to_rgb(images: Any) -> Array:
    """``tf.image.yuv_to_rgb``: the inverse of :func:`rgb_to_yuv`."""
    return _channels_times(images, _YUV_TO_RGB, "yuv_to_rgb")


# --------------------------------------------------------------------------- colour adjustments


def _hv_range(rgb: Array) -> tuple[Array, Array, Array]:
    """AdjustHue's kernel: hue in [0, 6) with the smallest and largest channel."""
    red, green, blue = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    r_lt_g = red < green
    conditions = [
        r_lt_g & (blue < red), r_lt_g & (blue > green), r_lt_g,
        ~r_lt_g & (blue < green), ~r_lt_g & (blue > red),
    ]
    v_max = np.select(conditions, [green, blue, green, red, blue], red)
    v_mid = np.select(conditions, [red, green, blue, green, red], blue)
    v_min = np.select(conditions, [blue, red, red, blue, green], green)
    category = np.select(conditions, [1, 3, 2, 0, 4], 5)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = (v_mid - v_min) / (v_max - v_min)
    increase = (category & 1) == 0
    hue = category.astype(_F32) + np.where(increase, ratio, _F32(1) - ratio)
    hue = np.where(v_max == v_min, _F32(0), hue).astype(_F32)
    return hue, v_min, v_max


def _from_hv_range(hue: Array, v_min: Array, v_max: Array) -> Array:
    category = hue.astype(np.int32)  # truncated, as static_cast<int>
    ratio = hue - category.astype(_F32)
    ratio = np.where((category & 1) == 0, ratio, _F32(1) - ratio)
    v_mid = v_min + ratio * (v_max - v_min)
    picks = [category == c for c in range(5)]
    red = np.select(picks, [v_max, v_mid, v_min, v_min, v_mid], v_max)
    green = np.select(picks, [v_mid, v_max, v_max, v_mid, v_min], v_min)
    blue = np.select(picks, [v_min, v_min, v_mid, v_max, v_max], v_mid)
    return np.stack([red, green, blue], axis=-1).astype(_F32)


def adjust_hue(image: Any, delta: float) -> Array:
    """``tf.image.adjust_hue``: the hue turned by ``delta`` (a fraction of the circle,
    in [-1, 1]); saturation and value kept. Integer images go through float32."""
    array = _rgb(image, "adjust_hue")
    if not -1.0 <= float(delta) <= 1.0:
        raise InvalidArgumentError(f"adjust_hue: delta must be in [-1, 1], got {delta}")
    hue, v_min, v_max = _hv_range(_float_image(array))
    hue = hue + _F32(delta) * _F32(6)
    hue = np.where(hue < 0, hue + _F32(6), hue)  # at most one turn either way
    hue = np.where(hue >= 6, hue - _F32(6), hue)
    return convert_image_dtype(_from_hv_range(hue, v_min, v_max), array.dtype)


def adjust_saturation(image: Any, saturation_factor: float) -> Array:
    """``tf.image.adjust_saturation``: HSV saturation times the factor, clipped to
    [0, 1], by TensorFlow's kernel's conversions. Integer images go through float32."""
    array = _rgb(image, "adjust_saturation")
    flt = _float_image(array)
    red, green, blue = flt[..., 0], flt[..., 1], flt[..., 2]
    value = flt.max(axis=-1)
    spread = value - flt.min(axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        saturation = np.where(value > 0, spread / value, _F32(0))
        norm = _F32(1) / (_F32(6) * spread)
        # (the kernel adds a double 2/6, 4/6: the sum is rounded to float once)
        hue = np.where(red == value, norm * (green - blue), np.where(
            green == value,
            ((norm * (blue - red)).astype(np.float64) + 2.0 / 6.0).astype(_F32),
            ((norm * (red - green)).astype(np.float64) + 4.0 / 6.0).astype(_F32)))
    hue = np.where(spread <= 0, _F32(0), hue)
    hue = np.where(hue < 0, hue + _F32(1), hue).astype(_F32)
    saturation = np.clip(saturation * _F32(saturation_factor), _F32(0), _F32(1)).astype(_F32)
    chroma = saturation * value
    low = value - chroma
    dh = hue * _F32(6)
    category = dh.astype(np.int32)
    fmodu = np.mod(dh, _F32(2))
    x = chroma * (_F32(1) - np.abs(fmodu - _F32(1)))
    zero = np.zeros_like(chroma)
    picks = [category == c for c in range(6)]
    red = np.select(picks, [chroma, x, zero, zero, x, chroma], zero)
    green = np.select(picks, [x, chroma, chroma, x, zero, zero], zero)
    blue = np.select(picks, [zero, zero, x, chroma, chroma, x], zero)
    rgb = np.stack([red + low, green + low, blue + low], axis=-1).astype(_F32)
    return convert_image_dtype(rgb, array.dtype)


def adjust_gamma(image: Any, gamma: float = 1, gain: float = 1) -> Array:
    """``tf.image.adjust_gamma``: ``gain * x ** gamma`` on [0, 1] floats; integer images
    go through float32 and back, saturating."""
    array = np.asarray(image)
    if gamma < 0:
        raise InvalidArgumentError(f"adjust_gamma: gamma must be >= 0, got {gamma}")
    flt = array if array.dtype in (np.float16, np.float32) else convert_image_dtype(array, _F32)
    kind = flt.dtype.type
    adjusted: Array = kind(gain) * flt ** kind(gamma)
    return convert_image_dtype(adjusted, array.dtype, saturate=True)


def total_variation(images: Any) -> Array:
    """``tf.image.total_variation``: the sum of absolute differences of neighbouring
    pixels, per image, in the image's dtype (as TensorFlow: signed integers wrap, and
    unsigned ones are refused)."""
    array = image_array(images, "total_variation")
    if array.dtype.kind not in "if":  # TensorFlow has no abs of unsigned integers
        raise InvalidArgumentError(
            f"total_variation: expects float or signed integer images, got {array.dtype} "
            "(convert_image_dtype, or astype(np.int32), first)")
    if array.ndim == 3:
        down = array[1:, :, :] - array[:-1, :, :]
        across = array[:, 1:, :] - array[:, :-1, :]
        axes: tuple[int, ...] | None = None
    else:
        down = array[:, 1:, :, :] - array[:, :-1, :, :]
        across = array[:, :, 1:, :] - array[:, :, :-1, :]
        axes = (1, 2, 3)
    with np.errstate(over="ignore"):
        total: Array = np.asarray(
            np.abs(down).sum(axis=axes, dtype=array.dtype)
            + np.abs(across).sum(axis=axes, dtype=array.dtype))
    return total


# --------------------------------------------------------------------------- random forms


def random_hue(image: Any, max_delta: float, seed: Any = None) -> Array:
    """``tf.image.random_hue``: ``adjust_hue`` by a delta uniform in
    ``[-max_delta, max_delta)``, ``max_delta`` in [0, 0.5]."""
    if not 0 <= max_delta <= 0.5:
        raise InvalidArgumentError(f"random_hue: max_delta must be in [0, 0.5], got {max_delta}")
    delta = seed_generator(seed, "hue").uniform(-max_delta, max_delta)
    return adjust_hue(image, delta)


def random_saturation(image: Any, lower: float, upper: float, seed: Any = None) -> Array:
    """``tf.image.random_saturation``: ``adjust_saturation`` by a factor uniform in
    ``[lower, upper)``."""
    return adjust_saturation(image, random_factor("random_saturation", lower, upper, seed))


def stateless_random_hue(image: Any, max_delta: float, seed: Any) -> Array:
    """``tf.image.stateless_random_hue``: :func:`random_hue` for the seed pair."""
    return random_hue(image, max_delta, stateless_seed(seed, "hue"))


def stateless_random_saturation(image: Any, lower: float, upper: float, seed: Any) -> Array:
    """``tf.image.stateless_random_saturation``: :func:`random_saturation` for the pair."""
    return random_saturation(image, lower, upper, stateless_seed(seed, "saturation"))

"""tf.image's deterministic operations in NumPy, with TensorFlow's semantics.

``resize`` builds, per axis, the weight matrix of TensorFlow's kernel
(``ResizeBilinear`` with half-pixel centres, ``ResizeArea``, ``ScaleAndTranslate``
with the triangle kernel for ``antialias=True``, ``ResizeNearestNeighbor`` with
half-pixel centres) and applies the two axes as matrix products: one BLAS call
per axis (released GIL, no Python loop per pixel), float32 like TensorFlow's
kernels; results agree with tf.image.resize to float32 rounding (the tests
state the tolerance). ``convert_image_dtype`` follows TensorFlow's exact rules
(integer rescaling by shifts, ``max + 0.5`` on the way to integers, saturation
only when asked).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from headrace._errors import InvalidArgumentError
from headrace.image._native import jpeg_module

__all__ = [
    "ResizeMethod",
    "adjust_brightness",
    "adjust_contrast",
    "central_crop",
    "convert_image_dtype",
    "crop_to_bounding_box",
    "flip_left_right",
    "flip_up_down",
    "normalize",
    "per_image_standardization",
    "resize",
]

Array = np.ndarray[Any, Any]

# below this many values NumPy's own pass costs less than the call into C
_NATIVE_MIN = 4096


class ResizeMethod:
    """``tf.image.ResizeMethod``: the names ``resize`` accepts."""

    BILINEAR = "bilinear"
    NEAREST_NEIGHBOR = "nearest"
    AREA = "area"


def _dtype(dtype: Any) -> np.dtype[Any]:
    found: np.dtype[Any] = np.dtype(getattr(dtype, "as_numpy_dtype", dtype))
    return found


def image_array(image: Any, op: str, ranks: tuple[int, ...] = (3, 4)) -> Array:
    array = np.asarray(image)
    if array.ndim not in ranks:
        raise InvalidArgumentError(
            f"{op}: expected an image of rank {' or '.join(map(str, ranks))} "
            f"((height, width, channels) or a batch of them), got shape {array.shape}"
        )
    return array


def convert_image_dtype(image: Any, dtype: Any, saturate: bool = False,
                        name: str | None = None) -> Array:
    """``tf.image.convert_image_dtype``: integers <-> floats in [0, 1] by the integer
    type's maximum; integer <-> integer by shifting; float <-> float casts.

    As TensorFlow: to a float, ``cast(x) * (1 / max)`` in the target type; to an
    integer, ``x * (max + 0.5)`` truncated (clipped first only with ``saturate``);
    down to a smaller integer, ``x // ((max_in + 1) // (max_out + 1))``; up,
    ``cast(x) * ((max_out + 1) // (max_in + 1))``.
    """
    array = np.asarray(image)
    target = _dtype(dtype)
    source = array.dtype
    if target.kind not in "uif" or source.kind not in "uif":
        raise AttributeError("dtype must be either floating point or integer")
    if source == target:
        return array
    if source.kind in "ui" and target.kind in "ui":
        max_in, max_out = int(np.iinfo(source).max), int(np.iinfo(target).max)
        if max_in > max_out:
            scaled = array // ((max_in + 1) // (max_out + 1))
            return _cast(scaled, target, saturate)
        cast = _cast(array, target, saturate)
        up: Array = cast * target.type((max_out + 1) // (max_in + 1))
        return up
    if source.kind == "f" and target.kind == "f":
        return array.astype(target)
    with np.errstate(over="ignore", invalid="ignore"):  # float16 overflows as TensorFlow's
        if source.kind in "ui":
            scale = target.type(1.0 / np.iinfo(source).max)
            native = jpeg_module() if source == np.uint8 and target == np.float32 else None
            # (an extension built from an older jpeg.c lacks to_float: NumPy's pass then)
            to_float = getattr(native, "to_float", None)
            if to_float is not None and array.size >= _NATIVE_MIN:
                # one C pass without the GIL, whatever the strides: NumPy's walks a
                # mirrored crop three samples at a time (6x slower than a plain one)
                out = np.empty(array.shape, np.float32)
                to_float(array, out, float(scale))
                return out
            # the cast and the scaling in one pass, one output: cast(x) * (1 / max) in
            # the target type, as astype() then multiply gives it (bit for bit)
            result: Array = np.multiply(array, scale,
                                        dtype=target)
            return result
        scaled = array * source.type(np.iinfo(target).max + 0.5)
    return _cast(scaled, target, saturate)


def _cast(array: Array, target: np.dtype[Any], saturate: bool) -> Array:
    """``tf.cast`` (out-of-range values wrap or are undefined) or, with ``saturate``,
    ``tf.dtypes.saturate_cast`` (clipped to the target's range first)."""
    with np.errstate(invalid="ignore", over="ignore"):
        if not saturate:
            return array.astype(target)
        info = np.iinfo(target)
        if array.dtype.kind == "f":  # saturate_cast clips, in the float type, to the
            # floats that fit the integer type (32767 is 32752 in float16)
            kind = array.dtype.type
            high, low = kind(info.max), kind(info.min)
            if float(high) > info.max:
                high = np.nextafter(high, kind(0))
            if float(low) < info.min:
                low = np.nextafter(low, kind(0))
            return np.clip(array, low, high).astype(target)
        source = np.iinfo(array.dtype)
        return np.clip(array, max(info.min, source.min), min(info.max, source.max)).astype(target)


# --------------------------------------------------------------------------- resize


def _bilinear_weights(in_size: int, out_size: int) -> Array:
    scale = np.float32(in_size) / np.float32(out_size)
    weights = np.zeros((out_size, in_size), np.float32)
    position = (np.arange(out_size, dtype=np.float32) + np.float32(0.5)) * scale - np.float32(0.5)
    floor = np.floor(position)
    lower = np.maximum(floor, 0).astype(np.int64)
    upper = np.minimum(np.ceil(position), in_size - 1).astype(np.int64)
    lerp = (position - floor).astype(np.float32)
    rows = np.arange(out_size)
    np.add.at(weights, (rows, lower), np.float32(1) - lerp)
    np.add.at(weights, (rows, upper), lerp)
    return weights


def _area_weights(in_size: int, out_size: int) -> Array:
    """ResizeArea's weights: each output averages the input pixels its span
    ``[o * scale, (o + 1) * scale)`` overlaps, by the overlap (spans past the last
    pixel, from float rounding, count on the last pixel, as TensorFlow clamps)."""
    scale = np.float32(in_size) / np.float32(out_size)
    outs = np.arange(out_size, dtype=np.float32)
    start = (outs * scale).astype(np.float64)[:, None]
    end = ((outs + np.float32(1)) * scale).astype(np.float64)[:, None]
    sources = np.arange(in_size + 2, dtype=np.float64)[None, :]
    overlap = np.maximum(0.0, np.minimum(sources + 1, end) - np.maximum(sources, start))
    weights = overlap[:, :in_size].copy()
    weights[:, -1] += overlap[:, in_size:].sum(axis=1)
    normalized: Array = (weights / float(scale)).astype(np.float32)
    return normalized


def _triangle_weights(in_size: int, out_size: int) -> Array:
    """ScaleAndTranslate's weights for the triangle kernel, antialiased (the kernel
    widened by the downscale factor), each row normalized to sum 1."""
    inv_scale = 1.0 / float(np.float32(out_size) / np.float32(in_size))
    kernel_scale = max(inv_scale, 1.0)
    samples = ((np.arange(out_size) + 0.5) * inv_scale)[:, None]
    sources = np.arange(in_size)[None, :] + 0.5
    weights = np.maximum(0.0, 1.0 - np.abs((sources - samples) / kernel_scale))
    totals = weights.sum(axis=1, keepdims=True)
    usable = np.abs(totals) >= 1000.0 * np.finfo(np.float32).tiny
    return np.where(usable, weights / np.where(usable, totals, 1.0), weights).astype(np.float32)


def _nearest_indices(in_size: int, out_size: int) -> Array:
    scale = np.float32(in_size) / np.float32(out_size)
    position = (np.arange(out_size, dtype=np.float32) + np.float32(0.5)) * scale
    indices: Array = np.minimum(np.floor(position).astype(np.int64), in_size - 1)
    return indices


_WEIGHTS = {"bilinear": _bilinear_weights, "area": _area_weights}


def _bilinear_taps(in_size: int, out_size: int) -> tuple[Array, Array, Array]:
    """ResizeBilinear's two taps per output (lower, upper, lerp), half-pixel centres."""
    scale = np.float32(in_size) / np.float32(out_size)
    position = (np.arange(out_size, dtype=np.float32) + np.float32(0.5)) * scale - np.float32(0.5)
    floor = np.floor(position)
    lower = np.maximum(floor, 0).astype(np.intp)
    upper = np.minimum(np.ceil(position), in_size - 1).astype(np.intp)
    return lower, upper, (position - floor).astype(np.float32)


def _bilinear(pixels: Array, height: int, width: int) -> Array:
    """Two taps per axis, gathered (no weight matrix): ``top + (bottom - top) * lerp``
    per axis, as TensorFlow's kernel computes it."""
    lower, upper, lerp = _bilinear_taps(pixels.shape[0], height)
    top = np.take(pixels, lower, axis=0).astype(np.float32)
    rows = np.take(pixels, upper, axis=0).astype(np.float32)
    rows -= top
    rows *= lerp[:, None, None]
    rows += top
    lower, upper, lerp = _bilinear_taps(pixels.shape[1], width)
    out: Array = np.take(rows, upper, axis=1)
    left = np.take(rows, lower, axis=1)
    out -= left
    out *= lerp[None, :, None]
    out += left
    return out


def _resize_one(image: Array, height: int, width: int, method: str, antialias: bool) -> Array:
    in_h, in_w = image.shape[:2]
    if method == "nearest":
        return image[_nearest_indices(in_h, height)][:, _nearest_indices(in_w, width)]
    if method == "bilinear" and not antialias:
        return np.ascontiguousarray(_bilinear(image, height, width), dtype=np.float32)
    build = _triangle_weights if method == "bilinear" else _WEIGHTS[method]
    rows, cols = build(in_h, height), build(in_w, width)
    pixels = image.astype(np.float32, copy=False)
    channels = pixels.shape[2]
    # two plain matrix products (one BLAS call each), rows first
    tall = (rows @ pixels.reshape(in_h, in_w * channels)).reshape(height, in_w, channels)
    across = tall.transpose(1, 0, 2).reshape(in_w, height * channels)
    out = (cols @ across).reshape(width, height, channels).transpose(1, 0, 2)
    return np.ascontiguousarray(out, dtype=np.float32)


def resize(
    images: Any,
    size: Any,
    method: str = ResizeMethod.BILINEAR,
    preserve_aspect_ratio: bool = False,
    antialias: bool = False,
    name: str | None = None,
) -> Array:
    """``tf.image.resize``: ``(h, w, c)`` or ``(n, h, w, c)`` to ``size = (height, width)``.

    ``bilinear`` (half-pixel centres; ``antialias=True`` widens the triangle kernel
    when shrinking, as TensorFlow's ScaleAndTranslate), ``area`` (exact pixel-area
    averages), ``nearest`` (half-pixel centres, keeps the dtype). The others give
    float32, as TensorFlow's. ``preserve_aspect_ratio`` fits the image inside
    ``size`` (TensorFlow's rounding).
    """
    op = "resize"
    array = image_array(images, op)
    if method not in ("bilinear", "area", "nearest"):
        raise InvalidArgumentError(
            f"{op}: method must be 'bilinear', 'area' or 'nearest', got {method!r}"
        )
    target = [int(v) for v in np.asarray(size).reshape(-1)]
    if len(target) != 2 or min(target) <= 0:
        raise InvalidArgumentError(f"{op}: size must be two positive ints, got {size!r}")
    height, width = target
    batch = array if array.ndim == 4 else array[None]
    if batch.shape[1] == 0 or batch.shape[2] == 0:
        raise InvalidArgumentError(f"{op}: cannot resize an empty image {array.shape}")
    if preserve_aspect_ratio:
        in_h, in_w = np.float32(batch.shape[1]), np.float32(batch.shape[2])
        factor = min(np.float32(height) / in_h, np.float32(width) / in_w)
        height = int(np.round(np.float32(factor * in_h)))
        width = int(np.round(np.float32(factor * in_w)))
        if height == 0 or width == 0:
            raise InvalidArgumentError(
                f"{op}: preserving the aspect ratio of {batch.shape[1]}x{batch.shape[2]} in "
                f"{target[0]}x{target[1]} gives {height}x{width}: output dimensions must be "
                "positive"
            )
    out = [_resize_one(image, height, width, method, antialias) for image in batch]
    stacked = np.stack(out) if len(out) != 1 else out[0][None]
    return stacked if array.ndim == 4 else stacked[0]


# --------------------------------------------------------------------------- crops, flips


def crop_to_bounding_box(image: Any, offset_height: int, offset_width: int,
                         target_height: int, target_width: int) -> Array:
    """``tf.image.crop_to_bounding_box``: the box, which must lie inside the image."""
    op = "crop_to_bounding_box"
    array = image_array(image, op)
    height, width = array.shape[-3], array.shape[-2]
    if offset_height < 0 or offset_width < 0 or target_height <= 0 or target_width <= 0 or \
            offset_height + target_height > height or offset_width + target_width > width:
        raise InvalidArgumentError(
            f"{op}: box ({offset_height}, {offset_width}) + ({target_height}, {target_width}) "
            f"is not inside the {height}x{width} image"
        )
    return array[..., offset_height : offset_height + target_height,
                 offset_width : offset_width + target_width, :]


def central_crop(image: Any, central_fraction: float) -> Array:
    """``tf.image.central_crop``: the centre ``central_fraction`` of each side, with
    TensorFlow's rounding (offset ``int((size - size * fraction) / 2)``)."""
    op = "central_crop"
    array = image_array(image, op)
    if not 0.0 < central_fraction <= 1.0:
        raise InvalidArgumentError(f"{op}: central_fraction must be in (0, 1], got {central_fraction}")
    if central_fraction == 1.0:
        return array
    height, width = array.shape[-3], array.shape[-2]
    top = int((float(height) - float(height) * central_fraction) / 2)
    left = int((float(width) - float(width) * central_fraction) / 2)
    return array[..., top : height - top, left : width - left, :]


def flip_left_right(image: Any) -> Array:
    """``tf.image.flip_left_right`` (a view)."""
    return image_array(image, "flip_left_right")[..., ::-1, :]


def flip_up_down(image: Any) -> Array:
    """``tf.image.flip_up_down`` (a view)."""
    return image_array(image, "flip_up_down")[..., ::-1, :, :]


# --------------------------------------------------------------------------- colour


def _as_float(array: Array) -> Array:
    return array if array.dtype in (np.float16, np.float32) else convert_image_dtype(
        array, np.float32)


def adjust_brightness(image: Any, delta: float) -> Array:
    """``tf.image.adjust_brightness``: add ``delta`` in [0, 1] float units; integers
    convert to float and back (saturating)."""
    array = np.asarray(image)
    flt = _as_float(array)
    brighter: Array = flt + flt.dtype.type(delta)
    return convert_image_dtype(brighter, array.dtype, saturate=True)


def adjust_contrast(images: Any, contrast_factor: float) -> Array:
    """``tf.image.adjust_contrast``: ``(x - mean) * factor + mean``, each channel's mean
    over the image's pixels."""
    array = image_array(images, "adjust_contrast")
    flt = _as_float(array)
    mean = flt.mean(axis=(-3, -2), keepdims=True, dtype=np.float32).astype(flt.dtype)
    adjusted: Array = (flt - mean) * flt.dtype.type(contrast_factor) + mean
    return convert_image_dtype(adjusted, array.dtype, saturate=True)


def per_image_standardization(image: Any) -> Array:
    """``tf.image.per_image_standardization``: ``(x - mean) / max(std, 1/sqrt(n))``
    over each image's pixels and channels, float32."""
    array = image_array(image, "per_image_standardization").astype(np.float32)
    pixels = np.float32(np.prod(array.shape[-3:]))
    mean = array.mean(axis=(-3, -2, -1), keepdims=True, dtype=np.float32)
    std = array.std(axis=(-3, -2, -1), keepdims=True, dtype=np.float32)
    adjusted = np.maximum(std, np.float32(1.0) / np.sqrt(pixels))
    standardized: Array = ((array - mean) / adjusted).astype(np.float32)
    return standardized


def normalize(image: Any, mean: Any, std: Any, dtype: Any = np.float32) -> Array:
    """``(convert_image_dtype(image, dtype) - mean) / std`` per channel (torchvision's
    Normalize after ToTensor; ``mean``/``std`` in [0, 1] units)."""
    array = convert_image_dtype(np.asarray(image), dtype)
    kind = _dtype(dtype)
    mean_a = np.asarray(mean, kind)
    std_a = np.asarray(std, kind)
    if np.any(std_a == 0):
        raise InvalidArgumentError(f"normalize: std must not contain 0, got {std!r}")
    normalized: Array = ((array - mean_a) / std_a).astype(kind)
    return normalized

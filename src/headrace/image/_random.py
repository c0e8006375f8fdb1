"""tf.image's random operations, stateless: a seed pair in, the same result out.

Why stateless: a pipeline's map runs on any number of threads or processes, in
any order; a random op that draws from a generator's state gives results that
depend on who ran which element. Here every random op takes ``seed``:

* a pair ``(a, b)`` (TensorFlow's stateless seed, e.g. ``(pipeline_seed, index)``
  from ``Dataset.enumerate()``): the result depends only on the pair and the
  op, never on the worker (G3), and a restored checkpoint gives the same
  augmentation again (G4). Each op draws from its own Philox stream of the pair,
  so a flip and a crop seeded alike are not correlated;
* ``None``: fresh entropy (TensorFlow's unseeded ops);
* an int (what a tf.image user writes, ``seed=42``): inside a pipeline's map, combined
  with the element's position (:func:`headrace.core.position.element_position`: its
  index in the map's input, and the epoch of each ``repeat`` around the map), so the
  augmentation of an element is the same whatever the number of threads or worker
  processes, their timing, or a restore from a checkpoint (G3, G4), and differs from
  epoch to epoch. At element ``i`` with no repeat around the map it is the pair
  ``(seed, i)``; in epoch ``e`` the pair ``(seed, hash(e, i))``. Each iteration over the
  dataset draws the same again (tf.data's seeded ops do too). Outside a pipeline (no
  element position): a generator per seed in this process (TensorFlow's eager
  op-level seed: a repeatable sequence in one process).

The draws are not TensorFlow's (a different generator); the distributions and
the algorithms (``sample_distorted_bounding_box``'s rejection sampling) are.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np

from headrace._errors import InvalidArgumentError, add_note, mark_batch_row
from headrace.core.position import element_position
from headrace.image._codec import (
    MAX_PIXELS,
    InvalidImageError,
    bytes_of,
    check_pixels,
    decode_image,
    jpeg_pixels,
    native_crop_resize,
    output_channels,
    read_header,
)
from headrace.image._native import jpeg_module
from headrace.image._ops import adjust_brightness, adjust_contrast, image_array, resize

__all__ = [
    "InceptionCrop",
    "random_brightness",
    "random_contrast",
    "random_crop",
    "random_factor",
    "random_flip_left_right",
    "random_flip_up_down",
    "random_resized_crop",
    "random_resized_crop_box",
    "sample_distorted_bounding_box",
    "stateless_random_brightness",
    "stateless_random_contrast",
    "stateless_random_crop",
    "stateless_random_flip_left_right",
    "stateless_random_flip_up_down",
    "stateless_sample_distorted_bounding_box",
]

Array = np.ndarray[Any, Any]

# one Philox stream per op for the same seed pair (the counter's top word)
_SALT = {
    "flip_left_right": 1, "flip_up_down": 2, "crop": 3, "brightness": 4, "contrast": 5,
    "bounding_box": 6, "resized_crop": 7, "hue": 8, "saturation": 9,
}
_STATEFUL: dict[int, np.random.Generator] = {}
_MASK64 = (1 << 64) - 1


def seed_generator(seed: Any, op: str) -> np.random.Generator:
    if seed is None:
        return np.random.default_rng()
    if isinstance(seed, int | np.integer) and not isinstance(seed, bool):
        position = element_position()
        if position is not None:  # in a pipeline: the element's own draw (G3)
            # (the pair (seed, word), as a pair seed gives it: the checks skipped)
            return _stream(int(seed) & _MASK64, _position_word(position) & _MASK64, _SALT[op])
        key = int(seed) * 16 + _SALT[op]
        if key not in _STATEFUL:
            _STATEFUL[key] = np.random.default_rng([int(seed), _SALT[op]])
        return _STATEFUL[key]
    pair = list(seed) if isinstance(seed, tuple | list) else np.asarray(seed).reshape(-1).tolist()
    if len(pair) != 2 or not all(
        isinstance(v, int | np.integer) and not isinstance(v, bool) for v in pair
    ):
        raise InvalidArgumentError(
            f"{op}: seed must be None, an int or a pair of ints (a stateless seed such as "
            f"(pipeline_seed, element_index)), got {seed!r}"
        )
    a, b = (int(v) & _MASK64 for v in pair)
    return _stream(a, b, _SALT[op])


class _Streams(threading.local):
    """This thread's generator per op (internal to :func:`_stream`)."""

    def __init__(self) -> None:
        self.generators: dict[int, np.random.Generator] = {}


_STREAMS = _Streams()


def _stream(a: int, b: int, salt: int) -> np.random.Generator:
    """The Philox stream of key ``(a, b)`` and counter ``salt << 192``, from its start.

    Equal to ``Generator(Philox(key=a << 64 | b, counter=salt << 192))``, but a new
    Philox draws 128 bits of OS entropy for a seed sequence a key makes useless
    (~4 us, twice an image in a crop-and-flip map, with the GIL held): each thread
    keeps one generator per op and resets its state instead. A generator returned
    here is valid until this thread asks for the same op's again: callers draw what
    they need before calling anything that may ask (no caller keeps one).
    """
    generators = _STREAMS.generators
    generator = generators.get(salt)
    if generator is None:
        generator = generators[salt] = np.random.Generator(np.random.Philox(key=0))
    # (the state a new Philox starts in: counter and key as words, low first, and
    # an empty buffer, so that the draws are the same bit for bit)
    generator.bit_generator.state = {
        "bit_generator": "Philox",
        "state": {"counter": (0, 0, 0, salt), "key": (b, a)},
        "buffer": (0, 0, 0, 0), "buffer_pos": 4, "has_uint32": 0, "uinteger": 0,
    }
    return generator


def _position_word(position: tuple[int, ...]) -> int:
    """One word for an element's position: its index where no repeat encloses the map
    (so ``seed=s`` there is ``seed=(s, index)``), else a hash of epochs and index."""
    if len(position) == 1:
        return position[0]
    word = len(position)
    for part in position:  # splitmix64 over the parts (a SeedSequence costs 10x more)
        word = (word + 0x9E3779B97F4A7C15 + (part & _MASK64)) & _MASK64
        word = ((word ^ (word >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        word = ((word ^ (word >> 27)) * 0x94D049BB133111EB) & _MASK64
        word ^= word >> 31
    return word


def stateless_seed(seed: Any, op: str) -> Any:
    if seed is None or isinstance(seed, int | np.integer):
        raise InvalidArgumentError(f"stateless_random_{op}: seed must be a pair of ints, got {seed!r}")
    return seed


# --------------------------------------------------------------------------- flips, crops


def random_flip_left_right(image: Any, seed: Any = None) -> Array:
    """``tf.image.random_flip_left_right``: each image mirrored with probability 1/2
    (each image of a batch decides alone)."""
    array = image_array(image, "random_flip_left_right")
    rng = seed_generator(seed, "flip_left_right")
    if array.ndim == 3:
        return array[:, ::-1] if rng.random() < 0.5 else array
    flips = rng.random(array.shape[0]) < 0.5
    return np.where(flips[:, None, None, None], array[:, :, ::-1], array)


def random_flip_up_down(image: Any, seed: Any = None) -> Array:
    """``tf.image.random_flip_up_down``: each image upside down with probability 1/2."""
    array = image_array(image, "random_flip_up_down")
    rng = seed_generator(seed, "flip_up_down")
    if array.ndim == 3:
        return array[::-1] if rng.random() < 0.5 else array
    flips = rng.random(array.shape[0]) < 0.5
    return np.where(flips[:, None, None, None], array[:, ::-1], array)


def random_crop(value: Any, size: Any, seed: Any = None, name: str | None = None) -> Array:
    """``tf.image.random_crop``: a slice of shape ``size`` at a uniform offset."""
    array = value if isinstance(value, np.ndarray) else np.asarray(value)
    if isinstance(size, tuple | list) and all(type(v) is int for v in size):
        shape = list(size)  # (the usual case, without an array made of it)
    else:
        shape = [int(v) for v in np.asarray(size).reshape(-1)]
    dims = array.shape
    if len(shape) != len(dims) or any(s < 0 or s > d for s, d in zip(shape, dims, strict=True)):
        raise InvalidArgumentError(
            f"random_crop: need value.shape >= size, got shape {dims} and size {shape}"
        )
    rng = seed_generator(seed, "crop")
    # A whole dimension (the channels) is not drawn for: integers(0, 1) is 0 and takes
    # nothing from the stream, so the offsets are the same either way.
    return array[tuple(
        slice(None) if s == d else slice(o := int(rng.integers(0, d - s + 1)), o + s)
        for s, d in zip(shape, dims, strict=True)
    )]


def random_brightness(image: Any, max_delta: float, seed: Any = None) -> Array:
    """``tf.image.random_brightness``: ``adjust_brightness`` by a delta uniform in
    ``[-max_delta, max_delta)``."""
    if max_delta < 0:
        raise InvalidArgumentError(f"random_brightness: max_delta must be >= 0, got {max_delta}")
    delta = seed_generator(seed, "brightness").uniform(-max_delta, max_delta)
    return adjust_brightness(image, delta)


def random_contrast(image: Any, lower: float, upper: float, seed: Any = None) -> Array:
    """``tf.image.random_contrast``: ``adjust_contrast`` by a factor uniform in
    ``[lower, upper)``."""
    return adjust_contrast(image, random_factor("random_contrast", lower, upper, seed))


def random_factor(op: str, lower: float, upper: float, seed: Any) -> float:
    """A factor uniform in ``[lower, upper)`` for the random ``op`` (``random_contrast``,
    ``random_saturation``), after tf.image's checks of the range."""
    if upper <= lower:
        raise InvalidArgumentError(f"{op}: upper must be > lower, got {lower}, {upper}")
    if lower < 0:
        raise InvalidArgumentError(f"{op}: lower must be non-negative, got {lower}")
    return float(seed_generator(seed, op.removeprefix("random_")).uniform(lower, upper))


# --------------------------------------------------------------------------- bounding boxes


def _random_crop_box(
    rng: np.random.Generator, height: int, width: int, min_area: float, max_area: float,
    aspect_ratio: float,
) -> tuple[int, int, int, int] | None:
    """TensorFlow's GenerateRandomCrop: a (y, x, h, w) box of the aspect ratio and an
    area in range, or None."""
    min_h = round(math.sqrt(min_area / aspect_ratio))
    max_h = round(math.sqrt(max_area / aspect_ratio))
    if round(max_h * aspect_ratio) > width:
        max_h = int((width + 0.5 - 1e-7) / aspect_ratio)
        if round(max_h * aspect_ratio) > width:
            max_h -= 1
    max_h = min(max_h, height)
    min_h = min(min_h, max_h)
    crop_h = min_h + int(rng.integers(0, max_h - min_h + 1)) if min_h < max_h else min_h
    crop_w = round(crop_h * aspect_ratio)
    area = crop_w * crop_h
    if area < min_area:
        crop_h += 1
        crop_w = round(crop_h * aspect_ratio)
        area = crop_w * crop_h
    if area < min_area or area > max_area or crop_w > width or crop_h > height \
            or crop_w <= 0 or crop_h <= 0:
        return None
    y = int(rng.integers(0, height - crop_h + 1)) if crop_h < height else 0
    x = int(rng.integers(0, width - crop_w + 1)) if crop_w < width else 0
    return y, x, crop_h, crop_w


def _covers(box: tuple[int, int, int, int], objects: Array, min_covered: float) -> bool:
    y, x, h, w = box
    for ymin, xmin, ymax, xmax in objects:
        area = (ymax - ymin) * (xmax - xmin)
        if area <= 0:
            continue
        inter_h = min(y + h, ymax) - max(y, ymin)
        inter_w = min(x + w, xmax) - max(x, xmin)
        if inter_h > 0 and inter_w > 0 and inter_h * inter_w / area >= min_covered:
            return True
    return False


def sample_distorted_bounding_box(
    image_size: Any,
    bounding_boxes: Any,
    seed: Any = None,
    min_object_covered: float = 0.1,
    aspect_ratio_range: Any = (0.75, 1.33),
    area_range: Any = (0.05, 1.0),
    max_attempts: int = 100,
    use_image_if_no_bounding_boxes: bool | None = None,
    name: str | None = None,
) -> tuple[Array, Array, Array]:
    """``tf.image.sample_distorted_bounding_box``: ``(begin, size, bboxes)`` of a random
    crop covering at least ``min_object_covered`` of one of ``bounding_boxes``
    (normalized ``[ymin, xmin, ymax, xmax]``, shape ``(batch, N, 4)``), with
    TensorFlow's rejection sampling; the whole image when no attempt succeeds.
    ``begin``/``size`` slice the image: ``image[y:y+h, x:x+w]``.
    """
    op = "sample_distorted_bounding_box"
    dims = [int(v) for v in np.asarray(image_size).reshape(-1)]
    if len(dims) != 3 or dims[0] <= 0 or dims[1] <= 0:
        raise InvalidArgumentError(f"{op}: image_size must be [height, width, channels], got {dims}")
    height, width, _ = dims
    boxes = np.asarray(bounding_boxes, np.float32).reshape(-1, 4)
    if boxes.size == 0:
        if not use_image_if_no_bounding_boxes:
            raise InvalidArgumentError(
                f"{op}: no bounding box given; pass use_image_if_no_bounding_boxes=True "
                "to sample from the whole image"
            )
        boxes = np.array([[0.0, 0.0, 1.0, 1.0]], np.float32)
    if np.any(boxes < 0) or np.any(boxes > 1) or np.any(boxes[:, 2:] < boxes[:, :2]):
        raise InvalidArgumentError(f"{op}: bounding boxes must be normalized [ymin, xmin, ymax, xmax]")
    low_ratio, high_ratio = (float(v) for v in aspect_ratio_range)
    low_area, high_area = (float(v) for v in area_range)
    if not (0 < low_ratio <= high_ratio) or not (0 < low_area <= high_area <= 1):
        raise InvalidArgumentError(
            f"{op}: need 0 < aspect_ratio_range[0] <= [1] and 0 < area_range[0] <= [1] <= 1"
        )
    pixels_boxes = boxes * np.array([height, width, height, width], np.float32)
    rng = seed_generator(seed, "bounding_box")
    min_area, max_area = low_area * height * width, high_area * height * width
    box = (0, 0, height, width)
    for _ in range(max_attempts):
        ratio = float(rng.uniform(low_ratio, high_ratio))
        found = _random_crop_box(rng, height, width, min_area, max_area, ratio)
        if found is not None and _covers(found, pixels_boxes, min_object_covered):
            box = found
            break
    y, x, h, w = box
    begin = np.array([y, x, 0], np.int32)
    size = np.array([h, w, -1], np.int32)
    bboxes = np.array([[[y / height, x / width, (y + h) / height, (x + w) / width]]], np.float32)
    return begin, size, bboxes


def random_resized_crop_box(
    height: int, width: int, scale: Any = (0.08, 1.0), ratio: Any = (3 / 4, 4 / 3),
    seed: Any = None,
) -> tuple[int, int, int, int]:
    """The Inception-style crop ``(y, x, h, w)``: an area fraction uniform in ``scale``,
    an aspect ratio log-uniform in ``ratio``, ten tries, then the centre crop clamped
    to the ratio range (torchvision's RandomResizedCrop.get_params)."""
    low_scale, high_scale = (float(v) for v in scale)
    low_ratio, high_ratio = (float(v) for v in ratio)
    if not (0 < low_scale <= high_scale) or not (0 < low_ratio <= high_ratio):
        raise InvalidArgumentError(
            f"random_resized_crop: need 0 < scale[0] <= scale[1] and 0 < ratio[0] <= ratio[1], "
            f"got scale={scale}, ratio={ratio}"
        )
    rng = seed_generator(seed, "resized_crop")
    area = height * width
    log_low, log_high = math.log(low_ratio), math.log(high_ratio)
    for _ in range(10):
        target = area * rng.uniform(low_scale, high_scale)
        aspect = math.exp(rng.uniform(log_low, log_high))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1)), h, w
    in_ratio = width / height
    if in_ratio < low_ratio:
        w, h = width, round(width / low_ratio)
    elif in_ratio > high_ratio:
        h, w = height, round(height * high_ratio)
    else:
        h, w = height, width
    return (height - h) // 2, (width - w) // 2, h, w


def _fast_resize(pixels: Array, box: tuple[float, float, float, float], out_h: int,
                 out_w: int) -> Array | None:
    """The antialiased bilinear resample of the sub-pixel ``box`` (top, left, bottom,
    right) of uint8 pixels — the triangle filter of ``resize(..., antialias=True)`` — in
    C: headrace's extension (float, the same code as the windowed JPEG path, so bytes
    and their decoded pixels give the same values), else Pillow's resampler (rounded to
    uint8, within 1 level). None where neither can do it."""
    if pixels.dtype != np.uint8 or pixels.shape[2] not in (1, 3, 4):
        return None
    native = jpeg_module()
    if native is not None and pixels.shape[2] in (1, 3):
        source = np.ascontiguousarray(pixels)
        out = np.empty((out_h, out_w, pixels.shape[2]), np.float32)
        ones = [1.0] * pixels.shape[2]
        native.resample(source, source.shape, out, box, out.shape, True, False, ones,
                        [0.0] * pixels.shape[2])
        return out
    try:
        from PIL import Image
    except ImportError:
        return None
    top, left, bottom, right = box
    image = Image.fromarray(pixels[:, :, 0] if pixels.shape[2] == 1 else pixels)
    resized = image.resize((out_w, out_h), Image.Resampling.BILINEAR,
                           box=(left, top, right, bottom))
    array = np.asarray(resized, dtype=np.float32)
    return array[:, :, None] if array.ndim == 2 else array


def _integer_box(box: tuple[float, float, float, float], height: int,
                 width: int) -> tuple[int, int, int, int]:
    """The whole pixels of a sub-pixel box: what a crop-then-resize crops."""
    top, left = round(box[0]), round(box[1])
    return (top, left, max(min(round(box[2]), height), top + 1),
            max(min(round(box[3]), width), left + 1))


def _crop_and_resize(pixels: Array, box: tuple[float, float, float, float], out_h: int,
                     out_w: int, method: str, antialias: bool) -> Array:
    if method == "bilinear" and antialias:
        fast = _fast_resize(pixels, box, out_h, out_w)
        if fast is not None:
            return fast
    top, left, bottom, right = _integer_box(box, pixels.shape[0], pixels.shape[1])
    return resize(pixels[top:bottom, left:right], (out_h, out_w), method, antialias=antialias)


def _resized_crop_of_encoded(
    data: bytes | memoryview,
    size: tuple[int, int],
    scale: Any,
    ratio: Any,
    seed: Any,
    method: str,
    antialias: bool,
    channels: int,
    reduced_decode: bool,
    max_pixels: int | None,
    flip_seed: Any = None,
    mul: Any = 1.0,
    add: Any = 0.0,
    out: Array | None = None,
) -> tuple[Array, bool]:
    """random_resized_crop of encoded bytes; with ``flip_seed`` the left-right flip and
    ``v * mul + add`` fused into the C path. Returns the image and whether those two
    were applied (the Python paths leave them to the caller, and ignore ``out``)."""
    op = "random_resized_crop"
    out_h, out_w = size
    header = read_header(data, op)
    check_pixels(header, max_pixels, op)
    y, x, h, w = random_resized_crop_box(header.height, header.width, scale, ratio, seed)
    if header.format != "jpeg":
        pixels = decode_image(data, channels, expand_animations=False, max_pixels=max_pixels)
        return _crop_and_resize(pixels, (y, x, y + h, x + w), out_h, out_w, method,
                                antialias), False
    factor = 1
    if reduced_decode:
        while factor < 8 and h // (factor * 2) >= out_h and w // (factor * 2) >= out_w:
            factor *= 2
    box = (y / factor, x / factor, (y + h) / factor, (x + w) / factor)
    if method == "bilinear":
        flip = flip_seed is not None and seed_generator(flip_seed, "flip_left_right").random() < 0.5
        fused = flip_seed is not None
        window = box if antialias else _integer_box(box, -(-header.height // factor),
                                                    -(-header.width // factor))
        target = out if out is not None else np.empty(
            (out_h, out_w, output_channels(header, channels)), np.float32)
        image = native_crop_resize(data, header, window, target, factor, antialias, True,
                                    "random_resized_crop", flip, mul if fused else 1.0,
                                    add if fused else 0.0)
        if image is not None:
            return image, fused
    pixels = jpeg_pixels(data, header, channels, factor, True, True, "", op)
    return _crop_and_resize(pixels, box, out_h, out_w, method, antialias), False


def random_resized_crop(
    image: Any,
    size: Any,
    scale: Any = (0.08, 1.0),
    ratio: Any = (3 / 4, 4 / 3),
    seed: Any = None,
    *,
    method: str = "bilinear",
    antialias: bool = True,
    channels: int = 3,
    reduced_decode: bool = True,
    max_pixels: int | None = MAX_PIXELS,
) -> Array:
    """An Inception-style random crop resized to ``size``: float32 ``(h, w, channels)``
    in the input's units (0-255 for uint8 or encoded input).

    The box is :func:`random_resized_crop_box`'s (torchvision's RandomResizedCrop);
    the resize is ``resize(crop, size, method, antialias=antialias)`` — antialiased
    bilinear by default, as torchvision's; for uint8 pixels that one runs in C
    (headrace's extension, else Pillow's resampler: within 1 level of the NumPy
    result, several times faster).

    ``image`` is a decoded ``(h, w, c)`` array or the *encoded bytes*. Given JPEG
    bytes, the box is drawn from the header's size, and with ``reduced_decode``
    the JPEG is decoded at the smallest DCT scale (1/2, 1/4, 1/8) that still
    leaves the crop at least ``size`` — the decoder does 4-64x less work for a
    small output from a large crop, and the box is resampled at its exact
    sub-pixel position in the reduced image (``reduced_decode=False`` decodes at
    full size). With headrace's C extension (built where libjpeg-turbo's headers
    are), only the window is decoded: the rows above it are skipped without colour
    conversion, only the iMCU columns around it are reconstructed, and the decoder
    stops after its last row (a file lacking its end marker is read to the end, so
    truncation is still an error), the resample running on the rows as they come,
    without the GIL. Other encoded formats are decoded whole, then cropped.
    """
    op = "random_resized_crop"
    out_h, out_w = (int(v) for v in np.asarray(size).reshape(-1))
    if not isinstance(image, np.ndarray) or image.ndim < 2:  # encoded bytes
        return _resized_crop_of_encoded(bytes_of(image, op), (out_h, out_w), scale, ratio,
                                        seed, method, antialias, channels, reduced_decode,
                                        max_pixels)[0]
    array = image_array(image, op, (3,))
    if array.shape[0] == 0 or array.shape[1] == 0:
        raise InvalidImageError(f"{op}: empty image {array.shape}")
    y, x, h, w = random_resized_crop_box(array.shape[0], array.shape[1], scale, ratio, seed)
    return _crop_and_resize(array, (y, x, y + h, x + w), out_h, out_w, method, antialias)


class InceptionCrop:
    """The usual ImageNet training augmentation as one picklable map function: encoded
    image -> :func:`random_resized_crop` (from the header, DCT-reduced decode) ->
    random left-right flip -> float32 in [0, 1] (``mean``/``std`` normalize it further).

    Call it on ``(index, element)``, as ``Dataset.enumerate().map(InceptionCrop(...))``
    does: ``seed=(seed, index)`` makes each element's augmentation independent of the
    workers and of restores. ``element`` is the encoded image, or a dict whose ``key``
    holds it (the other entries pass through, the index is dropped). A class, not a
    closure, so that ``workers="processes"`` can pickle it. ``antialias=False`` resizes
    the integer crop with plain bilinear interpolation, as TensorFlow's ResNet
    preprocessing does (``tf.image.resize`` of the crop): less work per image than
    torchvision's antialiased filter (the default), and aliasing on large crops.
    ``batch`` does a whole batch into one array (``enumerate().batch(n).map(crop.batch)``).
    """

    def __init__(
        self,
        size: Any,
        seed: int,
        *,
        key: str = "image",
        scale: Any = (0.08, 1.0),
        ratio: Any = (3 / 4, 4 / 3),
        flip: bool = True,
        mean: Any = None,
        std: Any = None,
        antialias: bool = True,
        max_pixels: int | None = MAX_PIXELS,
    ) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
            raise InvalidArgumentError(f"InceptionCrop: seed must be an int >= 0, got {seed!r}")
        self.antialias = bool(antialias)
        self.size = tuple(int(v) for v in np.asarray(size).reshape(-1))
        if len(self.size) != 2:
            raise InvalidArgumentError(f"InceptionCrop: size must be (height, width), got {size!r}")
        self.out_size = (self.size[0], self.size[1])
        self.seed, self.key, self.scale, self.ratio = int(seed), key, scale, ratio
        self.flip, self.max_pixels = flip, max_pixels
        self.mean = None if mean is None else np.asarray(mean, np.float32)
        self.std = None if std is None else np.asarray(std, np.float32)
        # [0, 1] then (v - mean) / std as one v * mul + add, fused into the C pass
        scale = np.float32(1) if self.std is None else self.std
        self._mul = np.float32(1 / 255) / scale
        self._add = (np.float32(0) if self.mean is None else -self.mean) / scale

    def augment(self, index: int, encoded: Any) -> Array:
        """One element's augmentation: the same for the same ``(seed, index)``."""
        return self._augment(index, encoded, None)

    def batch(self, indices: Any, images: Any) -> Array:
        """The augmentation of a whole batch, written straight into one
        ``(n, h, w, 3)`` float32 array: ``Dataset.enumerate().batch(n).map(crop.batch)``
        gives the same values as ``.map(crop).batch(n)`` (each image is still seeded by
        its own index), without a 600 KB array per image that the batch then copies,
        and with one map call per batch instead of per image."""
        index_list = [int(v) for v in np.asarray(indices).reshape(-1)]
        if len(index_list) != len(images):
            raise InvalidArgumentError(
                f"InceptionCrop.batch: {len(index_list)} indices for {len(images)} images"
            )
        out = np.empty((len(index_list), *self.out_size, 3), np.float32)
        for row, (index, encoded) in enumerate(zip(index_list, images, strict=True)):
            try:
                self._augment(index, encoded, out[row])
            except Exception as error:  # which image of the batch: the map names the batch
                add_note(error, f"headrace: InceptionCrop.batch failed on row {row} of "
                                f"{len(index_list)}, the element of index {index}")
                mark_batch_row(error, row)  # the map names that row's origin
                raise
        return out

    def _augment(self, index: int, encoded: Any, out: Array | None) -> Array:
        seed = (self.seed, int(index))
        if not isinstance(encoded, np.ndarray) or encoded.ndim < 2:
            # one C pass where it applies: window decode, resize, flip, normalise
            image, fused = _resized_crop_of_encoded(
                bytes_of(encoded, "InceptionCrop"), self.out_size, self.scale, self.ratio, seed,
                "bilinear", self.antialias, 3, True, self.max_pixels,
                flip_seed=seed if self.flip else None,
                mul=self._mul, add=self._add, out=out,
            )
            if fused:
                return image
        else:
            image = random_resized_crop(encoded, self.size, self.scale, self.ratio, seed,
                                        antialias=self.antialias, max_pixels=self.max_pixels)
        if self.flip:
            image = random_flip_left_right(image, seed)
        scaled: Array = np.array(image, np.float32) if out is None else out
        if out is not None:
            out[...] = image
        scaled *= np.float32(1 / 255)
        if self.mean is not None:
            scaled -= self.mean
        if self.std is not None:
            scaled /= self.std
        return scaled

    def __call__(self, index: Any, element: Any) -> Any:
        if isinstance(element, dict):
            return {**element, self.key: self.augment(index, element[self.key])}
        return self.augment(index, element)


# --------------------------------------------------------------------------- stateless names


def stateless_random_flip_left_right(image: Any, seed: Any) -> Array:
    """``tf.image.stateless_random_flip_left_right``, on headrace's random streams.

    The same seed gives the same draw every run and on every machine, but not TensorFlow's
    draw: headrace's Philox streams are its own (see the images guide).
    """
    return random_flip_left_right(image, stateless_seed(seed, "flip_left_right"))


def stateless_random_flip_up_down(image: Any, seed: Any) -> Array:
    """``tf.image.stateless_random_flip_up_down``, on headrace's random streams.

    The same seed gives the same draw every run and on every machine, but not TensorFlow's
    draw: headrace's Philox streams are its own (see the images guide).
    """
    return random_flip_up_down(image, stateless_seed(seed, "flip_up_down"))


def stateless_random_crop(value: Any, size: Any, seed: Any, name: str | None = None) -> Array:
    """``tf.image.stateless_random_crop``, on headrace's random streams.

    The same seed gives the same draw every run and on every machine, but not TensorFlow's
    draw: headrace's Philox streams are its own (see the images guide).
    """
    return random_crop(value, size, stateless_seed(seed, "crop"))


def stateless_random_brightness(image: Any, max_delta: float, seed: Any) -> Array:
    """``tf.image.stateless_random_brightness``, on headrace's random streams.

    The same seed gives the same draw every run and on every machine, but not TensorFlow's
    draw: headrace's Philox streams are its own (see the images guide).
    """
    return random_brightness(image, max_delta, stateless_seed(seed, "brightness"))


def stateless_random_contrast(image: Any, lower: float, upper: float, seed: Any) -> Array:
    """``tf.image.stateless_random_contrast``, on headrace's random streams.

    The same seed gives the same draw every run and on every machine, but not TensorFlow's
    draw: headrace's Philox streams are its own (see the images guide).
    """
    return random_contrast(image, lower, upper, stateless_seed(seed, "contrast"))


def stateless_sample_distorted_bounding_box(
    image_size: Any, bounding_boxes: Any, seed: Any, **kwargs: Any
) -> tuple[Array, Array, Array]:
    """``tf.image.stateless_sample_distorted_bounding_box``, on headrace's random
    streams.

    The same seed gives the same draw every run and on every machine, but not TensorFlow's
    draw: headrace's Philox streams are its own (see the images guide).
    """
    return sample_distorted_bounding_box(
        image_size, bounding_boxes, stateless_seed(seed, "sample_distorted_bounding_box"), **kwargs
    )

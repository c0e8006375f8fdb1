"""Image headers and decoders: the size of a decoded image is known before its pixels exist.

Why headers first: a decoded image is 10-50x its JPEG, and a pipeline that books
memory after decoding has already spent it. :func:`read_header` parses the few
bytes that say width, height and channels (JPEG SOF, PNG IHDR, GIF screen, BMP
info header) in pure Python, so a map can book the decoded size before the
decoder runs (``map(..., output_nbytes=decoded_nbytes)``) and a decompression
bomb is refused (``max_pixels``) before anything is allocated.

Decoders. JPEG goes through simplejpeg (MIT; libjpeg-turbo bundled in its
wheels): with ``fastdct=True`` and fancy upsampling it gives *the same pixels*
as ``tf.io.decode_jpeg``'s defaults (both run libjpeg-turbo's fast integer
IDCT), and it decodes at 1/2, 1/4, 1/8 size in the DCT (``ratio``), which the
random-resized-crop path uses. PNG, GIF and BMP go through Pillow (HPND). Both
are in the ``[image]`` extra; without simplejpeg, JPEG falls back to Pillow
(pixels then differ from TensorFlow's by a few levels: Pillow uses the accurate
IDCT). benchmarks/results/decoders.md has the comparison that chose them.
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from headrace.errors import InvalidArgumentError
from headrace.io._native import jpeg_module

__all__ = [
    "MAX_PIXELS",
    "ImageHeader",
    "InvalidImageError",
    "decode_and_crop_jpeg",
    "decode_bmp",
    "decode_gif",
    "decode_image",
    "decode_jpeg",
    "decode_png",
    "decoded_nbytes",
    "extract_jpeg_shape",
    "is_jpeg",
    "read_header",
]

#: Default ``max_pixels`` (per frame): 2**27, an RGB image of 384 MiB. Larger images are
#: refused from their header, before anything is allocated (a decompression bomb: a
#: 20 KB PNG can declare 50,000 x 50,000 pixels).
MAX_PIXELS = 1 << 27

Array = np.ndarray[Any, Any]


class InvalidImageError(InvalidArgumentError):
    """Bytes that are not a decodable image: truncated, corrupt, a header that lies, or
    larger than ``max_pixels``. A ``ValueError`` (as TensorFlow's InvalidArgumentError);
    inside a pipeline the map's note adds the stage and the element's index."""


@dataclass(frozen=True)
class ImageHeader:
    """What an image's header says: format, size, channels as stored, bits per sample."""

    format: str  # "jpeg" | "png" | "gif" | "bmp"
    height: int
    width: int
    channels: int
    bits: int = 8
    frames: int = 1  # GIF: counted from the frame descriptors

    @property
    def pixels(self) -> int:
        return self.height * self.width


_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def _bytes_of(contents: Any, op: str) -> bytes | memoryview:
    if isinstance(contents, bytes):
        return contents
    if isinstance(contents, bytearray | memoryview):
        return memoryview(contents)
    if isinstance(contents, np.ndarray):
        if contents.dtype == object and contents.shape == ():
            return _bytes_of(contents.item(), op)
        if contents.dtype.kind == "S" and contents.shape == ():
            return bytes(contents.item())
        if contents.dtype == np.uint8 and contents.ndim == 1:
            return memoryview(contents.data)
    if isinstance(contents, np.bytes_):
        return bytes(contents)
    raise InvalidArgumentError(
        f"{op}: contents must be the encoded bytes (bytes, or a 1-D uint8 array), "
        f"got {type(contents).__name__}"
    )


def is_jpeg(contents: Any) -> bool:
    """``tf.io.is_jpeg``: the bytes start with a JPEG's SOI marker."""
    data = _bytes_of(contents, "is_jpeg")
    return bytes(data[:3]) == b"\xff\xd8\xff"


def _jpeg_header(data: bytes | memoryview, op: str) -> ImageHeader:
    size = len(data)
    position = 2
    while position + 4 <= size:
        if data[position] != 0xFF:
            raise InvalidImageError(
                f"{op}: corrupt JPEG: expected a marker at byte {position}, found "
                f"0x{data[position]:02x}"
            )
        marker = data[position + 1]
        if marker == 0xFF:  # fill byte
            position += 1
            continue
        if marker in (0x01, *range(0xD0, 0xD8)):  # markers without a length
            position += 2
            continue
        (length,) = struct.unpack_from(">H", data, position + 2)
        if marker in _SOF:
            if position + 10 > size:
                break
            bits, height, width, components = struct.unpack_from(">BHHB", data, position + 4)
            if height == 0 or width == 0:
                raise InvalidImageError(
                    f"{op}: JPEG header declares a {height}x{width} image (byte {position})"
                )
            return ImageHeader("jpeg", height, width, components, bits)
        if marker == 0xDA:  # scan data before any frame header
            break
        position += 2 + length
    raise InvalidImageError(
        f"{op}: truncated or corrupt JPEG: no frame header (SOF) in its {size} bytes"
    )


def _png_header(data: bytes | memoryview, op: str) -> ImageHeader:
    if len(data) < 33 or bytes(data[12:16]) != b"IHDR":
        raise InvalidImageError(f"{op}: truncated or corrupt PNG: no IHDR chunk at byte 8")
    width, height, bits, colour = struct.unpack_from(">IIBB", data, 16)
    channels = {0: 1, 2: 3, 3: 3, 4: 2, 6: 4}.get(colour)
    if channels is None or width == 0 or height == 0:
        raise InvalidImageError(
            f"{op}: corrupt PNG header: {width}x{height}, colour type {colour}"
        )
    # a tRNS chunk (before the first IDAT) adds an alpha channel, as libpng expands it
    position = 33
    while position + 8 <= len(data):
        (length,) = struct.unpack_from(">I", data, position)
        kind = bytes(data[position + 4 : position + 8])
        if kind == b"IDAT":
            break
        if kind == b"tRNS" and channels in (1, 3):
            channels += 1
            break
        position += 12 + length
    return ImageHeader("png", height, width, channels, bits)


def _gif_header(data: bytes | memoryview, op: str) -> ImageHeader:
    if len(data) < 13:
        raise InvalidImageError(f"{op}: truncated GIF: {len(data)} bytes")
    width, height = struct.unpack_from("<HH", data, 6)
    if width == 0 or height == 0:
        raise InvalidImageError(f"{op}: GIF header declares a {height}x{width} image")
    return ImageHeader("gif", height, width, 3, 8, _gif_frames(data))


def _gif_frames(data: bytes | memoryview) -> int:
    """Frames of a GIF, counted from its block structure (no pixel is decoded)."""
    size = len(data)
    position = 13
    flags = data[10]
    if flags & 0x80:
        position += 3 << ((flags & 7) + 1)
    frames = 0
    while position < size:
        block = data[position]
        if block == 0x3B:  # trailer
            break
        if block == 0x21:  # extension: label, then sub-blocks
            position += 2
        elif block == 0x2C:  # image descriptor
            frames += 1
            if position + 10 > size:
                break
            local = data[position + 9]
            position += 10
            if local & 0x80:
                position += 3 << ((local & 7) + 1)
            position += 1  # LZW minimum code size
        else:
            break
        while position < size and data[position]:  # sub-blocks up to the terminator
            position += data[position] + 1
        position += 1
    return max(frames, 1)


def _bmp_header(data: bytes | memoryview, op: str) -> ImageHeader:
    if len(data) < 30:
        raise InvalidImageError(f"{op}: truncated BMP: {len(data)} bytes")
    width, height, _, bits = struct.unpack_from("<iiHH", data, 18)
    if width <= 0 or height == 0:
        raise InvalidImageError(f"{op}: BMP header declares a {abs(height)}x{width} image")
    return ImageHeader("bmp", abs(height), width, 4 if bits == 32 else 3 if bits >= 24 else 1)


def read_header(contents: Any, op: str = "read_header") -> ImageHeader:
    """Format, height, width and channels of an encoded image, from its header alone.

    Raises :class:`InvalidImageError` for bytes that are no JPEG, PNG, GIF or BMP,
    or whose header is truncated or corrupt.
    """
    data = _bytes_of(contents, op)
    head = bytes(data[:8])
    if head[:3] == b"\xff\xd8\xff":
        return _jpeg_header(data, op)
    if head == b"\x89PNG\r\n\x1a\n":
        return _png_header(data, op)
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return _gif_header(data, op)
    if head[:2] == b"BM":
        return _bmp_header(data, op)
    raise InvalidImageError(
        f"{op}: unknown image format (first bytes {head!r}); JPEG, PNG, GIF and BMP are decoded"
    )


def _output_channels(header: ImageHeader, channels: int) -> int:
    if channels:
        return channels
    if header.format == "jpeg":
        return 1 if header.channels == 1 else 3
    return header.channels


def _check_pixels(header: ImageHeader, max_pixels: int | None, op: str) -> None:
    if max_pixels is not None and header.pixels > max_pixels:
        raise InvalidImageError(
            f"{op}: the {header.format.upper()} header declares {header.height}x{header.width} "
            f"= {header.pixels:,} pixels, more than max_pixels={max_pixels:,} "
            "(a decompression bomb?); raise max_pixels to decode it"
        )


def decoded_nbytes(
    contents: Any, channels: int = 0, dtype: Any = np.uint8, *, ratio: int = 1,
    max_pixels: int | None = MAX_PIXELS,
) -> int:
    """Bytes the decoded image will take, from its header: 0 if the header cannot be read
    or declares more than ``max_pixels`` (the decoder refuses those, raising the error
    in the element's place; booking a bomb's 10 GiB would stop the whole pipeline).

    Pass it to ``map(..., output_nbytes=...)`` so that a map decoding images books each
    decoded image before it exists.
    """
    try:
        header = read_header(contents, "decoded_nbytes")
    except InvalidArgumentError:
        return 0
    if max_pixels is not None and header.pixels > max_pixels:
        return 0
    height, width = -(-header.height // ratio), -(-header.width // ratio)
    frames = header.frames if header.format == "gif" else 1
    itemsize = int(np.dtype(getattr(dtype, "as_numpy_dtype", dtype)).itemsize)
    return frames * height * width * _output_channels(header, channels) * itemsize


def extract_jpeg_shape(contents: Any, output_type: Any = np.int32) -> Array:
    """``tf.io.extract_jpeg_shape``: ``[height, width, channels]`` from the header."""
    header = read_header(contents, "extract_jpeg_shape")
    if header.format != "jpeg":
        raise InvalidImageError(f"extract_jpeg_shape: not a JPEG ({header.format.upper()})")
    return np.array([header.height, header.width, header.channels], dtype=output_type)


def _check_channels(channels: int, allowed: tuple[int, ...], op: str) -> None:
    if channels not in allowed:
        raise InvalidArgumentError(f"{op}: channels must be one of {allowed}, got {channels!r}")


def _invalid_jpeg(op: str, data: bytes | memoryview, header: ImageHeader,
                  error: Exception) -> InvalidImageError:
    return InvalidImageError(
        f"{op}: invalid or truncated JPEG ({len(data)} bytes, header "
        f"{header.height}x{header.width}x{header.channels}): {error}"
    )


def _simplejpeg() -> Any:
    try:
        import simplejpeg
    except ImportError:
        return None
    return simplejpeg


def _pillow(op: str) -> Any:
    try:
        from PIL import Image
    except ImportError:
        raise InvalidArgumentError(
            f"{op} needs Pillow: pip install 'headrace[image]'"
        ) from None
    return Image


def _native_crop_resize(
    data: bytes | memoryview,
    header: ImageHeader,
    box: tuple[float, float, float, float],
    out: Array,
    ratio: int,
    antialias: bool,
    strict: bool,
    op: str,
    flip: bool = False,
    mul: Any = 1.0,
    add: Any = 0.0,
) -> Array | None:
    """The bilinear resample of ``box`` (top, left, bottom, right in the image decoded at
    1/ratio) of a JPEG into ``out`` ((h, w, channels) float32, or uint8 rounded) by the C
    extension (``headrace.image._jpeg``): only the rows and iMCU columns the resample
    reads are decoded (libjpeg's own scaled IDCT, the fast integer IDCT and fancy
    upsampling, TensorFlow's defaults), the decoder stops after the window's last row,
    the flip and ``v * mul + add`` happen in the last pass, all without the GIL.
    ``antialias``: Pillow's filter, the box at its place in the image; without, the
    taps stop at the box's edges (tf.image.resize of the crop). None where it does not
    apply (not built, CMYK): the caller takes the Python path."""
    native = jpeg_module()
    channels = out.shape[2]
    if native is None or header.channels not in (1, 3) or channels not in (1, 3) \
            or ratio not in (1, 2, 4, 8):
        return None
    per_channel = [np.broadcast_to(np.asarray(v, np.float32), (channels,)).tolist()
                   for v in (mul, add)]
    try:
        done = native.crop_resize(data, out, box, out.shape, ratio, antialias, flip,
                                  per_channel[0], per_channel[1], strict)
    except ValueError as error:
        raise _invalid_jpeg(op, data, header, error) from error
    return out if done else None


def _native_window(data: bytes | memoryview, header: ImageHeader,
                   window: tuple[int, int, int, int], channels: int, ratio: int, strict: bool,
                   op: str) -> Array | None:
    """The uint8 pixels of ``window`` (y, x, height, width in the image decoded at
    1/ratio), decoding only the window: the resample of a whole-pixel box at scale 1
    without antialias is the crop itself (one tap of weight 1 per pixel, exact)."""
    y, x, height, width = window
    return _native_crop_resize(data, header, (y, x, y + height, x + width),
                               np.empty((height, width, channels), np.uint8), ratio, False,
                               strict, op)


def _jpeg_pixels(
    data: bytes | memoryview,
    header: ImageHeader,
    channels: int,
    ratio: int,
    fancy_upscaling: bool,
    strict: bool,
    dct_method: str,
    op: str,
) -> Array:
    out_channels = _output_channels(header, channels)
    height, width = -(-header.height // ratio), -(-header.width // ratio)
    if ratio > 1 and fancy_upscaling and dct_method != "INTEGER_ACCURATE":
        # libjpeg's scale 1/ratio, as TensorFlow: simplejpeg picks the smallest scale
        # giving at least this size, a larger one for images of a few pixels
        reduced = _native_window(data, header, (0, 0, height, width), out_channels, ratio,
                                 strict, op)
        if reduced is not None:
            return reduced
    codec = _simplejpeg()
    try:
        if codec is not None and header.channels in (1, 3):
            pixels = codec.decode_jpeg(
                data,
                colorspace="GRAY" if out_channels == 1 else "RGB",
                fastdct=dct_method != "INTEGER_ACCURATE",
                fastupsample=not fancy_upscaling,
                min_height=height if ratio > 1 else 0,
                min_width=width if ratio > 1 else 0,
                strict=strict,
            )
        else:
            image = _pillow(op).open(io.BytesIO(bytes(data)))
            if ratio > 1:
                image.draft(image.mode, (width, height))
            image.load()
            if image.size != (width, height):  # Pillow's draft stops at a larger scale
                image = image.resize((width, height), _pillow(op).Resampling.BOX)
            pixels = np.asarray(image.convert("L" if out_channels == 1 else "RGB"))
    except InvalidArgumentError:
        raise
    except Exception as error:
        raise _invalid_jpeg(op, data, header, error) from error
    if pixels.ndim == 2:
        pixels = pixels[:, :, None]
    if pixels.shape[:2] != (height, width):
        raise InvalidImageError(
            f"{op}: the JPEG header says {height}x{width} at ratio {ratio}, the decoder "
            f"produced {pixels.shape[0]}x{pixels.shape[1]}"
        )
    decoded: Array = pixels
    return decoded


def decode_jpeg(
    contents: Any,
    channels: int = 0,
    ratio: int = 1,
    fancy_upscaling: bool = True,
    try_recover_truncated: bool = False,
    acceptable_fraction: float = 1,
    dct_method: str = "",
    name: str | None = None,
    *,
    max_pixels: int | None = MAX_PIXELS,
) -> Array:
    """``tf.io.decode_jpeg``: a ``uint8`` array ``(height, width, channels)``.

    ``channels`` 0 keeps the file's (1 or 3), 1 gives luma, 3 RGB. ``ratio`` 1, 2, 4
    or 8 decodes at that fraction of the size in the DCT (much less work, and the
    output is ``ceil(h / ratio)`` x ``ceil(w / ratio)`` as TensorFlow's; with headrace's
    C extension the pixels are TensorFlow's at every size, without it only for images
    of at least ``8 * ratio`` pixels a side, below which several DCT scales give the
    same size and simplejpeg takes the smallest). PNG, GIF
    and BMP bytes are decoded too, as TensorFlow's op does. A truncated JPEG raises
    :class:`InvalidImageError` unless ``try_recover_truncated`` (missing rows grey).
    """
    op = "decode_jpeg"
    _check_channels(channels, (0, 1, 3), op)
    if ratio not in (1, 2, 4, 8):
        raise InvalidArgumentError(f"{op}: ratio must be 1, 2, 4 or 8, got {ratio!r}")
    data = _bytes_of(contents, op)
    header = read_header(data, op)
    _check_pixels(header, max_pixels, op)
    if header.format != "jpeg":
        image = decode_image(contents, channels or None, expand_animations=False,
                             max_pixels=max_pixels)
        return image
    return _jpeg_pixels(
        data, header, channels, ratio, fancy_upscaling, not try_recover_truncated,
        dct_method, op,
    )


def decode_and_crop_jpeg(
    contents: Any,
    crop_window: Any,
    channels: int = 0,
    ratio: int = 1,
    fancy_upscaling: bool = True,
    try_recover_truncated: bool = False,
    acceptable_fraction: float = 1,
    dct_method: str = "",
    name: str | None = None,
    *,
    max_pixels: int | None = MAX_PIXELS,
) -> Array:
    """``tf.image.decode_and_crop_jpeg``: the window ``[y, x, height, width]`` of the image.

    The window is checked against the header before decoding (TensorFlow's error:
    the window must lie inside the image). With headrace's C extension, only the
    window is decoded, as TensorFlow does: the rows above it are skipped, only the
    iMCU columns around it are reconstructed and the decoder stops after it (a file
    lacking its end marker is read to the end, so truncation stays an error).
    Without it, the image is decoded and the window copied out. Decode at a
    ``ratio`` (the window then counts in the reduced image's pixels) to decode less.
    """
    op = "decode_and_crop_jpeg"
    _check_channels(channels, (0, 1, 3), op)
    if ratio not in (1, 2, 4, 8):
        raise InvalidArgumentError(f"{op}: ratio must be 1, 2, 4 or 8, got {ratio!r}")
    window = [int(v) for v in np.asarray(crop_window).reshape(-1)]
    if len(window) != 4:
        raise InvalidArgumentError(f"{op}: crop_window must be [y, x, height, width], got {window}")
    data = _bytes_of(contents, op)
    header = read_header(data, op)
    _check_pixels(header, max_pixels, op)
    y, x, height, width = window
    full_h, full_w = -(-header.height // ratio), -(-header.width // ratio)
    if y < 0 or x < 0 or height <= 0 or width <= 0 or y + height > full_h or x + width > full_w:
        raise InvalidImageError(
            f"{op}: crop window {window} is not inside the {full_h}x{full_w} image"
        )
    if (header.format == "jpeg" and fancy_upscaling and dct_method in ("", "INTEGER_FAST")
            and not try_recover_truncated):
        window_pixels = _native_window(data, header, (y, x, height, width),
                                       _output_channels(header, channels), ratio, True, op)
        if window_pixels is not None:
            return window_pixels
    if header.format == "jpeg":  # (its errors then name this op, not decode_jpeg)
        image = _jpeg_pixels(data, header, channels, ratio, fancy_upscaling,
                             not try_recover_truncated, dct_method, op)
    else:
        image = decode_jpeg(data, channels, ratio, fancy_upscaling, try_recover_truncated,
                            acceptable_fraction, dct_method, max_pixels=max_pixels)
    return np.ascontiguousarray(image[y : y + height, x : x + width])


def _pillow_decode(data: bytes | memoryview, header: ImageHeader, op: str) -> Any:
    Image = _pillow(op)
    try:
        image = Image.open(io.BytesIO(bytes(data)))
        image.load()
    except Exception as error:
        raise InvalidImageError(
            f"{op}: invalid or truncated {header.format.upper()} ({len(data)} bytes, header "
            f"{header.height}x{header.width}): {error}"
        ) from error
    if image.size != (header.width, header.height):
        raise InvalidImageError(
            f"{op}: the header says {header.height}x{header.width}, the decoder produced "
            f"{image.size[1]}x{image.size[0]}"
        )
    return image


_MODES = {1: "L", 2: "LA", 3: "RGB", 4: "RGBA"}


def _to_array(image: Any, channels: int) -> Array:
    if image.mode in ("I;16", "I;16B", "I;16L", "I") and channels == 1:
        return np.asarray(image, dtype=np.uint16)[:, :, None]
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    pixels = np.asarray(image.convert(_MODES[channels]))
    return pixels[:, :, None] if pixels.ndim == 2 else pixels


def decode_png(
    contents: Any,
    channels: int = 0,
    dtype: Any = np.uint8,
    name: str | None = None,
    *,
    max_pixels: int | None = MAX_PIXELS,
) -> Array:
    """``tf.io.decode_png``: ``(height, width, channels)``, ``uint8`` (or ``uint16`` for a
    16-bit greyscale PNG). ``channels`` 0 keeps the file's (1-4). JPEG, GIF and BMP
    bytes are decoded too, as TensorFlow's op does."""
    op = "decode_png"
    _check_channels(channels, (0, 1, 2, 3, 4), op)
    target = np.dtype(getattr(dtype, "as_numpy_dtype", dtype))
    if target not in (np.dtype(np.uint8), np.dtype(np.uint16)):
        raise InvalidArgumentError(f"{op}: dtype must be uint8 or uint16, got {target}")
    data = _bytes_of(contents, op)
    header = read_header(data, op)
    _check_pixels(header, max_pixels, op)
    if header.format == "jpeg":
        if channels in (2, 4):
            raise InvalidImageError(f"{op}: a JPEG has no alpha channel (channels={channels})")
        pixels = decode_jpeg(data, channels, max_pixels=max_pixels)
    else:
        pixels = _to_array(_pillow_decode(data, header, op), _output_channels(header, channels))
    if pixels.dtype == np.uint16 and target == np.uint8:
        return (pixels >> 8).astype(np.uint8)
    if pixels.dtype == np.uint8 and target == np.uint16:
        return pixels.astype(np.uint16) * 257
    return pixels


def decode_gif(contents: Any, name: str | None = None, *,
               max_pixels: int | None = MAX_PIXELS) -> Array:
    """``tf.io.decode_gif``: ``(frames, height, width, 3)`` uint8, every frame composed."""
    op = "decode_gif"
    data = _bytes_of(contents, op)
    header = read_header(data, op)
    _check_pixels(header, max_pixels, op)
    if header.format != "gif":
        raise InvalidImageError(f"{op}: not a GIF ({header.format.upper()})")
    image = _pillow_decode(data, header, op)
    frames = []
    try:
        for index in range(getattr(image, "n_frames", 1)):
            image.seek(index)
            frames.append(np.asarray(image.convert("RGB")))
    except Exception as error:
        raise InvalidImageError(f"{op}: corrupt GIF frame {len(frames)}: {error}") from error
    return np.stack(frames)


def decode_bmp(contents: Any, channels: int = 0, name: str | None = None, *,
               max_pixels: int | None = MAX_PIXELS) -> Array:
    """``tf.io.decode_bmp``: ``(height, width, channels)`` uint8."""
    op = "decode_bmp"
    _check_channels(channels, (0, 1, 3, 4), op)
    data = _bytes_of(contents, op)
    header = read_header(data, op)
    _check_pixels(header, max_pixels, op)
    if header.format != "bmp":
        raise InvalidImageError(f"{op}: not a BMP ({header.format.upper()})")
    return _to_array(_pillow_decode(data, header, op), _output_channels(header, channels))


def decode_image(
    contents: Any,
    channels: int | None = None,
    dtype: Any = np.uint8,
    name: str | None = None,
    expand_animations: bool = True,
    *,
    max_pixels: int | None = MAX_PIXELS,
) -> Array:
    """``tf.io.decode_image``: any of JPEG, PNG, GIF, BMP by its header.

    GIFs are ``(frames, height, width, 3)`` unless ``expand_animations=False`` (the
    first frame). A ``dtype`` other than uint8 converts with
    :func:`~headrace.image.convert_image_dtype` (floats in [0, 1]).
    """
    from headrace.image._ops import convert_image_dtype

    op = "decode_image"
    _check_channels(channels or 0, (0, 1, 3, 4), op)
    header = read_header(contents, op)
    wanted = channels or 0
    if header.format == "jpeg":
        pixels = decode_jpeg(contents, wanted, max_pixels=max_pixels)
    elif header.format == "png":
        pixels = decode_png(contents, wanted, np.uint16 if np.dtype(
            getattr(dtype, "as_numpy_dtype", dtype)) == np.uint16 else np.uint8,
            max_pixels=max_pixels)
    elif header.format == "gif":
        pixels = decode_gif(contents, max_pixels=max_pixels)
        if not expand_animations:
            pixels = pixels[0]
        if wanted == 1:
            raise InvalidImageError(f"{op}: a GIF has 3 channels, channels=1 was asked")
    else:
        pixels = decode_bmp(contents, wanted, max_pixels=max_pixels)
    converted: Array = convert_image_dtype(pixels, dtype)
    return converted

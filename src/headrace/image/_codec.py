"""Image headers and decoders: the size of a decoded image is known before its pixels exist.

Why headers first: a decoded image is 10-50x its JPEG, and a pipeline that books
memory after decoding has already spent it. :func:`read_header` parses the few
bytes that say width, height and channels (JPEG SOF, PNG IHDR, GIF screen, BMP
info header) in pure Python, so a map can book the decoded size before the
decoder runs (``map(..., output_nbytes=decoded_nbytes)``) and a decompression
bomb is refused (``max_pixels``) before anything is allocated.

Decoders. JPEG goes through headrace's C extension (``_ext/jpeg.c``, the
system's libjpeg-turbo) where it is built: it decodes straight into the array,
at a ``ratio`` too without a resample pass (1.4x faster at 1/2 than the window path
it replaces), without the GIL. Otherwise
through simplejpeg (MIT; libjpeg-turbo bundled in its
wheels): with ``fastdct=True`` and fancy upsampling both give *the same pixels*
as ``tf.io.decode_jpeg``'s defaults (all run libjpeg-turbo's fast integer
IDCT), and decode at 1/2, 1/4, 1/8 size in the DCT (``ratio``), which the
random-resized-crop path uses. PNG, GIF and BMP go through Pillow (HPND). Both
are in the ``[image]`` extra; without simplejpeg, JPEG falls back to Pillow
(pixels then differ from TensorFlow's by a few levels: Pillow uses the accurate
IDCT). benchmarks/results/decoders.md has the comparison that chose them.
"""

from __future__ import annotations

import functools
import io
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

import numpy as np

from headrace._errors import InvalidArgumentError, MemoryBudgetError
from headrace._memory.units import format_bytes
from headrace.image._native import jpeg_module

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

#: Default ``max_pixels``: 2**27, an RGB image of 384 MiB. Larger images are refused from
#: their header, before anything is allocated (a decompression bomb: a 20 KB PNG can
#: declare 50,000 x 50,000 pixels). An animated GIF's frames count together: each is a
#: whole canvas once decoded.
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

    @property
    def all_pixels(self) -> int:
        """Pixels of every frame once decoded (a GIF's frames are each a whole canvas)."""
        return self.pixels * self.frames


_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def bytes_of(contents: Any, op: str) -> bytes | memoryview:
    if isinstance(contents, bytes):
        return contents
    if isinstance(contents, bytearray | memoryview):
        return memoryview(contents)
    if isinstance(contents, np.ndarray):
        if contents.dtype == object and contents.shape == ():
            return bytes_of(contents.item(), op)
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
    data = bytes_of(contents, "is_jpeg")
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
    # a palette's tRNS chunk (before the first IDAT) makes its decode RGBA, as TensorFlow's
    position = 33
    while position + 8 <= len(data):
        (length,) = struct.unpack_from(">I", data, position)
        kind = bytes(data[position + 4 : position + 8])
        if kind == b"IDAT":
            break
        if kind == b"tRNS" and colour == 3:  # (TensorFlow adds it for a palette only)
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
    data = bytes_of(contents, op)
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


def output_channels(header: ImageHeader, channels: int) -> int:
    if channels:
        return channels
    if header.format == "jpeg":
        return 1 if header.channels == 1 else 3
    return header.channels


def check_pixels(header: ImageHeader, max_pixels: int | None, op: str,
                  frames: int = 1) -> None:
    """Refuse an image whose ``frames`` decoded frames pass ``max_pixels`` together, from
    its header: nothing is allocated yet."""
    if max_pixels is None or header.pixels * frames <= max_pixels:
        return
    size = f"{header.height}x{header.width}"
    if frames > 1:
        size = f"{frames} frames of a {size} canvas"
    raise InvalidImageError(
        f"{op}: the {header.format.upper()} header declares {size} = "
        f"{header.pixels * frames:,} pixels, more than max_pixels={max_pixels:,} "
        "(a decompression bomb?); raise max_pixels to decode it"
    )


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _says_out_of_memory(decode: Callable[_P, _R]) -> Callable[_P, _R]:
    """Make a MemoryError while decoding a :class:`MemoryBudgetError` that says what was
    being decoded and how large it is, rather than let it pass for a corrupt file."""

    @functools.wraps(decode)
    def decoding(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return decode(*args, **kwargs)
        except MemoryBudgetError:
            raise
        except MemoryError as error:
            raise _out_of_memory(decode.__name__, args[0] if args else kwargs.get("contents"),
                                 error) from error

    return decoding


def _out_of_memory(op: str, contents: Any, error: MemoryError) -> MemoryBudgetError:
    try:
        header = read_header(contents, op)
    except Exception:  # (it was read before the decode began; say what is known)
        return MemoryBudgetError(f"{op}: out of memory while decoding an image ({error})")
    frames = f"{header.frames} frames of " if header.frames > 1 else ""
    decoded = header.all_pixels * max(header.channels, 1) * (2 if header.bits > 8 else 1)
    return MemoryBudgetError(
        f"{op}: out of memory while decoding {frames}a {header.height}x{header.width} "
        f"{header.format.upper()} (up to {format_bytes(decoded)} decoded); the file is not "
        f"known to be corrupt. Lower max_pixels to refuse such images from their header, "
        f"or give the process more memory ({type(error).__name__}: {error})"
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
    if max_pixels is not None and header.all_pixels > max_pixels:
        return 0
    height, width = -(-header.height // ratio), -(-header.width // ratio)
    frames = header.frames if header.format == "gif" else 1
    itemsize = int(np.dtype(getattr(dtype, "as_numpy_dtype", dtype)).itemsize)
    return frames * height * width * output_channels(header, channels) * itemsize


def extract_jpeg_shape(contents: Any, output_type: Any = np.int32) -> Array:
    """``tf.io.extract_jpeg_shape``: ``[height, width, channels]`` from the header."""
    header = read_header(contents, "extract_jpeg_shape")
    if header.format != "jpeg":
        raise InvalidImageError(f"extract_jpeg_shape: not a JPEG ({header.format.upper()})")
    return np.array([header.height, header.width, header.channels], dtype=output_type)


def _check_channels(channels: int, allowed: tuple[int, ...], op: str) -> None:
    if channels not in allowed:
        raise InvalidArgumentError(f"{op}: channels must be one of {allowed}, got {channels!r}")


def _check_gif(header: ImageHeader, channels: int, still: bool, op: str) -> None:
    """What TensorFlow refuses of a GIF before it decodes, for every op that takes GIF
    bytes: ``channels`` other than 0 or 3 (a GIF is RGB only; it is not converted), and
    an animation where the op returns one image (``still``: decode_png, decode_jpeg)."""
    if channels not in (0, 3):
        raise InvalidImageError(
            f"{op}: a GIF decodes to 3 channels (RGB), channels={channels} was asked "
            f"(TensorFlow refuses it too)")
    if still and header.frames > 1:
        raise InvalidImageError(
            f"{op}: the GIF has {header.frames} frames; an animated GIF decodes with "
            f"decode_gif or decode_image (TensorFlow refuses it too)")


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


def native_crop_resize(
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
    apply (not built, CMYK to luma): the caller takes the Python path. A CMYK (or
    YCCK) JPEG decodes to RGB as TensorFlow's (``R = C * K // 255``), at the exact DCT
    scale, which simplejpeg cannot choose for images of a few pixels."""
    native = jpeg_module()
    channels = out.shape[2]
    if native is None or header.channels not in (1, 3, 4) or channels not in (1, 3) \
            or (header.channels == 4 and channels != 3) or ratio not in (1, 2, 4, 8):
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
    return native_crop_resize(data, header, (y, x, y + height, x + width),
                               np.empty((height, width, channels), np.uint8), ratio, False,
                               strict, op)


def _native_whole(data: bytes | memoryview, header: ImageHeader, shape: tuple[int, int, int],
                  ratio: int, strict: bool, op: str) -> Array | None:
    """The whole image at 1/ratio decoded by the C extension into a fresh uint8 array, or
    None where it does not apply (not built, a CMYK JPEG to luma). Without ``strict``
    (``try_recover_truncated``) at scale 1, the caller keeps simplejpeg's recovery."""
    native = jpeg_module()
    if native is None or header.channels not in (1, 3, 4) or shape[2] not in (1, 3) \
            or (header.channels == 4 and shape[2] != 3):
        return None
    # (an extension built from an older jpeg.c lacks decode(): its window path is exact)
    decode = getattr(native, "decode", None)
    if not strict or decode is None:  # the resample path recovers as before (one tap
        # per pixel: exact)
        return _native_window(data, header, (0, 0, shape[0], shape[1]), shape[2], ratio,
                              strict, op)
    out = np.empty(shape, np.uint8)
    try:
        done = decode(data, out, shape, ratio, strict)
    except ValueError as error:
        raise _invalid_jpeg(op, data, header, error) from error
    return out if done else None


def jpeg_pixels(  # noqa: C901
    data: bytes | memoryview,
    header: ImageHeader,
    channels: int,
    ratio: int,
    fancy_upscaling: bool,
    strict: bool,
    dct_method: str,
    op: str,
) -> Array:
    out_channels = output_channels(header, channels)
    height, width = -(-header.height // ratio), -(-header.width // ratio)
    if fancy_upscaling and dct_method != "INTEGER_ACCURATE" and (strict or ratio > 1):
        # the C extension: straight into the array (at a ratio with no resample pass),
        # and at libjpeg's scale 1/ratio as TensorFlow (simplejpeg picks a larger
        # scale for images of a few pixels)
        whole = _native_whole(data, header, (height, width, out_channels), ratio, strict, op)
        if whole is not None:
            return whole
    codec = _simplejpeg()
    if header.channels == 4:
        return _cmyk_jpeg_pixels(codec, data, header, out_channels, height, width, ratio,
                                 fancy_upscaling, strict, dct_method, op)
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


def _cmyk_jpeg_pixels(
    codec: Any, data: bytes | memoryview, header: ImageHeader, out_channels: int,
    height: int, width: int, ratio: int, fancy_upscaling: bool, strict: bool,
    dct_method: str, op: str,
) -> Array:
    """A CMYK (or YCCK) JPEG as TensorFlow decodes it: libjpeg's CMYK, then
    ``R = C * K // 255`` (and G, B from M, Y): Adobe's inverted CMYK, which every
    CMYK JPEG in practice is. RGB only: TensorFlow refuses luma (channels=1)."""
    if out_channels != 3:
        raise InvalidImageError(
            f"{op}: a CMYK JPEG decodes to RGB only (channels 0 or 3), channels="
            f"{out_channels} was asked (TensorFlow refuses it too)")
    try:
        if codec is not None:
            cmyk = codec.decode_jpeg(
                data, colorspace="CMYK", fastdct=dct_method != "INTEGER_ACCURATE",
                fastupsample=not fancy_upscaling, min_height=height if ratio > 1 else 0,
                min_width=width if ratio > 1 else 0, strict=strict)
        else:  # Pillow: its accurate IDCT, within a few levels of TensorFlow's
            image = _pillow(op).open(io.BytesIO(bytes(data)))
            if ratio > 1:
                image.draft(image.mode, (width, height))
            image.load()
            if image.size != (width, height):
                image = image.resize((width, height), _pillow(op).Resampling.BOX)
            cmyk = 255 - np.asarray(image)  # Pillow un-inverts Adobe CMYK
    except InvalidArgumentError:
        raise
    except Exception as error:
        raise _invalid_jpeg(op, data, header, error) from error
    if cmyk.shape[:2] != (height, width) or cmyk.shape[2] != 4:
        raise InvalidImageError(
            f"{op}: the JPEG header says {height}x{width}x4 at ratio {ratio}, the decoder "
            f"produced {cmyk.shape}")
    wide: Array = np.asarray(cmyk, np.uint16)
    rgb: Array = (wide[:, :, :3] * wide[:, :, 3:] // 255).astype(np.uint8)
    return rgb


@_says_out_of_memory
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
    C extension the pixels are TensorFlow's at every size, CMYK JPEGs included; without
    it only for images of at least ``8 * ratio`` pixels a side, below which several DCT
    scales give the same size and simplejpeg may take another). PNG, GIF and BMP
    bytes are decoded too, as TensorFlow's op does (a GIF of one frame only). A
    truncated JPEG raises :class:`InvalidImageError` unless ``try_recover_truncated``
    (missing rows grey).
    """
    op = "decode_jpeg"
    _check_channels(channels, (0, 1, 3), op)
    if ratio not in (1, 2, 4, 8):
        raise InvalidArgumentError(f"{op}: ratio must be 1, 2, 4 or 8, got {ratio!r}")
    data = bytes_of(contents, op)
    header = read_header(data, op)
    check_pixels(header, max_pixels, op)
    if header.format != "jpeg":
        if header.format == "gif":
            _check_gif(header, channels, True, op)
        image = decode_image(contents, channels or None, expand_animations=False,
                             max_pixels=max_pixels)
        return image
    return jpeg_pixels(
        data, header, channels, ratio, fancy_upscaling, not try_recover_truncated,
        dct_method, op,
    )


@_says_out_of_memory
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
    data = bytes_of(contents, op)
    header = read_header(data, op)
    check_pixels(header, max_pixels, op)
    y, x, height, width = window
    full_h, full_w = -(-header.height // ratio), -(-header.width // ratio)
    if y < 0 or x < 0 or height <= 0 or width <= 0 or y + height > full_h or x + width > full_w:
        raise InvalidImageError(
            f"{op}: crop window {window} is not inside the {full_h}x{full_w} image"
        )
    if (header.format == "jpeg" and fancy_upscaling and dct_method in ("", "INTEGER_FAST")
            and not try_recover_truncated):
        window_pixels = _native_window(data, header, (y, x, height, width),
                                       output_channels(header, channels), ratio, True, op)
        if window_pixels is not None:
            return window_pixels
    if header.format == "jpeg":  # (its errors then name this op, not decode_jpeg)
        image = jpeg_pixels(data, header, channels, ratio, fancy_upscaling,
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
    except MemoryError:
        raise  # not a sign of a bad file (see _says_out_of_memory)
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

# --------------------------------------------------------------------------- PNG


@dataclass(frozen=True)
class _PngFile:
    """What a PNG's chunks say before any pixel is decoded."""

    width: int
    height: int
    bits: int
    colour: int
    interlaced: bool
    palette: bytes
    transparency: bytes | None
    idat: list[bytes | memoryview]


_PNG_SAMPLES = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # samples per pixel, by colour type
_PNG_CRITICAL = (b"IHDR", b"PLTE", b"IDAT", b"IEND")


def _png_file(data: bytes | memoryview, op: str) -> _PngFile:  # noqa: C901
    """Walk a PNG's chunks (IHDR, PLTE, tRNS, the IDATs) up to IEND."""
    size = len(data)
    width, height, bits, colour = struct.unpack_from(">IIBB", data, 16)
    interlaced = data[28] == 1
    if _PNG_SAMPLES.get(colour) is None or bits not in (1, 2, 4, 8, 16) or (
            colour in (2, 4, 6) and bits < 8) or (colour == 3 and bits == 16):
        raise InvalidImageError(
            f"{op}: corrupt PNG header: bit depth {bits} with colour type {colour}")
    palette, transparency = b"", None
    idat: list[bytes | memoryview] = []
    position = 8
    while True:
        if position + 8 > size:
            raise InvalidImageError(
                f"{op}: truncated PNG: the data stops at byte {size}, inside the chunk "
                f"header at byte {position} (no IEND chunk)")
        (length,) = struct.unpack_from(">I", data, position)
        kind = bytes(data[position + 4 : position + 8])
        body = position + 8
        if body + length + 4 > size:
            raise InvalidImageError(
                f"{op}: truncated PNG: its {kind.decode('latin-1')} chunk at byte {position} "
                f"declares {length} bytes and a CRC, the data stops "
                f"{body + length + 4 - size} bytes short")
        if kind in _PNG_CRITICAL:  # libpng refuses a critical chunk whose CRC is wrong
            (crc,) = struct.unpack_from(">I", data, body + length)
            if zlib.crc32(data[body : body + length], zlib.crc32(kind)) != crc:
                raise InvalidImageError(
                    f"{op}: corrupt PNG: CRC error in its {kind.decode('latin-1')} chunk at "
                    f"byte {position}")
        if kind == b"IDAT":
            idat.append(data[body : body + length])
        elif kind == b"PLTE":
            palette = bytes(data[body : body + length])
        elif kind == b"tRNS":
            transparency = bytes(data[body : body + length])
        elif kind == b"IEND":
            break
        position = body + length + 4  # (the CRC)
    if colour == 3 and not palette:
        raise InvalidImageError(f"{op}: corrupt PNG: a palette image without a PLTE chunk")
    return _PngFile(width, height, bits, colour, interlaced, palette, transparency, idat)


def _png_raw_size(png: _PngFile) -> int:
    """Bytes of the filtered scanlines the IDAT stream must inflate to."""
    samples = _PNG_SAMPLES[png.colour] * png.bits

    def rows(width: int, height: int) -> int:
        return 0 if width == 0 or height == 0 else height * (1 + (width * samples + 7) // 8)

    if not png.interlaced:
        return rows(png.width, png.height)
    total = 0
    for y0, x0, dy, dx in ((0, 0, 8, 8), (0, 4, 8, 8), (4, 0, 8, 4), (0, 2, 4, 4),
                           (2, 0, 4, 2), (0, 1, 2, 2), (1, 0, 2, 1)):
        total += rows(max(0, -(-(png.width - x0) // dx)), max(0, -(-(png.height - y0) // dy)))
    return total


def _check_png_data(png: _PngFile, op: str) -> None:
    """The IDAT stream inflates to every scanline, as libpng requires: a PNG whose data
    stops early is an error (Pillow decodes it with the missing rows black)."""
    expected = _png_raw_size(png)
    inflater = zlib.decompressobj()
    produced = 0
    try:
        for part in png.idat:
            pending = part
            while pending and produced < expected:
                produced += len(inflater.decompress(pending, 1 << 20))
                pending = inflater.unconsumed_tail
            if produced >= expected:
                break
    except zlib.error as error:
        raise InvalidImageError(f"{op}: corrupt PNG image data (zlib: {error})") from error
    if produced < expected:
        line = 1 + (png.width * _PNG_SAMPLES[png.colour] * png.bits + 7) // 8
        where = "" if png.interlaced else f" ({produced // line} of {png.height} rows)"
        raise InvalidImageError(
            f"{op}: truncated PNG: its image data inflates to {produced:,} of the "
            f"{expected:,} bytes its {png.height}x{png.width} header needs{where}")


def _png_samples(data: bytes | memoryview, header: ImageHeader, png: _PngFile,
                 op: str) -> Array:
    """The stored samples, ``(h, w, samples)``: uint8 (greys of 1, 2 or 4 bits scaled to
    8, as libpng's expand; palette indices), or uint16 for 16-bit images."""
    if png.bits == 16 and png.colour != 0:
        # Pillow keeps only the high byte of 16-bit colour: pypng reads every bit
        try:
            import png as pypng  # type: ignore[import-untyped]
        except ImportError:
            raise InvalidArgumentError(
                f"{op}: a 16-bit colour PNG needs pypng: pip install 'headrace[image]'"
            ) from None
        try:
            width, height, rows, _ = pypng.Reader(bytes=bytes(data)).read()
            stored = np.vstack([np.asarray(row, np.uint16) for row in rows])
        except Exception as error:
            raise InvalidImageError(
                f"{op}: invalid 16-bit PNG ({len(data)} bytes, header "
                f"{header.height}x{header.width}): {error}") from error
        return stored.reshape(height, width, _PNG_SAMPLES[png.colour])
    image = _pillow_decode(data, header, op)
    if png.bits == 16:
        pixels = np.asarray(image).astype(np.uint16)
    elif png.colour == 3:
        pixels = np.asarray(image) if image.mode == "P" else np.asarray(image.convert("P"))
    elif png.colour == 0:
        pixels = np.asarray(image.convert("L") if image.mode == "1" else image)
    else:
        pixels = np.asarray(image)
    if pixels.ndim == 2:
        pixels = pixels[:, :, None]
    if pixels.shape != (png.height, png.width, _PNG_SAMPLES[png.colour]):
        raise InvalidImageError(
            f"{op}: the PNG header says {png.height}x{png.width}x"
            f"{_PNG_SAMPLES[png.colour]}, the decoder produced {pixels.shape}")
    return pixels


#: libpng's fixed-point luma weights for png_set_rgb_to_gray(..., 0.299, 0.587), as
#: TensorFlow asks them: 0.299 and 0.587 of 32768 truncated, blue the rest.
_LUMA = (9797, 19234, 32768 - 9797 - 19234)


def _png_pixels(samples: Array, png: _PngFile, channels: int, wide: bool) -> Array:  # noqa: C901
    """TensorFlow's decode_png of stored samples: libpng's transforms as TensorFlow sets
    them up (tensorflow/core/lib/png/png_io.cc), in libpng's order.

    ``channels`` 0 is the file's (a palette: RGB, RGBA with tRNS; a grey or RGB image
    with tRNS stays without alpha). Alpha, where wanted and the file has none, comes
    from tRNS, else libpng's filler ``2**bit_depth - 1`` — 3 for a 2-bit grey, as
    TensorFlow gives. Luma from colour uses libpng's weights (truncated for 8 bits,
    rounded for 16, exact greys kept). 16 bits go to 8 by their high byte; 8 to 16
    by ``v * 257``."""
    colour, bits = png.colour, png.bits
    has_trns = png.transparency is not None
    if channels == 0:
        channels = (4 if has_trns else 3) if colour == 3 else _PNG_SAMPLES[colour]
    if colour != 3 and channels == _PNG_SAMPLES[colour] and (bits == 16) == wide:
        return np.ascontiguousarray(samples)  # as stored (tRNS ignored): nothing to do
    want_alpha = channels % 2 == 0
    depth = 16 if bits == 16 else 8
    top = (1 << depth) - 1
    values = samples.astype(np.int64)
    alpha: Array | None = None
    if colour == 3:  # palette -> RGB, tRNS -> alpha per entry
        entries = np.zeros((256, 3), np.int64)
        table = np.frombuffer(png.palette[: len(png.palette) // 3 * 3], np.uint8)
        entries[: len(table) // 3] = table.reshape(-1, 3)
        index = values[:, :, 0]
        if want_alpha and has_trns:
            opacity = np.full(256, 255, np.int64)
            given = np.frombuffer(png.transparency or b"", np.uint8)[:256]
            opacity[: len(given)] = given
            alpha = opacity[index][:, :, None]
        values = entries[index]
    elif colour in (0, 2):
        if want_alpha and has_trns:
            words = np.frombuffer((png.transparency or b"")[: 2 * _PNG_SAMPLES[colour]], ">u2")
            key = words.astype(np.int64)
            if colour == 0 and bits < 8:
                key = (key & ((1 << bits) - 1)) * (255 // ((1 << bits) - 1))
            elif depth == 8:
                key = key & 0xFF
            if len(key) == _PNG_SAMPLES[colour]:
                alpha = np.where(np.all(values == key, axis=2), 0, top)[:, :, None]
            else:
                alpha = np.full((*values.shape[:2], 1), top, np.int64)
    else:  # grey+alpha, RGBA: the file's own alpha
        alpha = values[:, :, -1:] if want_alpha else None
        values = values[:, :, :-1]
    if channels < 3 and values.shape[2] == 3:  # RGB -> grey (libpng's rgb_to_gray)
        red, green, blue = values[:, :, 0], values[:, :, 1], values[:, :, 2]
        mixed = _LUMA[0] * red + _LUMA[1] * green + _LUMA[2] * blue + (16384 if depth == 16 else 0)
        grey = np.where((red == green) & (green == blue), red, mixed >> 15)
        values = grey[:, :, None]
    elif channels >= 3 and values.shape[2] == 1:  # grey -> RGB
        values = np.repeat(values, 3, axis=2)
    if depth == 16 and not wide:  # png_set_strip_16: the high byte
        values >>= 8
        alpha = None if alpha is None else alpha >> 8
        depth = 8
    if want_alpha:
        if alpha is None:  # png_set_add_alpha(2**bit_depth - 1), written in the row's depth
            alpha = np.full((*values.shape[:2], 1), ((1 << bits) - 1) & ((1 << depth) - 1),
                            np.int64)
        values = np.concatenate([values, alpha], axis=2)
    if wide and depth == 8:  # TensorFlow's 8 -> 16 bits: v * 257
        values = values * 257
    return np.ascontiguousarray(values, np.uint16 if wide else np.uint8)



def _to_array(image: Any, channels: int) -> Array:
    if image.mode in ("I;16", "I;16B", "I;16L", "I") and channels == 1:
        return np.asarray(image, dtype=np.uint16)[:, :, None]
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    pixels = np.asarray(image.convert(_MODES[channels]))
    return pixels[:, :, None] if pixels.ndim == 2 else pixels


@_says_out_of_memory
def decode_png(
    contents: Any,
    channels: int = 0,
    dtype: Any = np.uint8,
    name: str | None = None,
    *,
    max_pixels: int | None = MAX_PIXELS,
) -> Array:
    """``tf.io.decode_png``: ``(height, width, channels)`` ``uint8`` or ``uint16``, the
    pixels TensorFlow gives, bit for bit.

    ``channels`` 0 keeps the file's (a palette decodes to RGB, or RGBA with a tRNS
    chunk; a grey or RGB image with tRNS keeps 1 or 3), 1 luma, 3 RGB, 4 RGBA (2 is
    refused, as TensorFlow refuses it). ``dtype=uint16`` gives a 16-bit PNG's stored
    values and an 8-bit one's times 257; ``uint8`` a 16-bit one's high byte. Greys of 1,
    2 and 4 bits are scaled to 0-255; alpha comes from the file, else from tRNS, else
    is libpng's filler ``2**bit_depth - 1`` (TensorFlow's: 3 for a 2-bit grey). Luma
    from colour uses libpng's fixed-point weights (a file with a gAMA chunk is
    decoded without gamma: TensorFlow's libpng may apply it there). A PNG whose image
    data stops before its last row raises :class:`InvalidImageError`, as TensorFlow's
    does (Pillow alone decodes it with the missing rows black). 16-bit colour PNGs are
    read by pypng (Pillow keeps 8 of their bits): correct, some 10x slower than
    Pillow. JPEG, GIF and BMP bytes are decoded too, as TensorFlow's op does (a GIF
    of one frame with ``channels`` 0 or 3 only, a JPEG without 4)."""
    op = "decode_png"
    _check_channels(channels, (0, 1, 3, 4), op)
    target = np.dtype(getattr(dtype, "as_numpy_dtype", dtype))
    if target not in (np.dtype(np.uint8), np.dtype(np.uint16)):
        raise InvalidArgumentError(f"{op}: dtype must be uint8 or uint16, got {target}")
    data = bytes_of(contents, op)
    header = read_header(data, op)
    check_pixels(header, max_pixels, op)
    if header.format == "png":
        png = _png_file(data, op)
        _check_png_data(png, op)
        return _png_pixels(_png_samples(data, header, png, op), png, channels,
                           target == np.dtype(np.uint16))
    if header.format == "jpeg":
        if channels == 4:
            raise InvalidImageError(f"{op}: a JPEG has no alpha channel (channels={channels})")
        pixels = decode_jpeg(data, channels, max_pixels=max_pixels)
    elif header.format == "bmp":
        pixels = decode_bmp(data, channels, max_pixels=max_pixels)
    else:
        _check_gif(header, channels, True, op)
        pixels = _to_array(_pillow_decode(data, header, op), output_channels(header, channels))
    if target == np.uint16:  # TensorFlow's 8 -> 16 bits for these formats: v * 256
        return pixels.astype(np.uint16) << 8
    return pixels


@_says_out_of_memory
def decode_gif(contents: Any, name: str | None = None, *,
               max_pixels: int | None = MAX_PIXELS) -> Array:
    """``tf.io.decode_gif``: ``(frames, height, width, 3)`` uint8, every frame composed.

    Every frame is a whole canvas once decoded, so the frames count together against
    ``max_pixels``: a small file with a large canvas and many tiny frames is refused
    from its header, before any frame is decoded."""
    return _decode_gif(contents, max_pixels, "decode_gif", first_only=False)


def _decode_gif(contents: Any, max_pixels: int | None, op: str, *, first_only: bool) -> Array:
    """The frames of a GIF (only the first with ``first_only``), checked first."""
    data = bytes_of(contents, op)
    header = read_header(data, op)
    if header.format != "gif":
        raise InvalidImageError(f"{op}: not a GIF ({header.format.upper()})")
    check_pixels(header, max_pixels, op, 1 if first_only else header.frames)
    image = _pillow_decode(data, header, op)
    count = 1 if first_only else getattr(image, "n_frames", 1)
    if count > header.frames:  # the decoder found more frames than the blocks said
        check_pixels(header, max_pixels, op, count)
    frames = []
    try:
        for index in range(count):
            image.seek(index)
            frames.append(np.asarray(image.convert("RGB")))
    except MemoryError:
        raise  # not a sign of a bad file (see _says_out_of_memory)
    except Exception as error:
        raise InvalidImageError(f"{op}: corrupt GIF frame {len(frames)}: {error}") from error
    return np.stack(frames)


@_says_out_of_memory
def decode_bmp(contents: Any, channels: int = 0, name: str | None = None, *,  # noqa: C901
               max_pixels: int | None = MAX_PIXELS) -> Array:
    """``tf.io.decode_bmp``: ``(height, width, channels)`` uint8, TensorFlow's pixels.

    TensorFlow's decoder, exactly: uncompressed 8, 24 and 32 bits per pixel (the 8-bit
    bytes are the values, a palette is not applied; the 32-bit fourth byte is the
    alpha), rows bottom-up unless the height is negative, and a file whose size is not
    exactly its header plus its rows is refused (truncated, or trailing bytes).
    ``channels`` 0 keeps the file's (1, 3 or 4), 3 and 4 convert (alpha 255 where the
    file has none); 1 is refused, as TensorFlow refuses it."""
    op = "decode_bmp"
    _check_channels(channels, (0, 3, 4), op)
    data = bytes_of(contents, op)
    header = read_header(data, op)
    check_pixels(header, max_pixels, op)
    if header.format != "bmp":
        raise InvalidImageError(f"{op}: not a BMP ({header.format.upper()})")
    offset, width, height = struct.unpack_from("<iii", data, 10)[0], *struct.unpack_from(
        "<ii", data, 18)
    (bits,) = struct.unpack_from("<H", data, 28)
    stored = bits // 8
    if stored not in (1, 3, 4) or bits % 8:
        raise InvalidImageError(
            f"{op}: a BMP of {bits} bits per pixel; 8, 24 and 32 are decoded (as TensorFlow)")
    if offset < 0:
        raise InvalidImageError(f"{op}: corrupt BMP: pixel data offset {offset}")
    rows = abs(height)
    stride = (stored * width + 3) // 4 * 4
    if len(data) != offset + stride * rows:
        short = offset + stride * rows - len(data)
        raise InvalidImageError(
            f"{op}: {'truncated' if short > 0 else 'corrupt'} BMP: its header says "
            f"{rows}x{width}x{stored} from byte {offset}, {offset + stride * rows:,} bytes "
            f"in all; it has {len(data):,}")
    lines = np.frombuffer(data, np.uint8, stride * rows, offset).reshape(rows, stride)
    pixels: Array = lines[:, : width * stored].reshape(rows, width, stored)
    if height > 0:  # bottom-up
        pixels = pixels[::-1]
    if stored >= 3:  # BGR(A) -> RGB(A)
        pixels = pixels[:, :, [2, 1, 0, 3][:stored]]
    wanted = channels or stored
    if wanted != stored:
        if stored == 1:
            pixels = np.repeat(pixels, 3, axis=2)
        if wanted == 3:
            pixels = pixels[:, :, :3]
        elif pixels.shape[2] == 3:
            pixels = np.concatenate([pixels, np.full((rows, width, 1), 255, np.uint8)], axis=2)
    return np.ascontiguousarray(pixels)


@_says_out_of_memory
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
    first frame); ``channels`` 1 or 4 for a GIF raises :class:`InvalidImageError`, as
    TensorFlow's op does (a GIF is RGB only). A ``dtype`` other than uint8 converts with
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
        # TensorFlow decodes a PNG at 16 bits for any dtype but uint8
        pixels = decode_png(contents, wanted, np.uint8 if np.dtype(
            getattr(dtype, "as_numpy_dtype", dtype)) == np.uint8 else np.uint16,
            max_pixels=max_pixels)
    elif header.format == "gif":
        _check_gif(header, wanted, False, op)
        pixels = _decode_gif(contents, max_pixels, op, first_only=not expand_animations)
        if not expand_animations:
            pixels = pixels[0]
    else:
        pixels = decode_bmp(contents, wanted, max_pixels=max_pixels)
    converted: Array = convert_image_dtype(pixels, dtype)
    return converted

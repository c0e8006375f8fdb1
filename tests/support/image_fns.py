"""Image helpers shared by the image tests (module-level so worker processes can pickle them)."""

from __future__ import annotations

import io
from typing import Any

import numpy as np

import headrace.image as hi
from headrace._errors import mark_batch_row

SEED = 1234


def photo(height: int, width: int, channels: int = 3, seed: int = 0) -> np.ndarray:
    """A photo-like uint8 image: smooth colour fields, an edge, some noise (JPEG-friendly,
    yet every pixel differs)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    image = np.empty((height, width, channels), np.float32)
    for c in range(channels):
        fx, fy = rng.uniform(0.02, 0.3, 2)
        image[..., c] = 128 + 90 * np.sin(x * fx + c) * np.cos(y * fy)
    image[: height // 2, : width // 3] = rng.uniform(0, 255, channels)
    image += rng.normal(0, 8, image.shape)
    return np.clip(image, 0, 255).astype(np.uint8)


def encode(image: np.ndarray, fmt: str = "JPEG", **options: Any) -> bytes:
    from PIL import Image, ImageFile

    pixels = image[..., 0] if image.shape[-1] == 1 else image
    buffer = io.BytesIO()
    # a progressive JPEG that outgrows Pillow's guess of its size (width x height bytes:
    # small noisy images do) needs a file descriptor ("broken data stream") unless the
    # encoder's block holds the whole file
    ImageFile.MAXBLOCK = max(ImageFile.MAXBLOCK, 2 * image.size + (1 << 16))
    Image.fromarray(pixels).save(buffer, fmt, **options)
    return buffer.getvalue()


def jpeg(height: int, width: int, seed: int = 0, quality: int = 90) -> bytes:
    return encode(photo(height, width, 3, seed), "JPEG", quality=quality)


def augment(index: int, contents: bytes) -> np.ndarray:
    """The training augmentation of the tests: Inception crop from the header, flip, [0, 1]."""
    seed = (SEED, index)
    image = hi.random_resized_crop(contents, (24, 24), seed=seed)
    image = hi.random_flip_left_right(image, seed=seed)
    return image / np.float32(255)


def drain(ds: Any, errors: type[BaseException] = hi.InvalidImageError) -> tuple[
    list[Any], list[BaseException]
]:
    """Every output of ``ds`` in order, and the ``errors`` raised in elements' places
    (the iteration goes on after each, as in tf.data)."""
    outputs: list[Any] = []
    raised: list[BaseException] = []
    with iter(ds) as iterator:
        while True:
            try:
                outputs.append(next(iterator))
            except StopIteration:
                return outputs, raised
            except errors as error:
                raised.append(error)


def decode_rgb(contents: bytes) -> np.ndarray:
    return hi.decode_jpeg(contents, channels=3)


def rgb_nbytes(contents: bytes) -> int:
    return hi.decoded_nbytes(contents, channels=3)


#: The decodes the provenance tests draw, by name: each takes the encoded bytes (an
#: InceptionCrop takes (index, bytes)); small limits so that a "bomb" is cheap to make.
PROVENANCE_MAX_PIXELS = 40_000


def op_decode_image(contents: bytes) -> np.ndarray:
    return hi.decode_image(contents, channels=3, max_pixels=PROVENANCE_MAX_PIXELS)


def op_decode_jpeg(contents: bytes) -> np.ndarray:
    return hi.decode_jpeg(contents, channels=3, max_pixels=PROVENANCE_MAX_PIXELS)


def op_decode_and_crop(contents: bytes) -> np.ndarray:
    header = hi.read_header(contents)
    height, width = header.height, header.width
    window = [height // 4, width // 4, max(1, height // 2), max(1, width // 2)]
    return hi.decode_and_crop_jpeg(contents, window, channels=3,
                                   max_pixels=PROVENANCE_MAX_PIXELS)


def op_random_resized_crop(contents: bytes) -> np.ndarray:
    return hi.random_resized_crop(contents, (16, 16), seed=(7, 11),
                                  max_pixels=PROVENANCE_MAX_PIXELS)


INCEPTION = hi.InceptionCrop((16, 16), seed=5, max_pixels=PROVENANCE_MAX_PIXELS)

PROVENANCE_OPS = {
    "decode_image": op_decode_image,
    "decode_jpeg": op_decode_jpeg,
    "decode_and_crop_jpeg": op_decode_and_crop,
    "random_resized_crop": op_random_resized_crop,
}


class BatchedOp:
    """One of the decodes above over a whole batch of encoded images, as a user's batched
    function is written: a loop over the rows. On a failing row it says which
    (``mark``: :func:`headrace._errors.mark_batch_row`, so the map names that row's
    record) and, for the test, which bytes failed (``failed_record``). Picklable, for
    worker processes."""

    def __init__(self, op_name: str, mark: bool) -> None:
        self.op_name, self.mark = op_name, mark

    def __call__(self, records: Any) -> np.ndarray:
        op = PROVENANCE_OPS[self.op_name]
        out = []
        for row, record in enumerate(records):
            try:
                out.append(op(record))
            except ValueError as error:
                error.failed_record = record  # type: ignore[attr-defined]
                if self.mark:
                    mark_batch_row(error, row)
                raise
        return np.asarray([image.size for image in out], np.int64)


# --------------------------------------------------------------------------- encoders
# PNGs and BMPs written byte by byte, so that the tests draw every bit depth, colour type
# and tRNS chunk the formats allow (Pillow writes few of them: no 16-bit colour, no grey
# of 2 or 4 bits, no tRNS for RGB).

PNG_SAMPLES = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}
PNG_DEPTHS = {0: (1, 2, 4, 8, 16), 2: (8, 16), 3: (1, 2, 4, 8), 4: (8, 16), 6: (8, 16)}


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    import struct
    import zlib

    return (struct.pack(">I", len(body)) + kind + body
            + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF))


def _png_row(samples: np.ndarray, bits: int) -> bytes:
    if bits == 16:
        return samples.astype(">u2").tobytes()
    if bits == 8:
        return samples.astype(np.uint8).tobytes()
    per_byte = 8 // bits
    flat = samples.reshape(-1).astype(np.uint8)
    flat = np.concatenate([flat, np.zeros(-len(flat) % per_byte, np.uint8)])
    shifts = (8 - bits * (np.arange(per_byte) + 1)).astype(np.uint8)
    return (flat.reshape(-1, per_byte) << shifts).sum(axis=1).astype(np.uint8).tobytes()


def write_png(samples: np.ndarray, bits: int, colour: int, *, palette: np.ndarray | None = None,
              transparency: bytes | None = None, rows: int | None = None,
              filters: np.ndarray | None = None) -> bytes:
    """A PNG of ``samples`` (h, w, samples per pixel) as stored: ``rows`` keeps only the
    first rows of image data (a file whose data stops early, yet well-formed);
    ``filters`` 0 (None) or 2 (Up) per row."""
    import struct
    import zlib

    height, width = samples.shape[:2]
    out = b"\x89PNG\r\n\x1a\n" + _png_chunk(
        b"IHDR", struct.pack(">IIBBBBB", width, height, bits, colour, 0, 0, 0))
    if palette is not None:
        out += _png_chunk(b"PLTE", palette.astype(np.uint8).tobytes())
    if transparency is not None:
        out += _png_chunk(b"tRNS", transparency)
    raw = [_png_row(samples[y], bits) for y in range(height)][:rows]
    lines = []
    for y, line in enumerate(raw):
        kind = 0 if filters is None or y == 0 else int(filters[y])
        if kind == 2:  # Up: the difference from the row above
            above = np.frombuffer(raw[y - 1], np.uint8)
            line = ((np.frombuffer(line, np.uint8).astype(np.int16) - above) % 256).astype(
                np.uint8).tobytes()
        lines.append(bytes([kind]) + line)
    out += _png_chunk(b"IDAT", zlib.compress(b"".join(lines)))
    return out + _png_chunk(b"IEND", b"")


def random_png(rng: np.random.Generator, max_side: int = 12) -> tuple[bytes, dict[str, Any]]:
    """A PNG of a random colour type, bit depth, size, palette and tRNS chunk."""
    import struct

    colour = int(rng.choice(list(PNG_DEPTHS)))
    bits = int(rng.choice(PNG_DEPTHS[colour]))
    height, width = (int(v) for v in rng.integers(1, max_side + 1, 2))
    palette = transparency = None
    if colour == 3:
        entries = int(rng.integers(1, min(256, 1 << bits) + 1))
        samples = rng.integers(0, entries, (height, width, 1))
        palette = rng.integers(0, 256, (entries, 3))
        if rng.random() < 0.5:
            transparency = rng.integers(0, 256, int(rng.integers(1, entries + 1))).astype(
                np.uint8).tobytes()
    else:
        top = 1 << bits
        samples = rng.integers(0, top, (height, width, PNG_SAMPLES[colour]))
        if rng.random() < 0.3:  # few levels: the tRNS colour and exact greys occur
            samples = samples % 3 * (top - 1) // 2
        if colour in (0, 2) and rng.random() < 0.5:
            key = samples[int(rng.integers(height)), int(rng.integers(width))]
            if rng.random() < 0.3:
                key = rng.integers(0, top, PNG_SAMPLES[colour])
            transparency = b"".join(struct.pack(">H", int(v)) for v in key)
    filters = rng.choice([0, 2], height) if rng.random() < 0.5 else None
    data = write_png(samples, bits, colour, palette=palette, transparency=transparency,
                     filters=filters)
    return data, {"colour": colour, "bits": bits, "trns": transparency is not None,
                  "size": (height, width)}


def write_bmp(pixels: np.ndarray, *, top_down: bool = False) -> bytes:
    """An uncompressed BMP of ``pixels`` (h, w, 1 | 3 | 4) RGB(A) (1: the bytes, with a grey
    palette), rows padded to 4 bytes, bottom-up unless ``top_down``."""
    import struct

    height, width, stored = pixels.shape
    stride = (stored * width + 3) // 4 * 4
    palette = bytes(np.repeat(np.arange(256, dtype=np.uint8), 4)) if stored == 1 else b""
    offset = 14 + 40 + len(palette)
    body = pixels[:, :, [2, 1, 0, 3][:stored]] if stored >= 3 else pixels
    rows = [np.pad(body[y].reshape(-1), (0, stride - width * stored)).tobytes()
            for y in range(height)]
    if not top_down:
        rows.reverse()
    image = b"".join(rows)
    info = struct.pack("<IiiHHIIiiII", 40, width, -height if top_down else height, 1,
                       8 * stored, 0, len(image), 2835, 2835, 256 if stored == 1 else 0, 0)
    return (b"BM" + struct.pack("<IHHI", offset + len(image), 0, 0, offset) + info + palette
            + image)


# --------------------------------------------------------------------------- int seeds
# Map functions with tf.image's random ops seeded by an int, as a tf.data user writes
# them (module level: worker processes pickle them).


def flip_crop(image: np.ndarray) -> np.ndarray:
    image = hi.random_flip_left_right(image, seed=42)
    image = hi.random_flip_up_down(image, seed=43)
    return hi.random_crop(image, (5, 5, 3), seed=44)


def colour_jitter(image: np.ndarray) -> np.ndarray:
    image = hi.random_brightness(image.astype(np.float32), 0.4, seed=7)
    return hi.random_contrast(image, 0.5, 1.5, seed=8)


def inception_box(image: np.ndarray) -> np.ndarray:
    box = hi.random_resized_crop_box(image.shape[0], image.shape[1], seed=9)
    begin, size, _ = hi.sample_distorted_bounding_box(
        image.shape, [[[0.1, 0.1, 0.9, 0.9]]], seed=10, min_object_covered=0.2)
    crop = hi.random_resized_crop(image, (4, 4), seed=11)
    return np.concatenate([np.asarray(box, np.float32), begin.astype(np.float32),
                           size.astype(np.float32), crop.reshape(-1)])


def labelled_flip(image: np.ndarray, label: Any) -> tuple[np.ndarray, Any]:
    return hi.random_flip_left_right(image, seed=5), label


SEEDED_AUGMENTATIONS = {"flip_crop": flip_crop, "colour_jitter": colour_jitter,
                        "inception_box": inception_box}

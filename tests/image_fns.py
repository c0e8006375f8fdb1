"""Image helpers shared by the image tests (module-level so worker processes can pickle them)."""

from __future__ import annotations

import io
from typing import Any

import numpy as np

import headrace.image as hi
from headrace.errors import mark_batch_row

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
    (``mark``: :func:`headrace.errors.mark_batch_row`, so the map names that row's
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

"""Decoders count what they will allocate (G1): tiny files that declare huge images are
refused from their headers, before any pixel exists, and running out of memory while
decoding is said as such, never as a corrupt file.

The files come from seeded generators (GIFs of a large canvas and many one-pixel
frames, PNGs whose IHDR declares a huge image). The oracle for the GIFs that are
decoded is the same file decoded without a pixel limit.
"""

from __future__ import annotations

import inspect
import json
import os
import random
import struct
import subprocess
import sys
import textwrap
import tracemalloc
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import headrace.image as im
from headrace.image import InvalidImageError

pytest.importorskip("PIL")

SRC_DIR = Path(im.__file__).resolve().parents[2]  # the headrace this test imported
MiB = 1 << 20

def gif(width: int, height: int, frames: int, seed: int = 0) -> bytes:
    """A GIF89a of a width x height canvas (a 2-colour global palette) and ``frames``
    frames of one pixel each, placed along the first row."""
    out = bytearray(b"GIF89a" + struct.pack("<HHBBB", width, height, 0x80, 0, 0))
    out += b"\x00\x00\x00\xff\xff\xff"
    for index in range(frames):
        x = (index * 7 + seed) % width
        # LZW, minimum code size 2: clear (4), colour (index % 2), end (5), in 3-bit codes
        colour = index % 2
        first = 4 | colour << 3 | (5 & 3) << 6
        out += b"\x2c" + struct.pack("<HHHHB", x, 0, 1, 1, 0) + bytes([2, 2, first, 1, 0])
    return bytes(out + b"\x3b")


def png_header_only(width: int, height: int, colour: int, bits: int) -> bytes:
    """A PNG whose IHDR declares width x height, with one tiny IDAT (a bomb's shape: the
    pixels a real bomb would inflate to are never needed to refuse it)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(
            ">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, bits, colour, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
            + chunk(b"IEND", b""))


def heap_peak(action: Callable[[], Any]) -> tuple[Any, int]:
    """``action()`` (or the exception it raised) and the Python heap's peak growth
    (NumPy's arrays are traced too)."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        try:
            result: Any = action()
        except Exception as error:  # returned for the caller to check
            result = error
        return result, tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("seed", range(12))
def test_an_animated_gif_counts_every_frame_against_max_pixels(seed: int) -> None:
    rng = random.Random(seed)
    width, height = rng.randrange(200, 1000), rng.randrange(200, 1000)
    frames = rng.randrange(2, 60)
    data = gif(width, height, frames, seed)
    canvas = width * height
    # Each frame alone passes; all of them together do not.
    max_pixels = rng.randrange(canvas, canvas * frames)

    for decode in (lambda: im.decode_gif(data, max_pixels=max_pixels),
                   lambda: im.decode_image(data, max_pixels=max_pixels)):
        error, peak = heap_peak(decode)
        assert isinstance(error, InvalidImageError), (seed, type(error))
        message = str(error)
        assert f"{frames} frames of a {height}x{width} canvas" in message
        assert f"max_pixels={max_pixels:,}" in message
        assert "corrupt" not in message
        assert peak < MiB  # refused from the header: no frame was decoded
    assert im.decoded_nbytes(data, max_pixels=max_pixels) == 0  # (nothing to book)

    # The first frame alone is within max_pixels: decode_image(expand_animations=False)
    # decodes it and nothing more, as the oracle's first frame.
    first, peak = heap_peak(
        lambda: im.decode_image(data, expand_animations=False, max_pixels=max_pixels))
    assert isinstance(first, np.ndarray)
    assert peak < 4 * canvas * 3 + MiB  # about one frame, not all of them
    if frames * canvas <= 8_000_000:  # the oracle decodes small ones
        oracle = im.decode_gif(data, max_pixels=None)
        assert oracle.shape == (frames, height, width, 3)
        np.testing.assert_array_equal(first, oracle[0])


@pytest.mark.parametrize("seed", range(8))
def test_a_gif_within_max_pixels_decodes_every_frame(seed: int) -> None:
    rng = random.Random(1000 + seed)
    width, height, frames = rng.randrange(1, 40), rng.randrange(1, 40), rng.randrange(1, 30)
    data = gif(width, height, frames, seed)
    decoded = im.decode_gif(data, max_pixels=width * height * frames)
    assert decoded.shape == (frames, height, width, 3)
    assert im.decoded_nbytes(data, max_pixels=width * height * frames) == decoded.nbytes
    np.testing.assert_array_equal(decoded, im.decode_gif(data, max_pixels=None))


@pytest.mark.parametrize("seed", range(10))
def test_a_png_bomb_is_refused_from_its_header(seed: int) -> None:
    rng = random.Random(2000 + seed)
    colour, bits = rng.choice([(0, 8), (0, 16), (2, 8), (2, 16), (3, 8), (4, 8), (6, 8),
                               (6, 16)])
    width, height = rng.randrange(12_000, 1 << 20), rng.randrange(12_000, 1 << 20)
    data = png_header_only(width, height, colour, bits)
    assert len(data) < 200
    for decode in (im.decode_png, im.decode_image):
        error, peak = heap_peak(lambda decode=decode: decode(data))  # type: ignore[misc]
        assert isinstance(error, InvalidImageError), type(error)
        assert f"declares {height}x{width} = {width * height:,} pixels" in str(error)
        assert peak < MiB


OUT_OF_MEMORY_CHILD = """
    import json, resource, struct, sys, zlib
    import numpy as np
    import headrace.image as im
    from headrace._errors import MemoryBudgetError
    {gif_writer}
    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(
            ">I", zlib.crc32(kind + body))
    side = 3000  # an RGB PNG of zeros: 27 MB once decoded
    png = (b"\\x89PNG\\r\\n\\x1a\\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 8, 2,
                                                                   0, 0, 0))
           + chunk(b"IDAT", zlib.compress(bytes(side * (1 + 3 * side)), 1))
           + chunk(b"IEND", b""))
    files = {{"gif": gif(3000, 3000, 60), "png": png}}
    with open("/proc/self/statm") as statm:
        mapped = int(statm.read().split()[0]) * 4096
    resource.setrlimit(resource.RLIMIT_AS, (mapped + 20 * 2**20, resource.RLIM_INFINITY))
    results = {{}}
    for name, data in files.items():
        for op in ("decode_" + name, "decode_image"):
            try:
                getattr(im, op)(data, max_pixels=None)
                results[name + " " + op] = ["decoded", ""]
            except Exception as error:
                results[name + " " + op] = [type(error).__name__, str(error)]
    print(json.dumps(results))
"""


def test_running_out_of_memory_while_decoding_is_not_called_corrupt() -> None:
    """A decode that the process cannot allocate (here: an address-space limit) raises
    MemoryBudgetError saying so, and names the image's size."""
    script = textwrap.dedent(OUT_OF_MEMORY_CHILD).format(gif_writer=inspect.getsource(gif))
    completed = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": str(SRC_DIR)}, timeout=120, check=False)
    assert completed.returncode == 0, completed.stderr[-3000:]
    results = json.loads(completed.stdout.strip().splitlines()[-1])
    assert len(results) == 4
    for case, (kind, message) in results.items():
        assert kind == "MemoryBudgetError", (case, kind, message)
        assert "out of memory while decoding" in message, (case, message)
        assert "corrupt" not in message.replace("not known to be corrupt", ""), (case, message)
    assert "60 frames of a 3000x3000 GIF" in results["gif decode_gif"][1]
    assert "a 3000x3000 PNG" in results["png decode_png"][1]

"""The HTML report as a user sees it: opened in headless Chromium, offline.

``scripts/install_chromium.sh`` (run by ``scripts/test.sh``) installs the
browser; without it this test fails, saying so — it never skips.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import numpy as np

import headrace as hr
from headrace.profiling.profiler import profile


def _browser() -> str:
    for name in ("chromium-headless-shell", "chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    raise AssertionError("no headless Chromium: run scripts/install_chromium.sh")


def _decode_png(data: bytes) -> tuple[int, int, np.ndarray]:
    """(width, height, RGB pixels) of an 8-bit RGB/RGBA PNG (what Chromium writes)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    position, chunks, header = 8, [], b""
    while position < len(data):
        (length,) = struct.unpack(">I", data[position : position + 4])
        kind = data[position + 4 : position + 8]
        body = data[position + 8 : position + 8 + length]
        if kind == b"IHDR":
            header = body
        elif kind == b"IDAT":
            chunks.append(body)
        position += 12 + length
    width, height, depth, color = struct.unpack(">IIBB", header[:10])
    assert depth == 8 and color in (2, 6), (depth, color)
    channels = 3 if color == 2 else 4
    raw = zlib.decompress(b"".join(chunks))
    stride = width * channels
    rows = np.zeros((height, stride), np.int32)
    previous = np.zeros(stride, np.int32)
    for y in range(height):
        start = y * (stride + 1)
        kind = raw[start]
        line = np.frombuffer(raw, np.uint8, stride, start + 1).astype(np.int32)
        out = np.zeros(stride, np.int32)
        for x in range(stride):  # PNG filters, byte by byte (small images only)
            left = out[x - channels] if x >= channels else 0
            up = previous[x]
            corner = previous[x - channels] if x >= channels else 0
            if kind == 0:
                predicted = 0
            elif kind == 1:
                predicted = left
            elif kind == 2:
                predicted = up
            elif kind == 3:
                predicted = (left + up) // 2
            else:
                p = left + up - corner
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                predicted = left if pa <= pb and pa <= pc else up if pb <= pc else corner
            out[x] = (line[x] + predicted) & 0xFF
        rows[y] = previous = out
    pixels = rows.reshape(height, width, channels)[:, :, :3]
    return width, height, pixels


def _open_in_chromium(page: Path, height: int) -> tuple[str, np.ndarray]:
    """The DOM Chromium parsed from ``page`` (after checking its console stayed clean) and a
    900 x ``height`` screenshot's RGB pixels."""
    url = page.as_uri()
    common = [_browser(), "--no-sandbox", "--disable-gpu", "--headless", "--hide-scrollbars",
              "--enable-logging=stderr", "--v=0"]
    dom = subprocess.run(
        [*common, "--dump-dom", url], capture_output=True, text=True, timeout=120, check=True
    )
    console = [line for line in dom.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert not console, console  # no console errors (there is no script to fail)
    shot = page.parent / f"{page.stem}.png"
    subprocess.run(
        [*common, f"--screenshot={shot}", f"--window-size=900,{height}", url],
        capture_output=True, text=True, timeout=120, check=True,
    )
    width, shot_height, pixels = _decode_png(shot.read_bytes())
    assert (width, shot_height) == (900, height)
    return dom.stdout, pixels


def _coloured(pixels: np.ndarray) -> int:
    """Pixels far from grey: what the charts drew in colour."""
    spread = pixels.max(axis=2) - pixels.min(axis=2)
    return int((spread > 60).sum())


def test_report_renders_in_headless_chromium(tmp_path: Path) -> None:
    ds = (
        hr.Dataset.from_generator(
            lambda: (np.full(256, i, np.float32) for i in range(4000)),
            output_signature=hr.TensorSpec((256,), np.float32),
        )
        .map(lambda r: r * 2, num_parallel_calls=2)
        .shuffle(1000, seed=0)
        .batch(16)
        .prefetch(hr.AUTOTUNE)
        .with_options(hr.Options(memory_budget="2MiB"))
    )
    report = profile(ds, epochs=2, interval=0.002, progress=False).write_html(
        str(tmp_path / "report.html")
    )
    dom, pixels = _open_in_chromium(Path(report), 560)
    # the browser parsed every chart and its parts
    assert dom.count("<svg") == 3
    for marker in ('id="memory-chart"', 'class="stage-area"', 'class="budget-line"',
                   'class="measured-line"', 'class="throughput-line"', 'class="time-bar"',
                   'id="stages"', 'id="decisions"'):
        assert marker in dom, marker
    # A screenshot of the first chart: not blank, and the stacked areas drew in colour.
    coloured = _coloured(pixels)
    assert coloured > 2000, f"only {coloured} coloured pixels: the charts did not draw"
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 20  # not a blank page


def test_doctor_page_renders_in_headless_chromium(tmp_path: Path) -> None:
    from headrace.cli import main

    module = tmp_path / "doctor_pipeline.py"
    module.write_text(
        "import numpy as np\nimport headrace as hr\nKEPT = []\n"
        "def keep(r):\n    KEPT.append(np.ones(1024))\n    return r\n"
        "def leaky():\n    return (hr.Dataset.range(200).map(keep)"
        ".map(lambda i: np.full(256, i)).shuffle(50, seed=0).batch(8))\n"
    )
    page = tmp_path / "doctor.html"
    assert main(["doctor", f"{module}:leaky", "--epochs", "7", "--html", str(page)]) == 1
    text = page.read_text()
    assert text.startswith("<!DOCTYPE html>") and "<script" not in text
    assert "https://" not in text and "http://" not in text.replace(
        'xmlns="http://www.w3.org/2000/svg"', "")
    dom, pixels = _open_in_chromium(page, 600)
    assert dom.count("<svg") == 2
    for marker in ('id="epoch-chart"', 'class="epoch-line"', 'class="trend-line"',
                   'class="warmup"', 'id="stage-chart"', 'class="stage-line"', 'id="growth"',
                   'id="epochs"', "LEAK"):
        assert marker in dom, marker
    # the verdict names the stage and who keeps the memory
    assert "map(_headrace_target.keep)" in dom and "kept in KEPT" in dom
    coloured = _coloured(pixels)
    assert coloured > 1500, f"only {coloured} coloured pixels: the charts did not draw"
    # a clean pipeline's page says so, and shows no growth table
    clean = hr.Dataset.range(200).map(lambda i: np.full(256, i)).batch(8).prefetch(1)
    from headrace.profiling import diagnose

    healthy = diagnose(clean, epochs=6).to_html()
    assert "No leak" in healthy and 'id="growth"' not in healthy

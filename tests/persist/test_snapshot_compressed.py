"""Compressed snapshots (GZIP, ZLIB, SNAPPY): written as compressed blocks, still read by
positioned reads; readers detect the compression from the manifest and check every block
before using it; a corrupted block is a DataLossError naming the file and its offset."""

from __future__ import annotations

import json
import random
import struct
import sys
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.persist.test_cache import Counted, ids

import headrace as hr
from headrace.core.state import seal
from headrace.io._crc32c import masked_crc32c
from headrace.io.tfrecord_index import build_index, index_path_for, load_index

CODECS = ("GZIP", "ZLIB", "SNAPPY")


def _element(i: Any, sizes: list[int]) -> dict[str, Any]:
    index = int(i)
    return {"x": np.full(sizes[index], index % 251, np.uint8), "i": np.int64(index)}


def _dataset(sizes: list[int], path: Path, compression: str | None) -> hr.Dataset:
    return hr.Dataset.range(len(sizes)).map(lambda i: _element(i, sizes)).snapshot(
        path, compression=compression
    )


def _files(path: Path) -> tuple[Path, dict[str, Any]]:
    (data,) = path.glob("*/snapshot.hrcache")
    manifest = json.loads(Path(f"{data}.json").read_text())
    return data, manifest


def _check(
    elements: list[dict[str, Any]], sizes: list[int], start: int = 0, *, read: bool = True
) -> None:
    assert [int(e["i"]) for e in elements] == list(range(start, len(sizes)))
    for e in elements:
        i = int(e["i"])
        assert e["x"].shape == (sizes[i],)
        assert not (read and e["x"].flags.writeable)  # read back: read-only views (G5)
        assert (e["x"] == i % 251).all()


@settings(max_examples=15, deadline=None, derandomize=True)
@given(
    compression=st.sampled_from(CODECS),
    sizes=st.lists(
        st.one_of(st.integers(0, 3000), st.integers(100_000, 600_000)), min_size=1, max_size=80
    ),
    budget_mib=st.sampled_from((4, 16)),
    resume_at=st.floats(0, 1),
)
def test_compressed_snapshots_read_back_exactly_and_resume_anywhere(
    tmp_path_factory: pytest.TempPathFactory,
    compression: str,
    sizes: list[int],
    budget_mib: int,
    resume_at: float,
) -> None:
    path = tmp_path_factory.mktemp("snap")
    options = hr.Options(memory_budget=budget_mib << 20)
    ds = _dataset(sizes, path, compression).with_options(options)
    _check(list(ds), sizes, read=False)  # writes it, passing the map's elements on
    data, manifest = _files(path)
    assert manifest["compression"] == compression
    blocks = manifest["blocks"]
    assert sum(n for n, _ in blocks) == len(sizes)
    assert len(load_index(data).offsets) == len(blocks)
    # a pipeline asking for no compression detects the compressed snapshot and reads it
    plain = _dataset(sizes, path, None).with_options(options)
    _check(list(plain), sizes)
    assert data.stat().st_size < sum(sizes) // 4 + 200 * len(sizes) + 4096  # compressed
    position = int(resume_at * len(sizes))
    with iter(plain) as iterator:
        for _ in range(position):
            next(iterator)
        state = iterator.get_state()
        assert iterator.context.budget.peak <= budget_mib << 20
    with iter(plain) as resumed:
        resumed.set_state(state)
        _check(list(resumed), sizes, start=position)


@pytest.mark.parametrize("compression", CODECS)
def test_the_source_is_not_read_again_and_the_file_is_blocks(
    tmp_path: Path, compression: str
) -> None:
    source = Counted(50, nbytes=4096)
    ds = source.dataset().snapshot(tmp_path, compression=compression)
    assert ids(ds) == list(range(50)) and ids(ds) == list(range(50))
    assert source.produced == 50
    data, manifest = _files(tmp_path)
    # every block is one TFRecord record (the file stays a valid TFRecord file)
    assert [len(bytes(r)) > 0 for r in hr.TFRecordDataset(str(data))] == [True] * len(
        manifest["blocks"]
    )


@settings(max_examples=25, deadline=None, derandomize=True)
@given(compression=st.sampled_from(CODECS), seed=st.integers(0, 2**32 - 1))
def test_any_flipped_byte_is_found_in_its_block_named_by_file_and_offset(
    tmp_path_factory: pytest.TempPathFactory, compression: str, seed: int
) -> None:
    rng = random.Random(seed)
    sizes = [rng.choice((10, 500, 70_000, 300_000)) for _ in range(rng.randint(1, 40))]
    path = tmp_path_factory.mktemp("snap")
    ds = _dataset(sizes, path, compression).with_options(hr.Options(memory_budget="8MiB"))
    list(ds)
    data, _ = _files(path)
    raw = bytearray(data.read_bytes())
    at = rng.randrange(len(raw))
    raw[at] ^= 1 << rng.randrange(8)
    data.write_bytes(bytes(raw))
    offsets = [int(o) for o in load_index(data, size_only=True).offsets]
    block = max(o for o in offsets if o <= at)
    with pytest.raises(hr.DataLossError) as caught:
        list(ds)
    error = caught.value
    assert error.path == str(data) and error.offset == block
    assert f"at offset {block} in file {data}" in str(error)


def _rewrite_block(data: Path, block: int, payload: bytes) -> None:
    """Replace block ``block`` with a correctly framed ``payload`` (CRCs valid) of the
    same length, so only the codec's checks can find it."""
    raw = bytearray(data.read_bytes())
    offset = int(load_index(data, size_only=True).offsets[block])
    (length,) = struct.unpack_from("<Q", raw, offset)
    assert len(payload) == length
    raw[offset + 12 : offset + 12 + length] = payload
    struct.pack_into("<I", raw, offset + 12 + length, masked_crc32c(payload))
    data.write_bytes(bytes(raw))  # same size: the index still holds
    _record_checksums(data)


def _record_checksums(data: Path) -> None:
    """Record the file's blocks as its writer would have (``.crc`` and the manifest's
    digest of it): a writer that wrote bad blocks, not a file swapped afterwards, so
    that the codec's checks are the ones that must find them."""
    raw = data.read_bytes()
    offsets = [int(o) for o in load_index(data, size_only=True).offsets] + [len(raw)]
    crcs = b"".join(raw[end - 4 : end] for end in offsets[1:])
    Path(f"{data}.crc").write_bytes(crcs)
    manifest = json.loads(Path(f"{data}.json").read_text())
    manifest["checksums"] = xxhash.xxh3_128_hexdigest(crcs)
    Path(f"{data}.json").write_text(json.dumps(seal(manifest)))


def _block(data: Path, block: int) -> bytes:
    raw = data.read_bytes()
    offset = int(load_index(data, size_only=True).offsets[block])
    (length,) = struct.unpack_from("<Q", raw, offset)
    return raw[offset + 12 : offset + 12 + length]


@pytest.mark.parametrize("compression", CODECS)
def test_blocks_with_valid_crcs_are_still_checked_by_their_codec(
    tmp_path: Path, compression: str
) -> None:
    sizes = [2000] * 30
    ds = _dataset(sizes, tmp_path, compression)
    list(ds)
    data, manifest = _files(tmp_path)
    original = _block(data, 0)
    offset = int(load_index(data, size_only=True).offsets[0])
    # garbage after the codec's magic bytes: it does not decompress
    _rewrite_block(data, 0, original[:12] + bytes(len(original) - 12))
    with pytest.raises(hr.DataLossError, match=f"corrupted {compression} block does not "
                       f"decompress .* at offset {offset} in file {data}"):
        list(ds)
    # not this codec's bytes at all
    _rewrite_block(data, 0, b"\x00" * len(original))
    with pytest.raises(hr.DataLossError, match=f"not a {compression} block .* at offset {offset}"):
        list(ds)
    # a manifest (sealed, as a faulty writer would) that lies about the decompressed
    # size: bounded before allocation
    _rewrite_block(data, 0, original)
    _, manifest = _files(tmp_path)
    manifest["blocks"][0][1] -= 1
    Path(f"{data}.json").write_text(json.dumps(seal(manifest)))
    with pytest.raises(hr.DataLossError, match=f"{compression} block (decompresses to|does "
                       f"not decompress).* at offset {offset} in file {data}"):
        list(ds)


def test_a_corrupted_record_inside_a_block_says_the_offset_counts_decompressed(
    tmp_path: Path,
) -> None:
    ds = _dataset([100] * 20, tmp_path, "ZLIB")
    list(ds)
    data, manifest = _files(tmp_path)
    framed = bytearray(zlib.decompress(_block(data, 0)))
    framed[40] ^= 0xFF  # inside the first record's payload
    _rewrite_block_any_length(data, manifest, zlib.compress(bytes(framed)))
    offset = int(load_index(data, size_only=True).offsets[0])
    with pytest.raises(hr.DataLossError, match=f"ZLIB block at offset {offset}, decompressed"):
        list(ds)


def _rewrite_block_any_length(data: Path, manifest: dict[str, Any], payload: bytes) -> None:
    """A one-block file holding ``payload`` (framed, CRCs valid), manifest updated."""
    assert len(manifest["blocks"]) == 1
    header = struct.pack("<Q", len(payload))
    framed = header + struct.pack("<I", masked_crc32c(header)) + payload
    framed += struct.pack("<I", masked_crc32c(payload))
    data.write_bytes(framed)
    manifest["bytes"] = len(framed)
    Path(f"{data}.json").write_text(json.dumps(seal(manifest)))
    Path(index_path_for(data)).unlink()
    build_index(data)
    _record_checksums(data)


def test_snappy_without_cramjam_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    list(_dataset([10] * 5, tmp_path, "SNAPPY"))
    monkeypatch.setitem(sys.modules, "cramjam", None)
    with pytest.raises(hr.InvalidArgumentError, match=r"pip install 'headrace\[snappy\]'"):
        _dataset([10] * 5, tmp_path / "other", "SNAPPY")
    with pytest.raises(hr.InvalidArgumentError, match="needs the cramjam package"):
        list(_dataset([10] * 5, tmp_path, None))  # reading a SNAPPY snapshot needs it too

"""A saved dataset's manifest is data someone may edit: every edit gives the saved
elements exactly, or a DataLossError naming the file — never a KeyError, TypeError,
RecursionError, or elements of another spec passed on silently.

A generator saves random datasets (structures of arrays, bytes, scalars), then
replaces one random field of the manifest (anywhere in it, the element spec
included) with a random value: garbage of another type, a deeply nested spec, a
valid spec of another dtype or shape, or removes it. The oracle is the dataset as
saved.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from json_paths import field_paths

import headrace as hr
from headrace.testing import assert_elements_equal


def _dataset(kind: str, n: int) -> hr.Dataset:
    x = np.arange(n * 2, dtype=np.int64).reshape(n, 2)
    if kind == "array":
        return hr.Dataset.from_tensor_slices(x)
    if kind == "dict":
        return hr.Dataset.from_tensor_slices({"x": x, "y": np.arange(n, dtype=np.float32)})
    return hr.Dataset.from_tensor_slices((x, [b"r%d" % i for i in range(n)]))




GARBAGE = [
    None, -1, 3, 2**70, 1.5, "x", "<f4", "float32", True, [], [None], [[1, 2]], {}, {"a": 1},
    {"spec": [[2], "<f4"]}, {"spec": [[3], "<i8"]}, {"spec": [None, "<i8"]},
    {"spec": [[2], "bytes"]}, {"spec": [[-1], "<i8"]}, {"spec": [[2], "O"]},
    {"spec": [[2], "<i8"], "x": 1}, {"tuple": []}, {"dict": {}}, {"dict": []},
    {"namedtuple": "P", "fields": ["a"], "items": []},
    {"namedtuple": "not a name", "fields": ["a"], "items": [{"spec": [[], "<i8"]}]},
    "DEEP",
]
DELETE = "DELETE"


def _load_all(path: Path) -> list[Any]:
    return list(hr.Dataset.load(str(path)).as_numpy_iterator())


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    kind=st.sampled_from(["array", "dict", "tuple"]),
    n=st.integers(1, 12),
    compression=st.sampled_from([None, "GZIP"]),
    data=st.data(),
)
def test_an_edited_manifest_gives_the_data_or_a_data_loss_error_naming_it(
    tmp_path_factory: pytest.TempPathFactory,
    kind: str,
    n: int,
    compression: str | None,
    data: st.DataObject,
) -> None:
    path = tmp_path_factory.mktemp("saved")
    ds = _dataset(kind, n)
    ds.save(str(path), compression=compression, num_shards=2)
    oracle = list(ds.as_numpy_iterator())
    manifest_path = path / "headrace-dataset.json"
    manifest = json.loads(manifest_path.read_text())
    field = data.draw(st.sampled_from(field_paths(manifest)), label="field")
    value = data.draw(st.sampled_from([*GARBAGE, DELETE]), label="value")
    edited = copy.deepcopy(manifest)
    parent: Any = edited
    for key in field[:-1]:
        parent = parent[key]
    if value == DELETE:
        del parent[field[-1]]
    else:
        parent[field[-1]] = value
    text = json.dumps(edited)
    if value == "DEEP":  # a spec nested 5,000 levels (deeper than json.dumps can write)
        text = text.replace('"DEEP"', '{"tuple": [' * 5000 + '{"spec": [[], "<i8"]}' + "]}" * 5000)
    manifest_path.write_text(text)
    try:
        got = _load_all(path)
    except hr.DataLossError as error:
        assert str(path) in str(error), str(error)
        return
    except (FileNotFoundError, hr.InvalidArgumentError) as error:
        # a save that looks incomplete, or one that records no spec: said as such
        assert str(path) in str(error), str(error)
        return
    assert len(got) == len(oracle), (field, value)
    for a, b in zip(got, oracle, strict=True):
        assert_elements_equal(a, b, where=f"after {field} = {value!r}")


def test_a_manifest_spec_of_another_dtype_is_refused_at_the_first_element(tmp_path: Path) -> None:
    ds = hr.Dataset.from_tensor_slices(np.arange(10, dtype=np.int64))
    ds.save(str(tmp_path), num_shards=1)
    manifest_path = tmp_path / "headrace-dataset.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["element_spec"] = {"spec": [[], "<f8"]}
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(hr.DataLossError, match="does not match its manifest's spec"):
        _load_all(tmp_path)


def test_a_manifest_nested_past_reason_is_a_data_loss_error(tmp_path: Path) -> None:
    hr.Dataset.range(3).save(str(tmp_path), num_shards=1)
    manifest_path = tmp_path / "headrace-dataset.json"
    text = manifest_path.read_text()
    manifest = json.loads(text)
    spec = json.dumps(manifest["element_spec"])
    deep = '{"tuple": [' * 5000 + spec + "]}" * 5000
    manifest_path.write_text(text.replace(spec, deep))
    with pytest.raises(hr.DataLossError, match=r"headrace-dataset\.json"):
        _load_all(tmp_path)


def _swap(a: Path, b: Path) -> None:
    temporary = a.with_name(a.name + ".t")
    a.rename(temporary)
    b.rename(a)
    temporary.rename(b)


@pytest.mark.parametrize("seed", range(8))
def test_a_part_file_from_another_save_or_swapped_gives_the_data_or_a_data_loss_error(
    tmp_path: Path, seed: int
) -> None:
    """Random saves (compression, shard count, size) with one part file replaced by the same
    part of another save, or two parts swapped by name (with their indexes): load refuses
    the file, naming it, or gives exactly the saved data (when the bytes are the same)."""
    rng = np.random.default_rng(seed)
    compression = [None, "GZIP", "ZLIB"][int(rng.integers(3))]
    shards = int(rng.integers(2, 5))
    n = int(rng.integers(1, 13))
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ds = hr.Dataset.from_tensor_slices(np.arange(n, dtype=np.float64))
    ds.save(str(ours), compression=compression, num_shards=shards)
    other = hr.Dataset.from_tensor_slices(np.arange(n, dtype=np.float64) + 100)
    other.save(str(theirs), compression=compression, num_shards=shards)
    oracle = list(ds.as_numpy_iterator())
    a, b = rng.choice(shards, size=2, replace=False).tolist()
    part = "shard-{:05d}-00000.tfrecord"
    suffixes = ["", ".hrx"] if compression is None else [""]
    if rng.integers(2):
        changed = ours / part.format(a)
        for suffix in suffixes:
            (theirs / (part.format(a) + suffix)).replace(ours / (part.format(a) + suffix))
    else:
        changed = ours / part.format(a)
        for suffix in suffixes:
            _swap(ours / (part.format(a) + suffix), ours / (part.format(b) + suffix))
    try:
        got = _load_all(ours)
    except hr.DataLossError as error:
        assert str(changed) in str(error) or str(ours / part.format(b)) in str(error), str(error)
        return
    assert len(got) == len(oracle)
    for x, y in zip(got, oracle, strict=True):
        assert_elements_equal(x, y, where=f"seed {seed}")


#: Every top-level field each save writes (since version 1), with a value of a wrong type.
REQUIRED = {
    "compression": None, "fingerprint": 12, "format": 7, "version": "2",
    "elements_format": None, "element_spec": None, "num_shards": "2", "parts": {"0": 1},
    "digests": "abc", "elements": 1.5,
}


@pytest.mark.parametrize("seed", range(24))
def test_a_required_field_missing_or_mistyped_is_a_data_loss_error_naming_it(
    tmp_path: Path, seed: int
) -> None:
    # A manifest without 'compression' was read as uncompressed (a GZIP save then raised
    # StaleIndexError advising an index rebuild), one without 'fingerprint' was accepted.
    rng = np.random.default_rng(seed)
    kind = ["array", "dict", "tuple"][int(rng.integers(3))]
    compression = [None, "GZIP", "ZLIB"][int(rng.integers(3))]
    _dataset(kind, int(rng.integers(1, 9))).save(
        str(tmp_path), compression=compression, num_shards=int(rng.integers(1, 3)))
    manifest_path = tmp_path / "headrace-dataset.json"
    manifest = json.loads(manifest_path.read_text())
    assert set(REQUIRED) <= set(manifest)
    for field, wrong in REQUIRED.items():
        for edit in ("delete", "mistype"):
            edited = dict(manifest)
            if edit == "delete":
                del edited[field]
            else:
                edited[field] = wrong
            manifest_path.write_text(json.dumps(edited))
            with pytest.raises(hr.DataLossError) as raised:
                _load_all(tmp_path)
            message = str(raised.value)
            assert str(manifest_path) in message, (field, edit, message)
            assert f"'{field}'" in message, (field, edit, message)
    manifest_path.write_text(json.dumps(manifest))
    assert len(_load_all(tmp_path)) == manifest["elements"]  # the untouched one loads

"""Sources: views not copies, read-only batches, exact bytes, generator checks, memmaps."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections import namedtuple

import numpy as np
import pytest

import headrace as hr


def test_slices_are_read_only_views_of_the_users_array() -> None:
    data = np.arange(12, dtype=np.float32).reshape(6, 2)
    rows = list(hr.Dataset.from_tensor_slices(data))
    assert all(np.shares_memory(row, data) for row in rows)
    with pytest.raises(ValueError, match="read-only"):
        rows[0][0] = 99
    assert data.flags.writeable  # the user's own array is untouched


def test_batches_of_an_array_source_are_one_slice() -> None:
    data = np.arange(20).reshape(10, 2)
    batches = list(hr.Dataset.from_tensor_slices(data).batch(4))
    assert [b.shape for b in batches] == [(4, 2), (4, 2), (2, 2)]
    assert all(np.shares_memory(b, data) for b in batches)
    assert not batches[0].flags.writeable


def test_unequal_first_dimensions_name_components_and_sizes() -> None:
    with pytest.raises(hr.InvalidArgumentError, match=r"\['x'\]: 3, \['y'\]: 4"):
        hr.Dataset.from_tensor_slices({"x": np.zeros(3), "y": np.zeros(4)})


def test_list_is_one_array_tuple_is_a_structure() -> None:
    assert [int(v) for v in hr.Dataset.from_tensor_slices([1, 2, 3])] == [1, 2, 3]
    pairs = list(hr.Dataset.from_tensor_slices(([1, 2], [3.0, 4.0])))
    assert [(int(a), float(b)) for a, b in pairs] == [(1, 3.0), (2, 4.0)]
    assert pairs[0][0].dtype == np.int64  # NumPy's rule for Python ints


def test_namedtuple_and_dict_structures_are_kept() -> None:
    Point = namedtuple("Point", "x y")
    element = next(iter(hr.Dataset.from_tensor_slices(Point(np.arange(2), np.arange(2)))))
    assert isinstance(element, Point)
    spec = hr.Dataset.from_tensor_slices({"a": np.zeros((5, 3), np.float16)}).element_spec
    assert spec == {"a": hr.TensorSpec((3,), np.float16)}


def test_bytes_keep_trailing_nuls_in_object_batches() -> None:
    values = [b"a\x00\x00", b"b", b"\x00"]
    batch = next(iter(hr.Dataset.from_tensor_slices(values).batch(3)))
    assert batch.dtype == object
    assert batch.tolist() == values
    fixed_width = np.array(values)  # 'S3' already lost the NULs: headrace keeps what is left
    assert next(iter(hr.Dataset.from_tensor_slices(fixed_width).batch(3))).dtype == object


def test_from_tensors_and_range() -> None:
    (element,) = list(hr.Dataset.from_tensors({"x": np.ones(3)}))
    np.testing.assert_array_equal(element["x"], np.ones(3))
    assert [int(v) for v in hr.Dataset.range(2, 10, 3)] == [2, 5, 8]
    assert [int(v) for v in hr.Dataset.range(5, 0, -2)] == [5, 3, 1]
    assert hr.Dataset.range(7).cardinality() == 7
    with pytest.raises(hr.InvalidArgumentError, match="step must not be zero"):
        hr.Dataset.range(0, 5, 0)


def test_generator_is_called_again_each_epoch() -> None:
    calls = []

    def generate():
        calls.append(1)
        yield from range(3)

    ds = hr.Dataset.from_generator(generate, output_signature=hr.TensorSpec((), np.int64))
    assert [int(v) for v in ds.repeat(2)] == [0, 1, 2, 0, 1, 2]
    assert len(calls) == 2


def test_generator_elements_are_checked_against_the_signature() -> None:
    signature = (hr.TensorSpec((2,), np.float32), hr.TensorSpec((), bytes))

    def bad_shape():
        yield np.zeros(2), b"ok"
        yield np.zeros(3), b"ok"

    with pytest.raises(hr.ElementSpecError, match=r"element 1, component \[0\]: expected shape"):
        list(hr.Dataset.from_generator(bad_shape, output_signature=signature))

    def str_for_bytes():  # tf.data encodes it, as UTF-8
        yield np.zeros(2), "text é"

    (element,) = list(hr.Dataset.from_generator(str_for_bytes, output_signature=signature))
    assert element[1] == "text é".encode()

    def bad_type():
        yield np.zeros(2), 7

    with pytest.raises(hr.ElementSpecError, match=r"component \[1\]: expected bytes, got int"):
        list(hr.Dataset.from_generator(bad_type, output_signature=signature))

    def bad_structure():
        yield np.zeros(2)

    with pytest.raises(hr.ElementSpecError, match="wrong structure"):
        list(hr.Dataset.from_generator(bad_structure, output_signature=signature))

    def float_for_int():
        yield 1.5

    with pytest.raises(hr.ElementSpecError, match="expected dtype int32"):
        list(hr.Dataset.from_generator(float_for_int, output_signature=hr.TensorSpec((), "int32")))


def test_generator_converts_to_the_signature_dtype() -> None:
    ds = hr.Dataset.from_generator(lambda: iter([[1, 2]]), output_signature=hr.TensorSpec((2,), "int32"))
    (element,) = list(ds)
    assert element.dtype == np.int32


def test_generator_needs_a_signature() -> None:
    with pytest.raises(hr.InvalidArgumentError, match="output_signature is required"):
        hr.Dataset.from_generator(lambda: iter([1]))


def test_from_npy_memory_maps_and_pickles_as_a_path(tmp_path) -> None:
    import pickle

    data = np.arange(40, dtype=np.float64).reshape(10, 4)
    np.save(tmp_path / "x.npy", data)
    ds = hr.Dataset.from_npy(tmp_path / "x.npy").batch(4)
    np.testing.assert_array_equal(np.concatenate(list(ds)), data)
    blob = pickle.dumps(ds)
    assert len(blob) < 2000  # the path, not the contents
    np.testing.assert_array_equal(np.concatenate(list(pickle.loads(blob))), data)


@pytest.mark.slow
def test_from_npy_streams_a_large_file_without_anonymous_memory(tmp_path) -> None:
    path = tmp_path / "big.npy"
    array = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(65536, 1024))
    array[:] = 1.0
    array.flush()
    del array
    script = textwrap.dedent(
        f"""
        import headrace as hr
        from headrace._memory.system import process_memory
        before = process_memory().anonymous
        total = 0.0
        for batch in hr.Dataset.from_npy({str(path)!r}).batch(4096):
            total += float(batch.sum())
        growth = process_memory().anonymous - before
        assert total == 65536 * 1024, total
        print(growth)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    growth = int(out.stdout.strip())
    assert growth < 32 << 20, f"anonymous memory grew by {growth} bytes streaming a 256 MiB file"

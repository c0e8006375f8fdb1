"""The public API: explicit, documented, and the CLI runs in-process."""

from __future__ import annotations

import ast
import importlib
import inspect
import io
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import headrace as hr
from headrace.cli import main

#: Every public name, by namespace (docs/api/ documents these modules, from their
#: docstrings). Adding a name to the API is a deliberate act: add it here too.
PUBLIC: dict[str, list[str]] = {
    "headrace": [
        "AUTOTUNE", "AutoShardPolicy", "CheckpointError", "CsvDataset", "CsvError",
        "DataLossError", "Dataset", "DatasetIterator", "ElementSpecError", "EmptyInputError",
        "FileLimitError", "HeadraceError", "HeadraceWarning", "INFINITE",
        "InvalidArgumentError", "IteratorClosedError", "MemoryBudgetError", "Options",
        "Origin", "ParseError", "ProducerError", "RecordTooLargeError", "ServedIterator", "Server",
        "ShardInfo", "SqlError", "TFRecordDataset", "TensorSpec", "TextLineDataset",
        "UNKNOWN", "WorkerError", "WorkerPoolError", "__version__", "auto_shard",
        "connect", "decode_csv", "element_origin", "make_csv_dataset", "mark_batch_row",
        "parse_bytes", "read_csv",
        "register_sizer", "serve", "shard_info",
    ],
    "headrace.core": [
        "Buffer", "Context", "DatasetIterator", "Handoff", "INFINITE", "IndexPlan",
        "IndexStream", "Indices", "Iterator", "NO_RESERVATION", "Node", "RandomAccess",
        "Refusal", "Reservation", "RunFacts", "STATE_VERSION", "ShardRole", "StateReader",
        "Traits", "UNKNOWN", "UnaryNode", "default_budget", "function_fingerprint",
        "function_name", "restore_input",
    ],
    "headrace.image": [
        "ImageHeader", "InceptionCrop", "InvalidImageError", "MAX_PIXELS", "ResizeMethod",
        "adjust_brightness", "adjust_contrast", "adjust_gamma", "adjust_hue",
        "adjust_saturation", "central_crop", "convert_image_dtype",
        "crop_to_bounding_box", "decode_and_crop_jpeg", "decode_bmp", "decode_gif",
        "decode_image", "decode_jpeg", "decode_png", "decoded_nbytes",
        "extract_jpeg_shape", "flip_left_right", "flip_up_down", "grayscale_to_rgb",
        "hsv_to_rgb", "is_jpeg", "normalize", "pad_to_bounding_box",
        "per_image_standardization", "random_brightness", "random_contrast",
        "random_crop", "random_flip_left_right", "random_flip_up_down", "random_hue",
        "random_resized_crop", "random_resized_crop_box", "random_saturation",
        "read_header", "resize", "resize_with_crop_or_pad", "resize_with_pad",
        "rgb_to_grayscale", "rgb_to_hsv", "rgb_to_yiq", "rgb_to_yuv", "rot90",
        "sample_distorted_bounding_box", "stateless_random_brightness",
        "stateless_random_contrast", "stateless_random_crop",
        "stateless_random_flip_left_right", "stateless_random_flip_up_down",
        "stateless_random_hue", "stateless_random_saturation",
        "stateless_sample_distorted_bounding_box", "total_variation", "transpose",
        "yiq_to_rgb", "yuv_to_rgb",
    ],
    "headrace.io.example": [
        "DecodedFeature", "FeatureSpec", "FixedLenFeature", "FixedLenSequenceFeature",
        "RaggedColumn", "RaggedFeature", "SparseColumn", "SparseFeature", "VarLenFeature",
        "decode_example", "decode_sequence_example", "encode_example_columns",
        "parse_example", "parse_sequence_example", "parse_single_example",
        "parse_single_sequence_example", "serialize_example", "serialize_sequence_example",
    ],
    "headrace.io.tfrecord": [
        "DEFAULT_BUFFER_SIZE", "DEFAULT_MAX_RECORD_BYTES", "RECORD_OVERHEAD_BYTES",
        "SkippedSpan", "TFRecordReader", "TFRecordWriter", "encode_records",
        "normalize_compression_type", "open_tfrecord", "read_record_at", "write_tfrecord",
    ],
    "headrace.io.objstore": [
        "MIN_REMOTE_BUFFER_SIZE", "MIN_UPLOAD_PART", "REMOTE_BUFFER_SIZE", "RetryPolicy",
        "Successor", "configure", "copy_object", "delete_object", "first_range_size",
        "fitting_buffer", "glob_objects", "is_remote", "is_url", "list_objects",
        "local_path", "object_info", "put_atomic", "put_if_absent", "read_whole",
        "reset_stores",
    ],
    "headrace.adapters.torch": [
        "TorchIterableDataset", "as_tensor", "to_torch",
    ],
    "headrace.adapters.jax": [
        "DeviceIterator", "to_jax",
    ],
    "headrace.adapters.tf": [
        "tf_signature", "to_tf",
    ],
    "headrace.adapters.ray": [
        "PreprocessReport", "WORKER_BASELINE", "preprocess_on_ray", "shard_path",
        "task_memory",
    ],
    "headrace.adapters.orbax": [
        "HeadraceCheckpointHandler", "HeadraceCheckpointRestore", "HeadraceCheckpointSave",
    ],
    "headrace.ray": [
        "DataService", "ServiceConsumer", "ServiceError", "from_ray", "to_ray",
    ],
    "headrace.profiling": [
        "Decision", "Diagnosis", "Finding", "Monitor", "Profile", "Sample",
        "StageProfile", "diagnose", "lint_recipe",
    ],
    "headrace.keras": [
        "IteratorCheckpoint", "KerasAdapter", "MemoryGrowthWarning", "MemoryMonitor",
        "MemoryTrend",
    ],
    "headrace.tf_compat": [
        "EagerArray", "NotSupportedError", "TensorSpec", "bool", "cast", "constant",
        "convert_to_tensor", "data", "errors", "float16", "float32", "float64", "image",
        "int16", "int32", "int64", "int8", "io", "keras", "sparse", "string", "train",
        "uint16", "uint32", "uint64", "uint8",
    ],
}


SRC = Path(hr.__file__).parent


def _public_module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:  # an optional extra (torch, jax, ray, orbax)
        if error.name and error.name.split(".")[0] != "headrace":
            pytest.skip(f"{name} needs {error.name}")
        raise


def _attribute_docstring(module: str, name: str) -> str | None:
    """The docstring written under ``name = ...`` (or the ``#:`` comment above it) where it
    is defined, following re-exports to their source: a constant's or an alias's docs."""
    path = SRC.parent.joinpath(*module.split("."))
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    lines = path.read_text().splitlines()
    body = ast.parse("\n".join(lines)).body
    for index, statement in enumerate(body):
        if isinstance(statement, ast.ImportFrom) and statement.module:
            for alias in statement.names:
                if (alias.asname or alias.name) == name:
                    return _attribute_docstring(statement.module, alias.name)
        targets = (statement.targets if isinstance(statement, ast.Assign)
                   else [statement.target] if isinstance(statement, ast.AnnAssign) else [])
        if any(isinstance(target, ast.Name) and target.id == name for target in targets):
            after = body[index + 1] if index + 1 < len(body) else None
            if (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                return after.value.value
            above = []
            for line in reversed(lines[: statement.lineno - 1]):
                if not line.lstrip().startswith("#:"):
                    break
                above.append(line.lstrip()[2:].strip())
            return " ".join(reversed(above)) or None
    return None


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_each_public_namespace_exports_exactly_its_recorded_names(module: str) -> None:
    assert sorted(_public_module(module).__all__) == sorted(PUBLIC[module])


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_every_public_name_has_a_docstring(module: str) -> None:
    namespace = _public_module(module)
    for name in PUBLIC[module]:
        value = getattr(namespace, name)
        if inspect.isclass(value) or inspect.isroutine(value) or inspect.ismodule(value):
            assert inspect.getdoc(value), f"{module}.{name}"
        else:  # a constant, an alias of a type, a namespace object
            assert _attribute_docstring(module, name), f"{module}.{name}"


def test_dir_of_headrace_lists_the_public_names_only() -> None:
    listed = {name for name in dir(hr) if not (name.startswith("__") and name.endswith("__"))}
    assert listed == set(hr.__all__) - {"__version__"}
    assert "__version__" in dir(hr) and "transforms" not in dir(hr) and "Dataset" in dir(hr)
    # what importing binds as attributes is still there, only not offered
    assert hr.core.Node is not None


def test_every_public_module_and_internal_package_has_an_all() -> None:
    """``from headrace.x import *`` and the API reference take ``__all__``; an internal
    package's is empty, so a star import cannot make its names look supported."""
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        if any(part.startswith("_") and part != "__init__" for part in parts):
            continue  # a private module: its package decides what it exports
        tree = ast.parse(path.read_text())
        exported = [statement for statement in tree.body
                    if isinstance(statement, ast.Assign | ast.AnnAssign)
                    and "__all__" in ast.unparse(statement).split("=")[0]]
        assert exported, f"{path.relative_to(SRC.parent)} has no __all__"


def test_the_extension_api_is_listed_and_documented() -> None:
    import headrace.core as core

    for name in core.__all__:
        value = getattr(core, name)
        if inspect.isclass(value) or inspect.isfunction(value):
            assert inspect.getdoc(value), f"headrace.core.{name}"


def test_every_public_callable_has_a_docstring() -> None:
    for name in hr.__all__:
        value = getattr(hr, name)
        if inspect.isclass(value) or inspect.isfunction(value):
            assert inspect.getdoc(value), name
    for name, member in inspect.getmembers(hr.Dataset):
        if not name.startswith("_") and callable(member):
            assert inspect.getdoc(member), f"Dataset.{name}"


def test_import_is_light() -> None:
    """``import headrace`` loads no framework, no optional extra and no C library beyond
    NumPy's: what keeps it fast and small (its time is measured in benchmarks/bench_core.py,
    scenario 4, beside TensorFlow's: a timed assertion here would fail on a busy machine)."""
    heavy = ["tensorflow", "torch", "jax", "keras", "ray", "pyarrow", "psycopg",
             "adbc_driver_manager", "PIL", "pandas", "scipy"]
    # VmHWM, not ru_maxrss: the latter survives exec, so a child forked from a large
    # test worker would report the worker's size.
    code = (
        "import sys; import headrace;"
        f"print([m for m in {heavy!r} if m in sys.modules]);"
        "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded, peak_kib = out.stdout.split("\n")[:2]
    assert loaded == "[]"
    assert int(peak_kib) < 80 * 1024  # peak RSS of the whole interpreter, in KiB


def test_demo_streams_more_than_its_budget(tmp_path, capsys) -> None:
    assert main(["demo", "--size", "48MiB", "--budget", "16MiB", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "rows/s" in out and "within the bound" in out
    assert "shuffle" in out and "prefetch" in out


def test_apply_chains_a_function_and_keeps_the_options() -> None:
    ds = hr.Dataset.range(10).with_options(hr.Options(memory_budget="8MiB"))
    evens = ds.apply(lambda d: d.filter(lambda x: x % 2 == 0)).apply(lambda d: d.take(3))
    assert [int(x) for x in evens] == [0, 2, 4]
    assert evens.options.memory_budget == ds.options.memory_budget
    derived = ds.derive(ds.take(2).node)
    assert derived.options == ds.options and [int(x) for x in derived] == [0, 1]


def test_apply_and_derive_refuse_what_is_not_a_dataset_or_node() -> None:
    ds = hr.Dataset.range(3)
    with pytest.raises(hr.InvalidArgumentError, match="must return a Dataset, got list"):
        ds.apply(lambda d: [1, 2])
    with pytest.raises(hr.InvalidArgumentError, match=r"derive needs a headrace\.core\.Node"):
        ds.derive(ds)  # type: ignore[arg-type]


def _fresh_import(name: str) -> Any:
    """Import ``name`` anew, so that a warning it gives on import is given again."""
    sys.modules.pop(name, None)
    return importlib.import_module(name)


def test_headrace_saved_warns_and_still_imports(tmp_path) -> None:
    with pytest.warns(DeprecationWarning, match=r"headrace\.saved is deprecated.*Dataset\.save"):
        saved = _fresh_import("headrace.saved")
    saved.save(hr.Dataset.range(4), str(tmp_path / "ds"))
    assert (tmp_path / "ds" / saved.MANIFEST_NAME).is_file()
    assert [int(x) for x in hr.Dataset.load(str(tmp_path / "ds"))] == [0, 1, 2, 3]


def test_headrace_writers_warns_and_still_writes(tmp_path) -> None:
    with pytest.warns(DeprecationWarning, match=r"headrace\.writers.*Dataset\.save_tfrecords"):
        writers = _fresh_import("headrace.writers")
    rows = hr.Dataset.from_tensor_slices({"x": np.arange(3, dtype=np.int64)})
    paths = writers.save_tfrecords(rows, str(tmp_path), num_shards=1, progress=False)
    assert len(paths) == 1
    from headrace.io.example import FixedLenFeature

    parsed = hr.TFRecordDataset(paths).batch(3).parse_examples({"x": FixedLenFeature([], np.int64)})
    assert [row["x"].tolist() for row in parsed] == [[0, 1, 2]]


def test_profiling_profile_warns_and_still_profiles() -> None:
    import headrace.profiling as profiling

    with pytest.warns(DeprecationWarning, match=r"headrace\.profiling\.profile .*Dataset\.profile"):
        profile = profiling.profile
    result = profile(hr.Dataset.range(5).map(lambda x: x + 1), progress=False, lint=False)
    assert [s.elements_out for s in result.stages if s.name.startswith("map")] == [5]
    assert "profile" not in profiling.__all__


def test_the_warning_names_the_importing_line() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from headrace.profiling import profile  # noqa: F401
    assert [Path(w.filename).name for w in caught] == [Path(__file__).name]


def test_dataset_profile_takes_what_the_deprecated_function_took() -> None:
    stream = io.StringIO()
    result = hr.Dataset.range(5).profile(progress=True, stream=stream, interval=0.01,
                                         lint=False, title="five")
    assert result.title == "five" and stream.getvalue()
    assert [s.elements_out for s in result.stages if s.name == "range"] == [5]


def test_keras_to_keras_warns_and_still_adapts() -> None:
    pytest.importorskip("keras")
    import headrace.keras as hk

    ds = hr.Dataset.from_tensor_slices((np.ones((4, 2), np.float32), np.zeros(4, np.float32)))
    with pytest.warns(DeprecationWarning, match=r"headrace\.keras\.to_keras .*Dataset\.to_keras"):
        adapter = hk.to_keras(ds.batch(2))
    assert isinstance(adapter, hk.KerasAdapter) and adapter.num_batches == 2
    assert "to_keras" not in hk.__all__

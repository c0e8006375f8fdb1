"""The public API: explicit, documented, and the CLI runs in-process."""

from __future__ import annotations

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


def test_all_lists_exactly_the_public_names() -> None:
    public = {name for name in vars(hr) if not name.startswith("_")} - {
        "dataset", "errors", "core", "options", "structure", "memory",
        "sources", "transforms", "profiling", "testing", "io", "cli", "distribute", "writers",
        "tools", "csv", "persist", "sql", "adapters", "keras", "saved", "tf_compat", "workers",
        "image", "served", "ray",
    }
    assert public | {"__version__"} == set(hr.__all__)


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

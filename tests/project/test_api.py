"""The public API: explicit, documented, and the CLI runs in-process."""

from __future__ import annotations

import inspect
import subprocess
import sys

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

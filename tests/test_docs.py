"""Every Python example in the README runs, as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples() -> None:
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index: int) -> None:
    namespace: dict[str, object] = {}
    for block in BLOCKS[: index + 1]:  # later blocks build on earlier ones
        exec(compile(block, f"README.md example {index}", "exec"), namespace)


def test_readme_performance_table_is_generated_from_the_results() -> None:
    """The README's numbers come from benchmarks/results, never typed by hand."""
    import importlib.util

    path = README.parent / "benchmarks" / "readme_table.py"
    spec = importlib.util.spec_from_file_location("readme_table", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--check"]) == 0, "run python benchmarks/readme_table.py"

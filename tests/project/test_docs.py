"""Every Python example in the README and in docs/ runs, as written, each as its own file.

An example is one fenced ``python`` block. Each is written to a file of its own and run
as ``python example.py`` in a fresh interpreter, in an empty folder: a reader can copy any
one of them and run it alone, so none may lean on a block above it, and one that starts
worker processes has the ``__main__`` guard a script needs. Each block is its own test,
so xdist spreads them. The docs site itself builds without a warning.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
EXAMPLES = [
    (page.relative_to(ROOT).as_posix(), number, block)
    for page in PAGES
    for number, block in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S))
]


def test_every_page_with_code_has_examples() -> None:
    assert len(EXAMPLES) >= 20
    assert any(page == "README.md" for page, _, _ in EXAMPLES)


#: Where the interpreter running an example finds headrace: the tree under test.
SOURCE = Path(__import__("headrace").__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("page", "number", "block"), EXAMPLES, ids=[f"{p}#{n}" for p, n, _ in EXAMPLES]
)
def test_example_runs_on_its_own(page: str, number: int, block: str, tmp_path: Path) -> None:
    """``python example.py`` in a fresh interpreter, in an empty folder: its own imports,
    its own data, and a ``__main__`` guard where it starts worker processes (forkserver
    and spawn import the main script again)."""
    script = tmp_path / f"{Path(page).stem}_{number}.py"
    script.write_text(block)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(SOURCE), *filter(None, [os.environ.get("PYTHONPATH")])])}
    result = subprocess.run(
        [sys.executable, script.name], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=240,
    )
    assert result.returncode == 0, f"{page} example {number} failed:\n{result.stderr[-6000:]}"


GUARD = re.compile(r'^if __name__ == "__main__":', flags=re.M)
WORKERS = re.compile(r"workers=\"processes\"|num_workers=[1-9]|workers=\"auto\"")


def test_examples_that_start_workers_guard_their_main() -> None:
    """A reader copies the example into a script: without the guard, each worker process
    would run the pipeline again when it imports the script."""
    unguarded = [f"{page}#{number}" for page, number, block in EXAMPLES
                 if WORKERS.search(block) and not GUARD.search(block)]
    assert unguarded == []


def test_the_docs_site_builds_without_warnings(tmp_path: Path) -> None:
    """mkdocs with mkdocstrings: every page, and the API reference from the docstrings."""
    if shutil.which("mkdocs", path=str(Path(sys.executable).parent)) is None:
        pytest.fail("mkdocs is not installed: the [docs] extra is part of the test install")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "site" / "api" / "index.html").exists()


def test_the_performance_table_is_generated_from_the_results() -> None:
    """The numbers in docs/performance.md come from benchmarks/results, never typed by hand."""
    import importlib.util

    path = ROOT / "benchmarks" / "readme_table.py"
    spec = importlib.util.spec_from_file_location("readme_table", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--check"]) == 0, "run python benchmarks/readme_table.py"

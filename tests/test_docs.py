"""Every Python example in the README and in docs/ runs, as written, each as its own file.

An example is one fenced ``python`` block. Each is written to a file of its own and run
in a fresh namespace: a reader can copy any one of them and run it alone, so none may
lean on a block above it. The docs site itself builds without a warning.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
EXAMPLES = [
    (page.relative_to(ROOT).as_posix(), number, block)
    for page in PAGES
    for number, block in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S))
]


def test_every_page_with_code_has_examples() -> None:
    assert len(EXAMPLES) >= 20
    assert any(page == "README.md" for page, _, _ in EXAMPLES)


@pytest.mark.parametrize(
    ("page", "number", "block"), EXAMPLES, ids=[f"{p}#{n}" for p, n, _ in EXAMPLES]
)
def test_example_runs_on_its_own(
    page: str, number: int, block: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = tmp_path / f"{Path(page).stem}_{number}.py"
    script.write_text(block)
    monkeypatch.chdir(tmp_path)
    # Not run as __main__: worker processes (forkserver) import the main module, and
    # this one is pytest's; the example's own functions are module-level or importable.
    code = compile(script.read_text(), str(script), "exec")
    exec(code, {"__name__": "docs_example", "__file__": str(script)})


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

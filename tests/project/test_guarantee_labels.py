"""The guarantee labels (G1, G2, ...) that comments, docstrings and test names cite mean
one thing each: the row of that label in docs/guarantees.md.

A reader who meets "(G2)" in the code looks it up there, so every label cited must have
exactly one row, and no row may share its label with another.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GUARANTEES = ROOT / "docs" / "guarantees.md"
LABEL = re.compile(r"\bG[0-9]+\b")


def defined_labels() -> Counter[str]:
    """The labels of docs/guarantees.md's table rows (``| G1 | ... |``)."""
    rows = re.findall(r"^\|\s*(G[0-9]+)\s*\|", GUARANTEES.read_text(), flags=re.M)
    return Counter(rows)


def cited_labels() -> dict[str, list[str]]:
    """Each label cited in src/ and tests/, with where (file:line)."""
    cited: dict[str, list[str]] = {}
    for top in ("src", "tests"):
        for path in sorted((ROOT / top).rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                for label in LABEL.findall(line):
                    where = f"{path.relative_to(ROOT).as_posix()}:{number}"
                    cited.setdefault(label, []).append(where)
    return cited


def test_each_label_has_one_row() -> None:
    defined = defined_labels()
    assert defined, f"no guarantee rows found in {GUARANTEES}"
    twice = sorted(label for label, count in defined.items() if count > 1)
    assert not twice, f"labels with more than one row in docs/guarantees.md: {twice}"
    numbers = sorted(int(label[1:]) for label in defined)
    assert numbers == list(range(1, len(numbers) + 1)), f"labels not G1..Gn in order: {numbers}"


def test_every_cited_label_is_defined() -> None:
    defined = defined_labels()
    cited = cited_labels()
    assert "G1" in cited  # the scan reads the files the labels are cited in
    undefined = {label: places[:3] for label, places in cited.items() if label not in defined}
    assert not undefined, (
        f"labels cited but not defined in docs/guarantees.md (first places): {undefined}"
    )

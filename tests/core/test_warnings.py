"""Warnings a user sees: one class, visible by default, once per iterator and stage.

A warning that Python hides by default (ResourceWarning) is a warning nobody
reads: a ``shuffle(10000)`` that became a shuffle within 2,686 elements must be
reported where the user looks. Each warning says what changed and how to avoid it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

import headrace as hr


def _shrinking_pipeline() -> hr.Dataset:
    def rows():  # a stream: the shuffle buffer holds the elements themselves
        for i in range(400):
            yield np.full(64 << 10, i % 251, np.uint8)

    spec = hr.TensorSpec((64 << 10,), np.uint8)
    return (
        hr.Dataset.from_generator(rows, output_signature=spec)
        .shuffle(10_000, seed=1)
        .with_options(hr.Options(memory_budget="8MiB"))
    )


def test_headrace_warning_is_a_user_warning() -> None:
    assert issubclass(hr.HeadraceWarning, UserWarning)
    assert not issubclass(hr.HeadraceWarning, ResourceWarning)


def test_shuffle_shrink_warns_once_per_iterator_saying_what_and_how() -> None:
    dataset = _shrinking_pipeline()
    for _ in range(2):  # each iterator warns for itself
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert len(list(dataset)) == 400
        shrink = [w for w in caught if issubclass(w.category, hr.HeadraceWarning)]
        assert len(shrink) == 1, [str(w.message) for w in caught]
        message = str(shrink[0].message)
        assert "shuffle: buffer_size=10000" in message
        assert "shuffles within" in message and "memory_budget" in message


def test_warnings_are_shown_by_default_and_filterable_by_class() -> None:
    """A fresh interpreter with Python's default filters prints the shrink warning."""
    script = textwrap.dedent(
        """
        import sys, warnings
        sys.path.insert(0, "tests/core")
        from test_warnings import _shrinking_pipeline
        import headrace as hr
        if sys.argv[1] == "ignore":
            warnings.filterwarnings("ignore", category=hr.HeadraceWarning)
        assert len(list(_shrinking_pipeline())) == 400
        """
    )
    shown = subprocess.run(
        [sys.executable, "-c", script, "default"], capture_output=True, text=True, check=True
    )
    assert "HeadraceWarning: shuffle: buffer_size=10000" in shown.stderr
    silenced = subprocess.run(
        [sys.executable, "-c", script, "ignore"], capture_output=True, text=True, check=True
    )
    assert "HeadraceWarning" not in silenced.stderr


def test_cycle_length_warning_only_when_left_to_the_default() -> None:
    inner = lambda x: hr.Dataset.range(2)  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # AUTOTUNE is an explicit choice: no warning
        hr.Dataset.range(4).interleave(inner, cycle_length=hr.AUTOTUNE)
        hr.Dataset.range(4).interleave(inner, cycle_length=2)
    with pytest.warns(hr.HeadraceWarning, match="pass cycle_length explicitly"):
        hr.Dataset.range(4).interleave(inner)


def test_unsized_objects_warning_is_a_headrace_warning() -> None:
    import datetime  # a C type with neither __dict__ nor __slots__: its payload is unseen

    from headrace._memory.sizeof import sizeof

    with pytest.warns(hr.HeadraceWarning, match="register_sizer"):
        sizeof(datetime.timedelta(days=1), set())

"""Warnings headrace raises while a pipeline runs name the user's line (its ``for``,
``next`` or the call that built what warns), not a headrace file, whatever the
pipeline's depth; on a headrace thread they name the line that raised them."""

from __future__ import annotations

import inspect
import threading
import warnings

import numpy as np

import headrace as hr
from headrace._errors import HeadraceWarning
from headrace._warn import warn_user


def megabyte_rows(count: int) -> hr.Dataset:
    # (a generator: a random-access source would shuffle its indices, which always fit)
    return hr.Dataset.from_generator(
        lambda: (np.full(1 << 20, i % 256, np.uint8) for i in range(count)),
        output_signature=hr.TensorSpec((1 << 20,), np.uint8))


def shrink_warnings(caught: list[warnings.WarningMessage]) -> list[warnings.WarningMessage]:
    return [w for w in caught if "does not fit in this stage's share" in str(w.message)]


def test_shuffles_shrink_warning_names_the_users_next() -> None:
    for depth in range(3):  # more stages above the shuffle: the same line is named
        ds = megabyte_rows(60).shuffle(1000, seed=1)
        for _ in range(depth):
            ds = ds.map(lambda a: a)
        ds = ds.with_options(hr.Options(memory_budget="32MiB"))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            iterator = iter(ds)
            line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
            next(iterator)
            iterator.close()
        (found,) = shrink_warnings(caught)
        assert found.category is HeadraceWarning
        assert (found.filename, found.lineno) == (__file__, line)


def test_a_for_loop_is_named_too() -> None:
    ds = megabyte_rows(60).shuffle(1000, seed=1).with_options(hr.Options(memory_budget="32MiB"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
        for _ in ds:
            pass
    (found,) = shrink_warnings(caught)
    assert (found.filename, found.lineno) == (__file__, line)


def test_on_a_thread_without_a_user_frame_the_raising_line_is_named() -> None:

    def run() -> None:
        warn_user("from a worker thread", HeadraceWarning)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
    (found,) = caught
    # (this test's file is the innermost frame outside headrace: named as the user's)
    assert found.filename == __file__ and str(found.message) == "from a worker thread"

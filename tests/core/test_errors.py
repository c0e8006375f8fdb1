"""No element lost: an error is raised at its element's position, names where, and
``next()`` goes on after it (tf.data's behaviour), under every parallel setting.

Outcomes are compared as sequences of ``("ok", value)`` / ``("error", value)``: an
error raised for element ``value`` must come exactly where that element would have
come, after every earlier element, and the elements after it must follow.
"""

from __future__ import annotations

import gc
import json
import os
import re
import traceback
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import headrace as hr
from headrace.core.handoff import TRACEBACK_NOTE
from headrace.io.tfrecord import write_tfrecord

Outcome = tuple[str, Any]
PARALLEL = [1, 4, hr.AUTOTUNE]


class Bad(Exception):
    """A user's own exception type, raised for one element."""

    def __init__(self, value: int) -> None:
        super().__init__(f"bad element {value}")
        self.value = value


def drive(iterator: Any, limit: int = 100_000) -> list[Outcome]:
    """Every outcome of ``iterator`` to its end: elements, and the errors in their place."""
    out = drive_limit(iterator, limit)
    if len(out) == limit:
        raise AssertionError(f"no end after {limit} outcomes (an error repeating forever?)")
    return out


def drive_limit(iterator: Any, count: int) -> list[Outcome]:
    """Up to ``count`` outcomes; an error is named by its element (or byte offset)."""
    out: list[Outcome] = []
    for _ in range(count):
        try:
            out.append(("ok", _plain(next(iterator))))
        except StopIteration:
            break
        except Bad as error:
            out.append(("error", error.value))
        except hr.DataLossError as error:
            out.append(("error", error.offset))
    return out


def drive_dataset(ds: hr.Dataset) -> list[Outcome]:
    with iter(ds) as iterator:
        out = drive(iterator)
        assert iterator.context.budget.used == 0, "bookings left after the end (an error leaked one)"
    return out


def _plain(element: Any) -> Any:
    if isinstance(element, bytes):  # the TFRecord tests' records are decimal numbers
        return int(element)
    return element.item() if isinstance(element, np.generic) else element


def failing(bad: set[int], transform: Callable[[int], Any] = lambda x: x) -> Callable[[Any], Any]:
    def fn(x: Any) -> Any:
        value = int(x)
        if value in bad:
            raise Bad(value)
        return transform(value)

    return fn


def explode(x: Any) -> Any:
    if int(x) == 5:
        raise KeyError("boom at 5")
    return x


def notes(error: BaseException) -> list[str]:
    return list(getattr(error, "__notes__", []))


def expected_map(values: list[int], bad: set[int]) -> list[Outcome]:
    return [("error", v) if v in bad else ("ok", v) for v in values]


# -- parallel map: its own function fails -------------------------------------------------


@pytest.mark.parametrize("num_parallel_calls", PARALLEL)
@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("source", ["range", "generator"])
def test_parallel_map_error_is_raised_in_place_and_iteration_goes_on(
    num_parallel_calls, deterministic, source
) -> None:
    bad = {0, 3, 4, 50, 98, 99}
    n = 100
    if source == "range":
        base = hr.Dataset.range(n)
    else:
        base = hr.Dataset.from_generator(
            lambda: iter(range(n)), output_signature=hr.TensorSpec((), "int64")
        )
    ds = base.map(failing(bad), num_parallel_calls=num_parallel_calls, deterministic=deterministic)
    got = drive_dataset(ds)
    expected = expected_map(list(range(n)), bad)
    if deterministic:
        assert got == expected
    else:  # any order, but every element and every error exactly once
        assert sorted(got) == sorted(expected)


def test_one_failing_element_costs_only_itself_in_a_chunk() -> None:
    """The issue's case: a quick fn runs in chunks, and one failure lost 98 of 99 elements."""
    ds = hr.Dataset.range(100).map(failing({1}), num_parallel_calls=2)
    got = drive_dataset(ds)
    assert got == expected_map(list(range(100)), {1})


# -- the error itself: type, traceback, a note that says where ----------------------------


@pytest.mark.parametrize("num_parallel_calls", [None, 2])
@pytest.mark.parametrize("indexed", [True, False])
def test_error_keeps_its_type_and_traceback_and_names_stage_and_element(
    num_parallel_calls, indexed
) -> None:
    source = hr.Dataset.range(10)
    if not indexed:  # a streaming input: no random access under the map
        source = hr.Dataset.from_generator(
            lambda: iter(range(10)), output_signature=hr.TensorSpec((), "int64")
        )
    ds = source.map(explode, num_parallel_calls=num_parallel_calls)
    with iter(ds) as iterator:
        assert [int(next(iterator)) for _ in range(5)] == [0, 1, 2, 3, 4]
        with pytest.raises(KeyError, match="boom at 5") as info:
            next(iterator)
        assert [int(x) for x in iterator] == [6, 7, 8, 9]
    where = "headrace: raised in map(tests.core.test_errors.explode) on element 5"
    shown = "".join(traceback.format_exception(info.value))
    assert 'in explode\n    raise KeyError("boom at 5")' in shown  # the user's own frame
    frames = [frame.name for frame in traceback.extract_tb(info.value.__traceback__)]
    if num_parallel_calls is None:  # raised where it happened: the frames themselves
        assert notes(info.value) == [where]
        assert "explode" in frames
    else:  # held until its turn: its frames as text (frames would keep the chunk alive)
        assert notes(info.value)[1:] == [where]
        assert notes(info.value)[0].startswith(TRACEBACK_NOTE)
        assert "explode" not in frames


def test_note_counts_elements_across_a_checkpoint() -> None:
    ds = hr.Dataset.from_generator(
        lambda: iter(range(10)), output_signature=hr.TensorSpec((), "int64")
    ).map(explode, num_parallel_calls=2)
    with iter(ds) as iterator:
        [next(iterator) for _ in range(3)]
        state = json.loads(json.dumps(iterator.get_state()))
    with iter(ds) as restored:
        restored.set_state(state)
        assert [int(next(restored)) for _ in range(2)] == [3, 4]
        with pytest.raises(KeyError) as info:
            next(restored)
    assert notes(info.value)[-1].endswith("on element 5")


@pytest.mark.parametrize("num_parallel_calls", [None, 2])
def test_stop_iteration_from_fn_is_an_error_not_the_end(num_parallel_calls) -> None:
    def fn(x):
        if int(x) == 2:
            return next(iter(()))  # a StopIteration escaping user code
        return x

    with iter(hr.Dataset.range(5).map(fn, num_parallel_calls=num_parallel_calls)) as iterator:
        assert [int(next(iterator)) for _ in range(2)] == [0, 1]
        with pytest.raises(RuntimeError, match=r"map\(.*fn\) on element 2.*StopIteration"):
            next(iterator)
        assert [int(x) for x in iterator] == [3, 4]  # not silently truncated


def test_filter_and_interleave_and_generator_notes_name_their_stage() -> None:
    def predicate(x):
        if int(x) == 4:
            raise Bad(4)
        return True

    with pytest.raises(Bad) as info:
        list(hr.Dataset.range(6).filter(predicate))
    assert re.fullmatch(r"headrace: raised in filter\(tests\.core\.test_errors\..*\.predicate\) "
                        r"on element 4", notes(info.value)[0])

    def inner(x):
        if int(x) == 1:
            raise Bad(1)
        return hr.Dataset.range(2)

    with pytest.raises(Bad) as info:
        list(hr.Dataset.range(3).interleave(inner, cycle_length=2))
    assert re.fullmatch(r"headrace: raised in interleave\(.*inner\) on element 1", notes(info.value)[0])

    def generate():
        yield 0
        raise Bad(1)

    ds = hr.Dataset.from_generator(generate, output_signature=hr.TensorSpec((), "int64"))
    with pytest.raises(Bad) as info:
        list(ds)
    assert re.fullmatch(r"headrace: raised in from_generator\(.*generate\) on element 1",
                        notes(info.value)[0])


# -- upstream errors under every parallel stage ---------------------------------------------


def _upstream_sources(bad: set[int], n: int) -> dict[str, tuple[hr.Dataset, list[Outcome]]]:
    """Inputs that raise for the elements in ``bad``, with what they must produce."""
    plain = expected_map(list(range(n)), bad)
    keep = [x for x in range(n) if x % 3 != 0 or x in bad]  # filter drops multiples of 3

    def predicate(x):
        if int(x) in bad:
            raise Bad(int(x))
        return int(x) % 3 != 0

    return {
        "map": (hr.Dataset.range(n).map(failing(bad)), plain),
        "streaming map": (
            hr.Dataset.from_generator(
                lambda: iter(range(n)), output_signature=hr.TensorSpec((), "int64")
            ).map(failing(bad)),
            plain,
        ),
        "filter": (hr.Dataset.range(n).filter(predicate), expected_map(keep, bad)),
    }


STAGES: dict[str, Callable[[hr.Dataset], hr.Dataset]] = {
    "parallel map 1": lambda ds: ds.map(lambda x: x, num_parallel_calls=1),
    "parallel map 4": lambda ds: ds.map(lambda x: x, num_parallel_calls=4),
    "parallel map AUTOTUNE": lambda ds: ds.map(lambda x: x, num_parallel_calls=hr.AUTOTUNE),
    "prefetch 1": lambda ds: ds.prefetch(1),
    "prefetch 7": lambda ds: ds.prefetch(7),
    "prefetch AUTOTUNE": lambda ds: ds.prefetch(hr.AUTOTUNE),
    "prefetch twice": lambda ds: ds.prefetch(3).map(lambda x: x, num_parallel_calls=2).prefetch(2),
}


@pytest.mark.parametrize("stage", sorted(STAGES))
@pytest.mark.parametrize("upstream", ["map", "streaming map", "filter"])
def test_upstream_error_under_a_parallel_stage_keeps_every_element(stage, upstream) -> None:
    bad = {0, 2, 3, 40, 63, 64, 65, 199}
    ds, expected = _upstream_sources(bad, 200)[upstream]
    assert drive_dataset(STAGES[stage](ds)) == expected


def test_generator_error_ends_it_as_in_tf_data_under_every_stage() -> None:
    def generate():
        yield from range(5)
        raise Bad(5)

    source = hr.Dataset.from_generator(generate, output_signature=hr.TensorSpec((), "int64"))
    expected = [("ok", v) for v in range(5)] + [("error", 5)]
    for stage in STAGES.values():
        assert drive_dataset(stage(source)) == expected
    assert drive_dataset(source.map(lambda x: x, num_parallel_calls=2, deterministic=False)) == (
        expected
    )


@pytest.mark.parametrize("num_parallel_calls", [None, 1, 2, hr.AUTOTUNE])
@pytest.mark.parametrize("block_length", [1, 2])
def test_interleave_inner_error_in_place_matches_tf_sequential_interleave(
    num_parallel_calls, block_length
) -> None:
    # Measured with tf.data 2.21 (sequential interleave): the error does not count as an
    # element of the block, and the same slot goes on.
    def inner(i):
        return hr.Dataset.range(6).map(lambda x, i=i: x + 10 * i).map(failing({3}))

    ds = hr.Dataset.range(2).interleave(
        inner, cycle_length=2, block_length=block_length, num_parallel_calls=num_parallel_calls
    )
    tf_order = {
        1: [0, 10, 1, 11, 2, 12, "E", 4, 13, 5, 14, 15],
        2: [0, 1, 10, 11, 2, "E", 4, 12, 13, 5, 14, 15],
    }[block_length]
    assert drive_dataset(ds) == [("error", 3) if v == "E" else ("ok", v) for v in tf_order]


@pytest.mark.parametrize("num_parallel_calls", [None, 2])
def test_interleave_input_error_drops_only_that_input_element(num_parallel_calls) -> None:
    # tf.data 2.21: range(4).map(fails on 3).interleave(range(3) + 10 i, cycle_length=2)
    # gives 0 10 1 11 2 12 20 ERR 21 22.
    ds = hr.Dataset.range(4).map(failing({3})).interleave(
        lambda i: hr.Dataset.range(3).map(lambda x, i=i: x + 10 * i),
        cycle_length=2,
        num_parallel_calls=num_parallel_calls,
    )
    ok = [("ok", v) for v in (0, 10, 1, 11, 2, 12, 20)]
    assert drive_dataset(ds) == [*ok, ("error", 3), ("ok", 21), ("ok", 22)]


def test_interleave_nondeterministic_keeps_every_element_and_error() -> None:
    def inner(i):
        return hr.Dataset.range(50).map(lambda x, i=i: x + 100 * i).map(failing({7, 149, 233}))

    ds = hr.Dataset.range(4).interleave(
        inner, cycle_length=3, num_parallel_calls=3, deterministic=False
    )
    expected = expected_map([i * 100 + x for i in range(4) for x in range(50)], {7, 149, 233})
    assert sorted(drive_dataset(ds)) == sorted(expected)


# -- readers: a corrupt TFRecord ------------------------------------------------------------


def _tfrecord_files(directory: Any, files: int = 3, records: int = 6) -> list[str]:
    paths = []
    for shard in range(files):
        path = os.path.join(directory, f"part-{shard}.tfrecord")
        write_tfrecord(path, [b"%d" % (shard * 100 + i) for i in range(records)])
        paths.append(path)
    return paths


def _corrupt_record(path: str, record: int, records: int) -> None:
    size = os.path.getsize(path) // records
    with open(path, "r+b") as handle:
        handle.seek(record * size + 12)  # the record's data
        byte = handle.read(1)
        handle.seek(record * size + 12)
        handle.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize(
    "wrap",
    [
        lambda ds: ds,
        lambda ds: ds.prefetch(2),
        lambda ds: ds.map(lambda r: r, num_parallel_calls=2),
        lambda ds: ds.map(lambda r: r, num_parallel_calls=4).prefetch(hr.AUTOTUNE),
    ],
    ids=["plain", "prefetch", "parallel map", "parallel map + prefetch"],
)
def test_corrupt_record_raises_in_place_then_the_next_file_follows(tmp_path, wrap) -> None:
    # tf.data 2.21 measured: DataLossError, then the rest of that file is skipped and the
    # next file is read (its TFRecordDataset moves on so that the error does not repeat).
    files = _tfrecord_files(tmp_path)
    _corrupt_record(files[1], 2, 6)
    size = os.path.getsize(files[1]) // 6
    with iter(wrap(hr.TFRecordDataset(files))) as iterator:
        got = drive(iterator)
    good = [("ok", v) for v in (0, 1, 2, 3, 4, 5, 100, 101)]
    assert got == [*good, ("error", 2 * size), *[("ok", 200 + i) for i in range(6)]]


def test_corrupt_record_under_parallel_reads_keeps_the_other_files(tmp_path) -> None:
    files = _tfrecord_files(tmp_path, files=2)
    _corrupt_record(files[0], 3, 6)
    with iter(hr.TFRecordDataset(files, num_parallel_reads=2)) as iterator:
        got = drive(iterator)
    size = os.path.getsize(files[0]) // 6
    # Round robin; file 0 ends at its error, file 1 is read to its end.
    assert got == [
        ("ok", 0), ("ok", 100), ("ok", 1), ("ok", 101), ("ok", 2), ("ok", 102),
        ("error", 3 * size), ("ok", 103), ("ok", 104), ("ok", 105),
    ]


@pytest.mark.parametrize("num_parallel_reads", [None, 2])
def test_checkpoints_are_exact_around_a_corrupt_record(tmp_path, num_parallel_reads) -> None:
    files = _tfrecord_files(tmp_path)
    _corrupt_record(files[1], 2, 6)
    ds = hr.TFRecordDataset(files, num_parallel_reads=num_parallel_reads)
    assert_roundtrip_with_errors(ds.prefetch(2))
    assert_roundtrip_with_errors(ds.map(lambda r: r, num_parallel_calls=2))


def test_corrupt_record_note_says_the_rest_of_the_file_is_skipped(tmp_path) -> None:
    files = _tfrecord_files(tmp_path, files=2)
    _corrupt_record(files[0], 1, 6)
    with pytest.raises(hr.DataLossError) as info:
        list(hr.TFRecordDataset(files))
    assert any("rest of file" in note and "part-0" in note for note in notes(info.value))


# -- checkpoints around errors --------------------------------------------------------------


def assert_roundtrip_with_errors(ds: hr.Dataset) -> None:
    """Checkpoint after every outcome (elements and errors), restore, compare the rest."""
    total = drive_dataset(ds)
    for step in range(len(total) + 1):
        with iter(ds) as original:
            head = drive_limit(original, step)
            state = json.loads(json.dumps(original.get_state()))
        with iter(ds) as restored:
            restored.set_state(state)
            rest = drive(restored)
        assert head + rest == total, f"restored after outcome {step}"


def _generated(n: int, bad: set[int]) -> hr.Dataset:
    def generate():
        for value in range(n):
            if value in bad:
                raise Bad(value)
            yield value

    return hr.Dataset.from_generator(generate, output_signature=hr.TensorSpec((), "int64"))


@pytest.mark.parametrize(
    "make",
    [
        lambda: hr.Dataset.range(30).map(failing({0, 4, 5, 29}), num_parallel_calls=2),
        lambda: hr.Dataset.range(30).map(failing({1, 7})).prefetch(4),
        lambda: hr.Dataset.range(30).map(failing({1, 7})).map(lambda x: x, num_parallel_calls=3),
        lambda: hr.Dataset.range(30).filter(failing({2, 9}, lambda v: v % 3 != 0)).prefetch(3),
        lambda: _generated(12, {8}).prefetch(3),
        lambda: _generated(12, {8}).map(lambda x: x, num_parallel_calls=2),
        lambda: hr.Dataset.range(4).interleave(
            lambda i: hr.Dataset.range(5).map(lambda x, i=i: x + 10 * i).map(failing({2, 33})),
            cycle_length=2,
            num_parallel_calls=2,
        ),
    ],
    ids=["pmap", "map-prefetch", "map-pmap", "filter-prefetch", "gen-prefetch", "gen-pmap",
         "interleave"],
)
def test_checkpoints_are_exact_around_errors(make) -> None:
    assert_roundtrip_with_errors(make())


def test_a_failed_generator_restores_as_finished() -> None:
    ds = _generated(6, {3})
    with iter(ds) as iterator:
        assert drive(iterator) == [("ok", 0), ("ok", 1), ("ok", 2), ("error", 3)]
        state = json.loads(json.dumps(iterator.get_state()))
    with iter(ds) as restored:
        restored.set_state(state)
        assert drive(restored) == []  # ended, as the original did; no error replayed


# -- random pipelines against a plain sequential model ----------------------------------------


class Model:
    """The same pipeline as plain Python over lists of outcomes (the reference)."""

    @staticmethod
    def map(items: list[Outcome], bad: set[int]) -> list[Outcome]:
        return [("error", v) if kind == "ok" and v in bad else (kind, v) for kind, v in items]

    @staticmethod
    def filter(items: list[Outcome], bad: set[int]) -> list[Outcome]:
        return [
            ("error", v) if kind == "ok" and v in bad else (kind, v)
            for kind, v in items
            if kind == "error" or v in bad or v % 3 != 0
        ]

    @staticmethod
    def interleave(
        items: list[Outcome], bad: set[int], cycle_length: int, block_length: int
    ) -> list[Outcome]:
        """tf.data's sequential interleave; an error is output in place, never advances."""
        slots: list[Any] = [None] * cycle_length
        inputs = iter(items)
        cycle = block = num_open = 0
        end = False
        out: list[Outcome] = []
        while not end or num_open:
            if slots[cycle] is not None:
                item = next(slots[cycle], None)
                if item is None:
                    slots[cycle], num_open = None, num_open - 1
                    cycle, block = (cycle + 1) % cycle_length, 0
                    continue
                out.append(item)
                if item[0] == "ok":
                    block += 1
                    if block == block_length:
                        cycle, block = (cycle + 1) % cycle_length, 0
            elif not end:
                item = next(inputs, None)
                if item is None:
                    end = True
                elif item[0] == "error":
                    out.append(item)
                else:
                    slots[cycle] = iter(Model.map(_inner_items(item[1]), bad))
                    num_open += 1
            else:
                cycle, block = (cycle + 1) % cycle_length, 0
        return out


def _inner_items(value: int) -> list[Outcome]:
    return [("ok", 1000 * (value + 1) + j) for j in range(value % 4)]


def _inner_dataset(bad: set[int]) -> Callable[[Any], hr.Dataset]:
    def make(x: Any) -> hr.Dataset:
        value = int(x)
        base = 1000 * (value + 1)
        return hr.Dataset.range(base, base + value % 4).map(failing(bad))

    return make


_parallel = st.sampled_from([1, 2, 4, hr.AUTOTUNE])
_bad = st.sets(st.integers(0, 40), max_size=8).map(
    lambda small: small | {1000 * (v + 1) + j for v in small for j in range(3) if (v + j) % 5 == 0}
)
_stage = st.one_of(
    st.tuples(st.just("map"), _bad),
    st.tuples(st.just("parallel map"), _bad, _parallel, st.booleans()),
    st.tuples(st.just("prefetch"), st.sampled_from([1, 3, hr.AUTOTUNE])),
    st.tuples(st.just("filter"), _bad),
    st.tuples(
        st.just("interleave"),
        _bad,
        st.integers(1, 3),
        st.integers(1, 2),
        st.sampled_from([None, 1, 2, hr.AUTOTUNE]),
        st.booleans(),
    ),
)


def _build(n: int, stages: list[tuple[Any, ...]]) -> tuple[hr.Dataset, list[Outcome], bool]:
    ds = hr.Dataset.range(n)
    items: list[Outcome] = [("ok", v) for v in range(n)]
    deterministic = True
    for stage in stages:
        kind = stage[0]
        if kind == "map":
            ds, items = ds.map(failing(stage[1])), Model.map(items, stage[1])
        elif kind == "parallel map":
            _, bad, parallel, det = stage
            ds = ds.map(failing(bad), num_parallel_calls=parallel, deterministic=det)
            items, deterministic = Model.map(items, bad), deterministic and det
        elif kind == "prefetch":
            ds = ds.prefetch(stage[1])
        elif kind == "filter":
            bad = stage[1]

            def predicate(x: Any, bad: set[int] = bad) -> bool:
                if int(x) in bad:
                    raise Bad(int(x))
                return int(x) % 3 != 0

            ds, items = ds.filter(predicate), Model.filter(items, bad)
        else:
            _, bad, cycle_length, block_length, parallel, det = stage
            if parallel is not None and parallel != hr.AUTOTUNE:
                parallel = min(parallel, cycle_length)
            ds = ds.interleave(
                _inner_dataset(bad),
                cycle_length=cycle_length,
                block_length=block_length,
                num_parallel_calls=parallel,
                deterministic=det if parallel is not None else None,
            )
            items = Model.interleave(items, bad, cycle_length, block_length)
            deterministic = deterministic and (det or parallel is None)
    return ds, items, deterministic


@pytest.mark.timeout(240)
@settings(max_examples=70, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(0, 40),
    stages=st.lists(_stage, min_size=1, max_size=3),
    checkpoint_at=st.floats(0, 1),
)
def test_random_pipelines_match_a_sequential_loop(n, stages, checkpoint_at) -> None:
    # Interleave's inputs become the values it opens; keep the inputs of a later
    # interleave small enough that inner datasets stay small.
    ds, expected, deterministic = _build(n, stages)
    got = drive_dataset(ds)
    if not deterministic:
        assert sorted(got) == sorted(expected)
        return
    assert got == expected
    step = round(checkpoint_at * len(expected))
    with iter(ds) as original:
        head = drive_limit(original, step)
        state = json.loads(json.dumps(original.get_state()))
    with iter(ds) as restored:
        restored.set_state(state)
        assert head + drive(restored) == expected, f"restored after outcome {step}"


def test_generator_element_of_the_wrong_type_is_an_error_then_the_next_follows() -> None:
    # tf.data 2.21: a generator yielding 1, "a", 3 for int64 gives 1, an error, 3.
    ds = hr.Dataset.from_generator(
        lambda: iter([1, "a", 3]), output_signature=hr.TensorSpec((), "int64")
    )
    for wrapped in (ds, ds.prefetch(2), ds.map(lambda x: x, num_parallel_calls=2)):
        with iter(wrapped) as iterator:
            assert int(next(iterator)) == 1
            with pytest.raises(hr.ElementSpecError, match="element 1"):
                next(iterator)
            assert [int(x) for x in iterator] == [3]


class _Flaky:
    """An iterator (not a generator) that fails on some elements and can go on, as a
    reader over a network might: tf.data asks it for the next element after an error."""

    def __init__(self, n: int, bad: set[int]) -> None:
        self.values, self.bad = iter(range(n)), bad

    def __iter__(self) -> _Flaky:
        return self

    def __next__(self) -> int:
        value = next(self.values)
        if value in self.bad:
            raise Bad(value)
        return value


def test_an_iterator_that_can_go_on_after_an_error_does() -> None:
    ds = hr.Dataset.from_generator(
        lambda: _Flaky(8, {2, 5}), output_signature=hr.TensorSpec((), "int64")
    )
    expected = expected_map(list(range(8)), {2, 5})
    assert drive_dataset(ds) == expected
    assert drive_dataset(ds.prefetch(3)) == expected
    assert_roundtrip_with_errors(ds)
    assert_roundtrip_with_errors(ds.map(lambda x: x, num_parallel_calls=2))


def test_batched_records_before_a_corrupt_one_all_come_out(tmp_path) -> None:
    files = _tfrecord_files(tmp_path)
    _corrupt_record(files[1], 2, 6)
    size = os.path.getsize(files[1]) // 6
    with iter(hr.TFRecordDataset(files).batch(4)) as iterator:
        assert [[int(r) for r in next(iterator)] for _ in range(2)] == [
            [0, 1, 2, 3],
            [4, 5, 100, 101],  # the good records of the bad file, up to the bad one
        ]
        with pytest.raises(hr.DataLossError) as info:
            next(iterator)
        assert info.value.offset == 2 * size
        assert [[int(r) for r in batch] for batch in iterator] == [[200, 201, 202, 203], [204, 205]]


# -- a held error pins no memory (G1) ------------------------------------------------------


class _Payload:
    """Stands for an element (weakly referenceable, unlike a list)."""


def test_a_held_error_keeps_no_frame_and_so_no_element_alive() -> None:
    """An error a stage keeps for its element's turn: its traceback's frames held their
    locals, and each frame its caller (f_back) with the locals that caller had when it
    returned — a parallel map's whole chunk of inputs. ``unpin`` drops the frames, keeps
    their lines as one note (merged when the error is held again after it was raised),
    and does the same for the error's cause."""
    from headrace.core.handoff import unpin

    refs: list[Any] = []

    def raising() -> None:
        temporary = _Payload()  # the function's own temporary
        refs.append(weakref.ref(temporary))
        try:
            raise KeyError("inner")
        except KeyError as cause:
            raise ValueError("bad element") from cause

    def catcher() -> BaseException:
        chunk = [_Payload()]  # what the catching stage held: it returns meanwhile
        refs.append(weakref.ref(chunk[0]))
        try:
            raising()
        except ValueError as error:
            return unpin(error)
        raise AssertionError("did not raise")

    error = catcher()
    gc.collect()
    assert [ref() for ref in refs] == [None, None]
    assert error.__traceback__ is None and error.__cause__ is not None
    assert error.__cause__.__traceback__ is None
    (note,) = notes(error)
    assert note.startswith(TRACEBACK_NOTE)
    assert 'in raising\n    raise ValueError("bad element") from cause' in note
    assert 'raise KeyError("inner")' in notes(error.__cause__)[0]

    def handing_out() -> None:
        raise error

    try:
        handing_out()
    except ValueError as again:  # raised in its turn, then held by a stage further on
        unpin(again)
    (merged,) = notes(error)
    assert merged.index("in handing_out") < merged.index("in raising")  # outermost first


# -- bad arguments an outsider tried: each error says what was wrong ----------------------


@pytest.mark.parametrize("value", ["-5MiB", "12 parsecs", 0, float("nan"), True])
def test_a_bad_memory_budget_names_the_option(value: Any) -> None:
    with pytest.raises(hr.InvalidArgumentError, match=r"^memory_budget: "):
        hr.Options(memory_budget=value)


def test_a_tf_data_option_group_names_headraces_options() -> None:
    """``options.threading.private_threadpool_size = 2`` (tf.data's usual line) read a
    group that does not exist: a bare AttributeError said nothing of what does."""
    from headrace import tf_compat as tf

    options = tf.data.Options()
    with pytest.raises(AttributeError, match=r"no 'threading' group.*memory_budget"):
        options.threading.private_threadpool_size = 2
    assert not hasattr(options, "no_such_thing")  # (other names: plain AttributeError)


def test_a_ragged_nested_list_is_refused_naming_the_source() -> None:
    with pytest.raises(hr.ElementSpecError, match=(
            r"from_tensor_slices: a nested list whose rows have different lengths")):
        hr.Dataset.from_tensor_slices([[1, 2], [3]])


def test_sizes_that_round_alike_are_told_apart() -> None:
    """A refusal compares what is needed with the budget: rounded to 0.1 MiB both read
    '64.0 MiB', which hid why."""
    from headrace._memory.units import format_apart

    assert format_apart(64 * 2**20 + 512, 64 * 2**20) == ("67,109,376 B", "67,108,864 B")
    assert format_apart(65 * 2**20, 64 * 2**20) == ("65.0 MiB", "64.0 MiB")
    ds = hr.Dataset.from_tensor_slices(np.zeros((64, 2**20 + 64), np.uint8)).map(np.copy).batch(64)
    with pytest.raises(hr.MemoryBudgetError, match=r"\d[\d,]* B at once, more than the "
                                                   r"memory budget of 67,108,864 B"):
        list(ds.with_options(hr.Options(memory_budget="64MiB")))


def _outcomes_until_the_end(iterator: Any, limit: int = 50) -> list[str]:
    """What a loop that catches every error and goes on sees, call by call."""
    seen: list[str] = []
    for _ in range(limit):
        try:
            seen.append(bytes(next(iterator))[:1].decode() or "-")
        except StopIteration:
            seen.append("end")
            if seen[-2:] == ["end", "end"]:
                return seen[:-1]
        except Exception as error:  # (the loop under test catches everything)
            seen.append(type(error).__name__)
    return seen


def _stuck_pipelines(tmp_path: Any) -> list[hr.Dataset]:
    """Pipelines that cannot read past a record: the minimum working set of the stage
    that must hold it is over the budget, whatever comes after."""
    mib = 1 << 20
    paths = []
    for shard in range(3):
        path = str(tmp_path / f"{shard}.tfrecord")
        big = 2 * mib if shard else 64
        write_tfrecord(path, [b"%d" % shard + b"x" * (big if row else 64) for row in range(4)])
        paths.append(path)
    files = hr.Dataset.from_tensor_slices(paths)
    return [
        hr.TFRecordDataset(paths[1]).with_options(hr.Options(memory_budget=mib)),
        files.interleave(hr.TFRecordDataset, cycle_length=4, block_length=2)
        .with_options(hr.Options(memory_budget=8 * mib)),
        files.interleave(hr.TFRecordDataset, cycle_length=4, num_parallel_calls=2)
        .with_options(hr.Options(memory_budget=8 * mib)),
    ]


@pytest.mark.parametrize("case", range(3))
def test_an_error_raised_again_without_moving_ends_the_stream(tmp_path, case) -> None:
    # A loop that catches errors and calls next() again used to spin forever on a
    # refusal the pipeline can never get past.
    ds = _stuck_pipelines(tmp_path)[case]
    read = [["1"], ["0", "0", "1"], ["0", "1", "2", "0"]][case]  # up to the stuck record
    with iter(ds) as iterator:
        assert _outcomes_until_the_end(iterator) == read + ["MemoryBudgetError"] * 3 + ["end"]
    with iter(ds) as iterator:
        errors = []
        for _ in range(len(read) + 3):
            try:
                next(iterator)
            except hr.MemoryBudgetError as error:
                errors.append(notes(error))
        assert "cannot go on" in " ".join(errors[-1]) and not any(
            "cannot go on" in note for earlier in errors[:-1] for note in earlier)
        with pytest.raises(StopIteration):
            next(iterator)


def test_a_restore_goes_on_after_a_stream_ended_by_an_error(tmp_path) -> None:
    ds = _stuck_pipelines(tmp_path)[1]
    with iter(ds) as iterator:
        first = bytes(next(iterator))
        state = iterator.get_state()
        after = _outcomes_until_the_end(iterator)
        iterator.set_state(state)  # the same state again: the same outcomes, then the end
        assert _outcomes_until_the_end(iterator) == after
    with iter(ds) as fresh:
        assert bytes(next(fresh)) == first


@pytest.mark.parametrize("num_parallel_calls", [None, 2])
def test_the_same_error_for_every_element_does_not_end_the_stream(num_parallel_calls) -> None:
    # Errors in elements' places move the stream: every element's comes out.
    def always(x: Any) -> Any:
        raise ValueError("this element is bad")  # the same message every time

    ds = hr.Dataset.range(12).map(always, num_parallel_calls=num_parallel_calls)
    with iter(ds) as iterator:
        seen = []
        for _ in range(20):
            try:
                next(iterator)
            except StopIteration:
                break
            except ValueError as error:
                assert not any("cannot go on" in note for note in notes(error))
                seen.append("error")
        assert seen == ["error"] * 12


class _Unreachable:
    """A source that fails in the same place every time it is asked (a network read
    that may succeed later): the caller decides how often to ask again."""

    def __iter__(self) -> _Unreachable:
        return self

    def __next__(self) -> int:
        raise ConnectionResetError("connection reset by peer")


def test_a_user_error_raised_again_in_place_is_left_to_the_caller() -> None:
    ds = hr.Dataset.from_generator(_Unreachable, output_signature=hr.TensorSpec((), "int64"))
    with iter(ds) as iterator:
        for _ in range(10):
            with pytest.raises(ConnectionResetError):
                next(iterator)


def _ranges_failing_at_zero(x: Any) -> Any:
    if int(x) == 0:
        raise Bad(0)
    return np.arange(int(x))


def test_a_failing_first_element_is_raised_by_the_run_not_by_iter() -> None:
    # Learning a spec from the first element made iter() itself raise its error, which
    # ignore_errors could not drop (tf.data traces instead: [[0, 0], [0, 1]], [[0, 1, 2]]).
    batched = hr.Dataset.range(4).map(_ranges_failing_at_zero).padded_batch(2)
    assert [b.tolist() for b in batched.ignore_errors()] == [[[0, 0], [0, 1]], [[0, 1, 2]]]
    with iter(batched) as iterator:
        with pytest.raises(Bad):
            next(iterator)
        assert [b.tolist() for b in iterator] == [[[0, 0], [0, 1]], [[0, 1, 2]]]
    scanned = hr.Dataset.range(4).map(failing({0})).scan(
        np.int64(0), lambda state, x: (state + x, state + x))
    assert [int(x) for x in scanned.ignore_errors()] == [1, 3, 6]
    grouped = hr.Dataset.range(6).map(failing({0})).group_by_window(
        lambda x: x % 2, lambda key, window: window.batch(3), window_size=3)
    assert sorted(b.tolist() for b in grouped.ignore_errors()) == [[1, 3, 5], [2, 4]]
    with pytest.raises(Bad):  # (no element at all comes out: the first error is raised)
        iter(hr.Dataset.range(3).map(failing({0, 1, 2})).padded_batch(2))

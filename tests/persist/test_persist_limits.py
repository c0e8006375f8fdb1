"""Writing to disk within the caps: open files (G2) for ``save``, bytes (G1) for
``save_tfrecords`` of large batches and ``headrace convert`` of a ``.npy``.

Each promise is checked over seeded random cases against an oracle:

* ``save`` with many shards under a small ``max_open_files``: the elements loaded
  back equal the input's, in order; the process never has more descriptors open
  beyond its start than the cap (sampled, and counted at each shard file opened).
* ``save`` in a process whose ``ulimit -n`` is low: it finishes, no EMFILE.
* a cap too small to write at all: a FileLimitError naming the stage.
* ``convert`` of a ``.npy`` of large rows with the default ``--batch-size``: the
  records read back equal the array; the process grows less than budget + 10% +
  64 MiB (the ``.npy`` is memory-mapped: its pages are the file's, not counted).
* ``save_tfrecords(batched=True)``: the records equal ``serialize_example`` of
  each row, however the batch is cut into slices.
* ``save_tfrecords`` of small dicts: an element is sized at no less than the bytes
  its values hold, without an ABC's isinstance or a ``sys.getsizeof`` of an array
  or a scalar (per element, they cost a fifth of the write speed).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import headrace as hr
from headrace._persist import saved, writers
from headrace.io.example.encoding import serialize_example
from headrace.io.example.parsing import parse_single_example
from headrace.io.example.specs import FixedLenFeature

MiB = 1 << 20
from fuzz_pipelines import PeakGrowth  # noqa: E402


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd")) - 1  # (listing them opens one)


class _FdWatch:
    """The most descriptors this process had open beyond its start: sampled, and
    counted each time ``save`` opens a shard file (where a peak is made)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.base = _open_fds()
        self.peak = self.base
        watch = self

        class Counted(saved.TFRecordWriter):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                watch.peak = max(watch.peak, _open_fds())

        monkeypatch.setattr(saved, "TFRecordWriter", Counted)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self.done.is_set():
            self.peak = max(self.peak, _open_fds())
            time.sleep(0.0005)

    def __enter__(self) -> _FdWatch:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join()

    @property
    def extra(self) -> int:
        return self.peak - self.base


def _save_case(seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    return {
        "seed": seed,
        "cap": rng.randint(3, 12),
        "num_shards": rng.choice((rng.randint(2, 20), rng.randint(20, 90))),
        "count": rng.randint(50, 600),
        "width": rng.choice((1, 4, 300, 5000)),  # elements of 8 B to 40 KB
        "compression": rng.choice((None, None, "GZIP")),
        "shard_func": rng.random() < 0.3,
        "interval": rng.choice((None, None, rng.randint(20, 200))),
    }


def _by_key(element: Any) -> Any:
    return element["id"] % 7


@pytest.mark.parametrize("seed", range(8))
def test_save_keeps_its_shard_files_within_the_cap(
    seed: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    case = _save_case(seed)
    count, width = case["count"], case["width"]
    ids = np.arange(count, dtype=np.int64)
    values = np.arange(count * width, dtype=np.float32).reshape(count, width)
    options = hr.Options(max_open_files=case["cap"], memory_budget="32MiB")
    ds = hr.Dataset.from_tensor_slices({"x": values, "id": ids}).with_options(options)
    arguments: dict[str, Any] = {"num_shards": case["num_shards"]}
    if case["shard_func"]:
        arguments["shard_func"] = _by_key
    if case["interval"]:
        arguments["checkpoint_args"] = {"checkpoint_interval": case["interval"]}
    with _FdWatch(monkeypatch) as watch:
        ds.save(tmp_path, compression=case["compression"], **arguments)
    assert watch.extra <= case["cap"], (case, watch.extra)

    loaded = [int(e["id"]) for e in hr.Dataset.load(tmp_path)]
    if case["shard_func"]:
        # the oracle: each shard's elements in input order, shards interleaved
        shards = [[i for i in range(count) if i % 7 == k] for k in range(7)]
        expected = [s[r] for r in range(max(map(len, shards))) for s in shards if r < len(s)]
    else:
        expected = list(range(count))
    assert loaded == expected, case
    element = next(iter(hr.Dataset.load(tmp_path).skip(count // 2)))
    np.testing.assert_array_equal(element["x"], values[expected[count // 2]])


def test_save_refuses_a_cap_too_small_naming_the_stage(tmp_path: Path) -> None:
    ds = hr.Dataset.range(10).with_options(hr.Options(max_open_files=2))
    with pytest.raises(hr.FileLimitError) as refused:
        ds.save(tmp_path, num_shards=4)
    message = str(refused.value)
    assert "stage 'save'" in message and "max_open_files=2" in message, message
    assert "at least 3" in message, message
    assert not list(tmp_path.glob("shard-*")), "a refused save leaves no shard file"


_ULIMIT_SCRIPT = textwrap.dedent(
    """
    import resource, sys
    resource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    import numpy as np, headrace as hr
    ds = hr.Dataset.from_tensor_slices({{"x": np.arange({count} * 4, dtype=np.float32).reshape({count}, 4)}})
    ds.save(sys.argv[1], num_shards={shards})
    got = [float(e["x"][0]) for e in hr.Dataset.load(sys.argv[1])]
    assert got == [4.0 * i for i in range({count})], got[:10]
    print("ok")
    """
)


@pytest.mark.parametrize("seed", range(2))
def test_save_with_more_shards_than_ulimit_allows(seed: int, tmp_path: Path) -> None:
    """``ulimit -n`` of 48-64 (a cap of 12-16) and 100-250 shards: every shard written,
    no EMFILE (which the save died with when it kept every shard open)."""
    rng = random.Random(seed)
    script = _ULIMIT_SCRIPT.format(
        limit=rng.randint(48, 64), count=rng.randint(300, 1000), shards=rng.randint(80, 200)
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "out")],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


# --------------------------------------------------------------------------- bytes


def _convert_case(seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    row_bytes = rng.choice((256 << 10, 512 << 10, 1 << 20))
    budget = rng.choice((8, 16)) * MiB
    # more than twice the bound in all: the old writer held the records twice over
    rows = (rng.randint(90, 140) * MiB) // row_bytes
    return {"seed": seed, "row_floats": row_bytes // 4, "rows": rows, "budget": budget,
            "shards": rng.randint(1, 4), "batch": rng.choice((None, 4096, rows))}


@pytest.mark.parametrize("seed", range(3))
def test_convert_npy_keeps_the_budget_with_large_rows(seed: int, tmp_path: Path) -> None:
    from headrace.cli import main

    case = _convert_case(seed)
    rows, width = case["rows"], case["row_floats"]
    source = tmp_path / "f.npy"
    array = np.lib.format.open_memmap(source, mode="w+", dtype=np.float32, shape=(rows, width))
    array[:] = np.arange(rows, dtype=np.float32)[:, None]
    array.flush()
    del array
    out = tmp_path / "out"
    command = ["convert", str(source), str(out), "--shards", str(case["shards"]),
               "--memory-budget", str(case["budget"]), "--progress", "never"]
    if case["batch"] is not None:
        command += ["--batch-size", str(case["batch"])]
    with PeakGrowth(trim=False) as memory:
        assert main(command) == 0
    bound = int(case["budget"] * 1.1) + 64 * MiB
    assert memory.growth <= bound, (case, memory.growth / MiB, bound / MiB)

    spec = {"x": FixedLenFeature((width,), np.float32)}
    firsts = []
    for shard in sorted(out.glob("*.tfrecord")):
        for record in hr.TFRecordDataset(str(shard)):
            x = parse_single_example(record, spec)["x"]
            assert (x == x[0]).all()
            firsts.append(float(x[0]))
    assert firsts == [float(i) for i in range(rows)], case


def _batch_case(seed: int) -> tuple[dict[str, Any], int]:
    rng = random.Random(seed)
    rows = rng.randint(0, 40)
    width = rng.choice((1, 100, 60_000, 300_000))  # rows of 4 B to 1.2 MB
    batch: dict[str, Any] = {
        "x": np.random.default_rng(seed).random((rows, width), dtype=np.float32),
        "id": np.arange(rows, dtype=np.int64),
    }
    if rng.random() < 0.5:
        batch["tag"] = [f"row{i}".encode() * rng.randint(1, 50) for i in range(rows)]
    if rng.random() < 0.3:
        batch["pair"] = tuple([i, -i] for i in range(rows))
    return batch, rows


@pytest.mark.parametrize("seed", range(12))
def test_a_batch_in_slices_gives_the_records_of_its_rows(seed: int) -> None:
    """The oracle: ``serialize_example`` of each row, in order, byte for byte."""
    batch, rows = _batch_case(seed)
    records = [r for chunk in writers._encode_batch(batch, 0) for r in chunk]
    expected = [serialize_example({k: v[i] for k, v in batch.items()}) for i in range(rows)]
    assert records == expected
    sizes = [sum(map(len, chunk)) for chunk in writers._encode_batch(batch, 0)]
    row_bytes = max(1, max(map(len, expected), default=1))
    assert max(sizes, default=0) <= writers.CHUNK_BYTES + row_bytes


def test_a_bad_row_of_a_sliced_batch_is_named_by_its_row(tmp_path: Path) -> None:
    rows = 40
    batch = {"x": np.zeros((rows, 60_000), np.float32), "tag": [b"ok"] * rows}
    batch["tag"][33] = object()
    with pytest.raises(hr.InvalidArgumentError, match="row 33 of element 0"):
        writers.save_tfrecords([batch], str(tmp_path), batched=True, progress=False)
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("seed", range(2))
def test_save_tfrecords_of_large_dict_elements_keeps_the_budget(seed: int, tmp_path: Path) -> None:
    """Unbatched dicts of large float64 arrays (an id beside): the writer's chunk is
    bounded by the arrays' bytes, so the process grows less than budget + 10% +
    64 MiB + one element, and every Example reads back in its shard."""
    from headrace._persist.writers import save_tfrecords
    from headrace.io.example import decode_example
    from headrace.io.tfrecord import open_tfrecord

    rng = random.Random(seed)
    budget = rng.choice((8, 16)) * MiB
    floats = rng.choice((32_768, 131_072))  # 256 KiB or 1 MiB a row
    count = (rng.randint(160, 220) * MiB) // (floats * 8)

    def row(i: Any) -> dict[str, Any]:
        return {"x": np.full(floats, float(i)), "id": np.int64(i)}

    ds = hr.Dataset.range(count).map(row).with_options(hr.Options(memory_budget=budget))
    with PeakGrowth(trim=False) as memory:
        paths = save_tfrecords(ds, str(tmp_path), num_shards=rng.randint(1, 16), progress=False)
    bound = int(budget * 1.1) + 64 * MiB + floats * 8
    assert memory.growth <= bound, (seed, memory.growth / MiB, bound / MiB)
    got = []
    for path in paths:
        with open_tfrecord(path) as reader:
            for record in reader:
                example = decode_example(record)
                (i,) = example["id"][1]
                x = example["x"][1]
                assert len(x) == floats and float(x[0]) == float(x[-1]) == float(i)
                got.append(int(i))
    assert got == list(range(count))


@pytest.mark.parametrize("seed", range(4))
def test_save_tfrecords_round_robin_keeps_the_datasets_cap(seed: int, tmp_path: Path) -> None:
    """Round-robin (the record count unknown) keeps every shard open: more shards than
    the dataset's ``Options(max_open_files=...)`` is refused before any file is made;
    as many as it allows are written, each record in shard ``i % num_shards``."""
    from headrace.io.example import decode_example

    rng = random.Random(seed)
    cap = rng.randint(2, 10)
    num_shards = rng.choice((rng.randint(cap + 1, 40), rng.randint(1, cap)))
    count = rng.randint(0, 300)
    ds = (
        hr.Dataset.range(count).filter(lambda i: i >= 0).map(lambda i: {"id": i})
        .with_options(hr.Options(max_open_files=cap))
    )
    if num_shards > cap:
        with pytest.raises(hr.InvalidArgumentError, match=r"Options\(max_open_files=\.\.\.\)"):
            ds.save_tfrecords(str(tmp_path), num_shards=num_shards, progress=False)
        assert not os.listdir(tmp_path)
        return
    before = _open_fds()
    paths = ds.save_tfrecords(str(tmp_path), num_shards=num_shards, progress=False)
    assert _open_fds() == before
    for shard, path in enumerate(paths):
        ids = [int(decode_example(r)["id"][1][0]) for r in hr.TFRecordDataset(path)]
        assert ids == list(range(shard, count, num_shards))


def _element_of_kinds(seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    gen = np.random.default_rng(seed)
    makers = [
        lambda: gen.random(rng.randint(0, 3000)).astype(rng.choice((np.float32, np.float64))),
        lambda: np.int64(rng.randint(-(2**40), 2**40)),
        lambda: np.float32(rng.random()),
        lambda: np.bytes_(b"b" * rng.randint(0, 5000)),
        lambda: rng.randint(-(2**62), 2**62),
        lambda: rng.random(),
        lambda: b"v" * rng.randint(0, 5000),
        lambda: "s" * rng.randint(0, 5000),
    ]
    return {f"f{i}": rng.choice(makers)() for i in range(rng.randint(1, 6))}


def _bytes_held(value: Any) -> int:
    if isinstance(value, (np.ndarray, np.generic)):
        return int(value.nbytes)
    return len(value) if isinstance(value, (bytes, str)) else 0


@pytest.mark.parametrize("seed", range(24))
def test_an_element_is_sized_by_its_values_without_abc_checks_or_getsizeof(seed: int) -> None:
    """The oracle: the bytes the element's values hold bound its size from below, and
    only a value that is neither an array nor a number is asked its ``sys.getsizeof``."""
    element = _element_of_kinds(seed)
    assert writers._payload_bytes_of(element) >= sum(map(_bytes_held, element.values()))

    calls: list[str] = []

    def watch(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            calls.append(frame.f_code.co_name)
        elif event == "c_call":
            calls.append(getattr(arg, "__name__", ""))

    sys.setprofile(watch)
    try:
        writers._element_mapping(element, "element 0")
        writers._payload_bytes_of(element)
    finally:
        sys.setprofile(None)
    others = [v for v in element.values()
              if not isinstance(v, (np.ndarray, np.generic, int, float))]
    assert "__instancecheck__" not in calls, calls  # an ABC's isinstance, per element
    assert calls.count("getsizeof") == len(others), (calls, element.keys())


@pytest.mark.parametrize("seed", range(6))
def test_the_writer_cuts_chunks_where_payload_bytes_of_says(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer sizes a dict element inline (per element: a call less); the oracle is
    :func:`writers._payload_bytes_of` summed per chunk, cut at CHUNK_ELEMENTS elements or
    CHUNK_BYTES bytes. Elements of every kind, large arrays among them, and mappings
    that are not dicts (sized by the function itself)."""
    from types import MappingProxyType

    rng = random.Random(seed)
    elements: list[Any] = []
    for i in range(rng.randint(1500, 3000)):
        element: Any = _element_of_kinds(seed * 10_000 + i)
        if rng.random() < 0.05:
            element["big"] = np.zeros(rng.randint(1, 400_000), np.float32)
        if rng.random() < 0.1:
            element = MappingProxyType(element)
        elements.append(element)
    expected, count, nbytes = [], 0, 0
    for element in elements:
        count += 1
        nbytes += writers._payload_bytes_of(element)
        if count == writers.CHUNK_ELEMENTS or nbytes >= writers.CHUNK_BYTES:
            expected.append(count)
            count = nbytes = 0
    if count:
        expected.append(count)
    monkeypatch.setattr(writers, "_encode_rows", lambda pending, first: list(pending))
    chunks = list(writers._record_chunks(elements, batched=False))
    assert [len(chunk) for chunk in chunks] == expected
    assert [e for chunk in chunks for e in chunk] == elements
    assert any(n < writers.CHUNK_ELEMENTS for n in expected[:-1])  # (cut by bytes too)

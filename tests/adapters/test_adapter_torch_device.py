"""``to_torch(device=..., pin_memory=True)``: the ring of reused host buffers.

CI has no GPU, so the ring's logic is proven through its transfer-backend
interface: :class:`CpuBackend` and test backends whose copies are slow
(asynchronous, on their own thread, finishing in random order) or fail. What a
user relies on: the same batches in the same order as without the ring; no
buffer written while a copy reads it; errors at their batch; checkpoints at the
last batch handed over; the ring booked on the budget; no thread left behind.
"""

from __future__ import annotations

import gc
import random
import threading
import time
import warnings
import zlib
from typing import Any

import numpy as np
import pytest

import headrace as hr
from headrace.adapters.torch_device import (
    CpuBackend,
    DeviceTransferNode,
    Transfer,
    TransferBackend,
    _IndexSource,
)

torch = pytest.importorskip("torch")

MiB = 1 << 20


class _AsyncTransfer(Transfer):
    def __init__(self, thread: threading.Thread) -> None:
        self.thread = thread
        self.handed = False

    def wait(self) -> None:
        self.thread.join()

    def hand_over(self) -> None:
        self.thread.join()  # as the consumer's stream waits on the copy's event
        self.handed = True


class SlowBackend(TransferBackend):
    """Copies on their own thread after a random delay, like a DMA engine behind a
    busy stream. Each copy checksums its host memory when issued and again when it
    reads it: a ring that overwrote a buffer in use shows up as a torn copy."""

    def __init__(self, seed: int = 0, max_delay: float = 0.004,
                 fail_first: set[int] | None = None):
        self.rng = random.Random(seed)
        self.max_delay = max_delay
        self.fail_first = fail_first or set()  # fail the copy of a batch starting so
        self.copies = 0
        self.torn: list[int] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.allocated: list[int] = []
        self.lock = threading.Lock()

    def allocate(self, nbytes: int) -> Any:
        self.allocated.append(nbytes)
        return super().allocate(nbytes)

    def copy(self, host: list[Any]) -> tuple[list[Any], Transfer]:
        with self.lock:
            number = self.copies
            self.copies += 1
            delay = self.rng.random() * self.max_delay
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        first = int(host[0].reshape(-1)[0]) if host and host[0].numel() else None
        if first in self.fail_first:
            with self.lock:
                self.in_flight -= 1
            raise RuntimeError(f"injected copy failure at the batch starting {first}")
        before = [zlib.crc32(t.numpy().tobytes()) for t in host]
        out = [torch.empty_like(t) for t in host]

        def run() -> None:
            time.sleep(delay)
            for src, dst in zip(host, out, strict=True):
                dst.copy_(src)
            after = [zlib.crc32(t.numpy().tobytes()) for t in out]
            with self.lock:
                if after != before:
                    self.torn.append(number)
                self.in_flight -= 1

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return out, _AsyncTransfer(thread)


def _device(ds: hr.Dataset, backend: TransferBackend, threads: int = 3, depth: int = 3
            ) -> hr.Dataset:
    node = DeviceTransferNode(ds.node, "cpu", threads=threads, depth=depth,
                              backend=lambda _device: backend)
    return ds.derive(node)


def _numpy(element: Any) -> Any:
    if isinstance(element, dict):
        return {k: _numpy(v) for k, v in element.items()}
    if isinstance(element, tuple):
        return tuple(_numpy(v) for v in element)
    return element.numpy() if isinstance(element, torch.Tensor) else element


def _assert_same(expected: list[Any], got: list[Any]) -> None:
    assert len(got) == len(expected)
    for i, (a, b) in enumerate(zip(expected, got, strict=True)):
        a_leaves, b_leaves = hr._structure.flatten(a), hr._structure.flatten(_numpy(b))
        assert len(a_leaves) == len(b_leaves)
        for x, y in zip(a_leaves, b_leaves, strict=True):
            assert np.array_equal(np.asarray(x), np.asarray(y)), f"batch {i} differs"
            assert np.asarray(x).dtype == np.asarray(y).dtype


def _ring_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("headrace-to-device")]


def _double(e: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {**e, "x": e["x"] * 2}


def _random_pipeline(rng: random.Random) -> hr.Dataset:
    n = rng.randint(0, 300)
    rows = {
        "id": np.arange(n, dtype=rng.choice([np.int64, np.int32])),
        "x": np.arange(n * 6, dtype=rng.choice([np.uint8, np.float32, np.float16])
                       ).reshape(n, 2, 3),
    }
    if rng.random() < 0.3:
        rows["name"] = np.array([str(i).encode() for i in range(n)], dtype=object)
    ds = hr.Dataset.from_tensor_slices(rows)
    if rng.random() < 0.7:
        ds = ds.shuffle(rng.randint(1, 400), seed=rng.randint(0, 99))
    if rng.random() < 0.3:
        ds = ds.skip(rng.randint(0, 20))
    if rng.random() < 0.3:
        ds = ds.map(_double)  # not random-access any more: NumPy batches are copied in
    if rng.random() < 0.3:
        ds = ds.repeat(2)
    ds = ds.batch(rng.randint(1, 70), drop_remainder=rng.random() < 0.3)
    if rng.random() < 0.2:
        ds = ds.prefetch(2)
    return ds.with_options(hr.Options(memory_budget="64MiB"))


@pytest.mark.parametrize("seed", range(12))
def test_random_pipelines_same_batches_same_order_no_torn_copy(seed: int) -> None:
    rng = random.Random(seed)
    ds = _random_pipeline(rng)
    expected = list(ds)
    backend = SlowBackend(seed, max_delay=rng.choice([0.0, 0.002, 0.01]))
    depth = rng.randint(1, 4)
    with iter(_device(ds, backend, threads=rng.randint(1, 4), depth=depth)) as it:
        got = list(it)
    _assert_same(expected, got)
    assert backend.torn == [], f"copies {backend.torn} read a buffer being rewritten"
    assert backend.max_in_flight <= depth
    assert len(backend.allocated) <= depth  # buffers are reused, not made per batch
    assert not _ring_threads()


def test_fast_route_gathers_indices_into_the_ring() -> None:
    x = np.random.default_rng(0).integers(0, 255, (500, 4, 4, 3), dtype=np.uint8)
    ds = hr.Dataset.from_tensor_slices(x).shuffle(500, seed=1).batch(64)
    it = iter(_device(ds, CpuBackend()))
    tree = it._tree  # the random-access route: only indices leave the pipeline
    assert isinstance(tree.source, _IndexSource)
    first = next(it)
    assert isinstance(first, torch.Tensor) and first.dtype == torch.uint8
    assert np.array_equal(first.numpy(), next(iter(ds)))
    it.close()
    mapped = ds.map(lambda b: b)
    with iter(_device(mapped, CpuBackend())) as it2:
        assert not isinstance(it2._tree.source, _IndexSource)


def test_a_buffer_is_not_reused_before_its_copy_completed() -> None:
    # One slot, slow copies: every fill must wait for the previous copy to finish.
    x = np.arange(40 * 1000, dtype=np.float32).reshape(40, 1000)
    ds = hr.Dataset.from_tensor_slices(x).batch(4)
    backend = SlowBackend(max_delay=0.02)
    with iter(_device(ds, backend, threads=4, depth=1)) as it:
        got = [b.numpy().copy() for b in it]
    _assert_same(list(ds), got)
    assert backend.torn == [] and backend.max_in_flight == 1


def test_a_failed_copy_raises_at_its_batch_and_iteration_goes_on() -> None:
    ds = hr.Dataset.from_tensor_slices(np.arange(100)).batch(10)
    backend = SlowBackend(fail_first={30})
    with iter(_device(ds, backend, threads=2, depth=2)) as it:
        assert [int(next(it)[0]) for _ in range(3)] == [0, 10, 20]
        with pytest.raises(RuntimeError, match="injected copy failure at the batch starting 30"):
            next(it)
        assert [int(b[0]) for b in it] == [40, 50, 60, 70, 80, 90]
    assert not _ring_threads()


def _outcomes(it: Any, limit: int = 1000) -> list[Any]:
    """Every batch (as a list) or error (its message) an iterator gives, in order."""
    out: list[Any] = []
    for _ in range(limit):
        try:
            batch = next(it)
        except StopIteration:
            return out
        except (RuntimeError, ValueError) as error:
            out.append(f"{type(error).__name__}: {error}")
            continue
        out.append(np.asarray(_numpy(batch)).tolist())
    raise AssertionError("the iterator did not end")


class _FailOn:
    def __init__(self, values: set[int]) -> None:
        self.values = values

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if int(x) in self.values:
            raise ValueError(f"bad element {int(x)}")
        return x


@pytest.mark.parametrize("seed", range(10))
def test_random_faults_raise_at_their_batches_and_nothing_else_changes(seed: int) -> None:
    rng = random.Random(seed)
    n, size = rng.randint(20, 200), rng.randint(1, 16)
    ds = hr.Dataset.from_tensor_slices(np.arange(n, dtype=np.int64)).shuffle(n, seed=seed)
    if rng.random() < 0.5:  # faults in the pipeline too, raised on a drawing thread
        ds = ds.map(_FailOn(set(rng.sample(range(n), rng.randint(1, 3)))))
    ds = ds.batch(size)
    plain = _outcomes(iter(ds))
    firsts = [b[0] for b in plain if isinstance(b, list)]
    failing = set(rng.sample(firsts, rng.randint(0, min(4, len(firsts)))))
    backend = SlowBackend(seed, max_delay=rng.choice([0.0, 0.003]), fail_first=failing)
    with iter(_device(ds, backend, threads=rng.randint(1, 4), depth=rng.randint(1, 3))) as it:
        got = _outcomes(it)
    want = [f"RuntimeError: injected copy failure at the batch starting {b[0]}"
            if isinstance(b, list) and b[0] in failing else b for b in plain]
    assert got == want
    assert backend.torn == []
    assert not _ring_threads()


def _fail_on_55(x: np.ndarray) -> np.ndarray:
    if int(x) == 55:
        raise ValueError("bad element 55")
    return x


def test_a_pipeline_error_raises_at_its_batch() -> None:
    ds = hr.Dataset.range(100).map(_fail_on_55).batch(10)
    with iter(_device(ds, SlowBackend(), threads=3, depth=3)) as it:
        assert [int(next(it)[0]) for _ in range(5)] == [0, 10, 20, 30, 40]
        with pytest.raises(ValueError, match="bad element 55"):
            next(it)


@pytest.mark.parametrize("route", ["indices", "elements"])
@pytest.mark.parametrize("stop", [0, 1, 3, 7])
def test_checkpoint_is_the_last_batch_handed_over(route: str, stop: int) -> None:
    ds = hr.Dataset.from_tensor_slices(
        {"id": np.arange(200), "x": np.ones((200, 3), np.float32)}
    ).shuffle(200, seed=4).batch(16)
    if route == "elements":
        ds = ds.map(lambda b: b)
    device = _device(ds, SlowBackend(max_delay=0.003), threads=3, depth=4)
    expected = [b["id"].tolist() for b in ds]
    with iter(device) as it:
        head = [next(it)["id"].tolist() for _ in range(stop)]
        time.sleep(0.05)  # let the workers run ahead: the state must not follow them
        state = it.get_state()
        rest = [b["id"].tolist() for b in it]
    assert head + rest == expected
    with iter(device) as it:
        it.set_state(state)
        assert [b["id"].tolist() for b in it] == rest
    with iter(device) as it:  # restoring mid-run discards what was gathered ahead
        next(it)
        it.set_state(state)
        assert [b["id"].tolist() for b in it] == rest


def test_the_ring_is_booked_and_returned() -> None:
    x = np.zeros((64, 1000), np.float64)  # batches of 8 rows: 64,000 bytes
    ds = hr.Dataset.from_tensor_slices(x).batch(8).with_options(
        hr.Options(memory_budget="16MiB"))
    with iter(_device(ds, SlowBackend(), threads=2, depth=3)) as it:
        next(it)
        slot = 64_000 + (-64_000) % 512
        deadline = time.monotonic() + 10  # the worker threads fill the ring's 3 slots
        while True:
            stage = next(s for s in it.stats().stages if s.name == "to_device")
            if stage.held >= 3 * slot or time.monotonic() > deadline:
                break
            time.sleep(0.005)
        assert stage.held == 3 * slot  # every slot allocated so far is booked...
        list(it)
    assert it.stats().budget_used == 0  # ...and closing gives it all back
    tiny = ds.with_options(hr.Options(memory_budget="32KiB"))
    with (iter(_device(tiny, SlowBackend(), threads=1, depth=1)) as it,
          pytest.raises(hr.MemoryBudgetError, match=r"to_device.*pinned host buffer")):
        next(it)
    assert not _ring_threads()


def test_autotuned_depth_fits_the_share() -> None:
    x = np.zeros((64, 256 * 1024), np.uint8)  # batches of 8 rows: 2 MiB
    ds = hr.Dataset.from_tensor_slices(x).batch(8, drop_remainder=True)
    for budget, most in (("64MiB", 10), ("5MiB", 2)):
        node = DeviceTransferNode(ds.node, "cpu", threads=8, backend=lambda _d: CpuBackend())
        with iter(ds.with_options(hr.Options(memory_budget=budget)).derive(node)) as it:
            assert 2 <= it._tree.depth <= most
            assert len(list(it)) == 8


def test_dropped_iterators_and_breaks_leave_no_threads() -> None:
    ds = hr.Dataset.from_tensor_slices(np.arange(10_000)).batch(10)
    for _ in range(5):
        it = iter(_device(ds, SlowBackend(max_delay=0.001), threads=4, depth=3))
        next(it)
        del it  # no close(): garbage collection stops the threads
        gc.collect()
    for _ in range(3):
        for _batch in _device(ds, CpuBackend(), threads=4, depth=3):
            break
        gc.collect()
    deadline = time.monotonic() + 5
    while _ring_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _ring_threads()


def test_to_torch_device_arguments() -> None:
    ds = hr.Dataset.from_tensor_slices(np.arange(12, dtype=np.float32)).batch(4)
    with pytest.warns(UserWarning, match="pin_memory=True has no effect without an accelerator"):
        cpu = ds.to_torch(device="cpu", pin_memory=True)
    assert next(b.tolist() for b in cpu) == [0.0, 1.0, 2.0, 3.0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain = next(iter(ds.to_torch(device="cpu")))
    assert plain.device.type == "cpu"
    with pytest.raises(hr.InvalidArgumentError, match="num_threads must be a positive int"):
        ds.to_torch(device="cpu", num_threads=0)
    with pytest.raises(hr.InvalidArgumentError, match="for CUDA devices, not 'meta'"):
        ds.to_torch(device="meta", pin_memory=True)
    if torch.cuda.is_available():  # on a GPU machine the real thing runs
        batches = list(ds.to_torch(device="cuda", pin_memory=True, num_threads=2, buffers=2))
        assert [b.device.type for b in batches] == ["cuda"] * 3
        assert torch.cat(batches).cpu().tolist() == list(range(12))
    else:
        with pytest.raises(hr.InvalidArgumentError, match="torch has no CUDA here"):
            ds.to_torch(device="cuda", pin_memory=True)
    meta = next(iter(ds.to_torch(device="meta")))  # no pinning: a plain .to(device)
    assert meta.device.type == "meta" and meta.shape == (4,)


def test_leaves_torch_has_no_dtype_for_pass_through_and_big_endian_lands_native() -> None:
    data = {"be": np.arange(12, dtype=">i4").reshape(6, 2),
            "u": np.array(["a", "bb", "c", "d", "e", "f"]),  # bytes after slicing: NumPy
            "x": np.arange(6, dtype=np.float64)}
    ds = hr.Dataset.from_tensor_slices(data).batch(4)
    with iter(_device(ds, SlowBackend(), threads=2, depth=2)) as it:
        first = next(it)
    assert first["be"].dtype == torch.int32 and first["be"].tolist() == [[0, 1], [2, 3],
                                                                          [4, 5], [6, 7]]
    assert isinstance(first["u"], np.ndarray) and first["u"].tolist() == [b"a", b"bb", b"c",
                                                                          b"d"]
    assert first["x"].dtype == torch.float64


def test_the_gather_refuses_an_index_out_of_range() -> None:
    from headrace.adapters.torch_device import _gather

    leaf = np.arange(10)
    out = np.empty(2, leaf.dtype)
    _gather(leaf, np.array([9, 0]))(out)
    assert out.tolist() == [9, 0]
    with pytest.raises(IndexError, match=r"index out of range 0\.\.9"):
        _gather(leaf, np.array([3, 10]))(out)


def test_a_device_dataset_refuses_to_run_in_a_dataloader_worker(
        monkeypatch: pytest.MonkeyPatch) -> None:
    ds = hr.Dataset.range(8).batch(4).to_torch(device="meta")
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: object())
    with pytest.raises(hr.InvalidArgumentError, match="runs in a DataLoader worker"):
        iter(ds)


def _slow_on_sevens(batch: Any) -> Any:
    time.sleep(0.004 if int(batch["id"][0]) % 7 == 0 else 0.0002)
    return batch


@pytest.mark.parametrize("stop", [0, 2, 5])
def test_a_ring_over_an_out_of_order_map_checkpoints_at_least_once(stop: int) -> None:
    """The ring keeps the state after each batch it drew and restores it as it is: below
    it, a map handing out batches out of order resumes from the earliest it had not
    handed out, so the checkpoint is allowed (the workers have drawn batches since) and
    nothing is lost."""
    ds = hr.Dataset.from_tensor_slices(
        {"id": np.arange(96), "x": np.ones((96, 3), np.float32)}
    ).batch(4).map(_slow_on_sevens, num_parallel_calls=3, deterministic=False)
    device = _device(ds, SlowBackend(max_delay=0.002), threads=2, depth=3)
    with iter(device) as it:
        head = [int(next(it)["id"][0]) for _ in range(stop)]
        time.sleep(0.05)  # the workers run ahead of the state
        state = it.get_state()
    with iter(device) as it:
        it.set_state(state)
        rest = [int(b["id"][0]) for b in it]
    assert len(set(rest)) == len(rest)
    assert set(range(0, 96, 4)) - set(head) <= set(rest)

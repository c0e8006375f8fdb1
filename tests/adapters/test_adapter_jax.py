"""JAX: device prefetch, per-process sharding, exact resume from a checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import headrace as hr

jax = pytest.importorskip("jax")
from headrace.adapters.jax import to_jax  # noqa: E402


def _pipeline() -> hr.Dataset:
    return hr.Dataset.from_tensor_slices(
        {"x": np.arange(300, dtype=np.float32).reshape(100, 3), "id": np.arange(100)}
    ).shuffle(100, seed=5).batch(8)


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_batches_on_device_and_resume_at_every_step(prefetch: int) -> None:
    expected = [b["id"] for b in _pipeline()]
    with to_jax(_pipeline(), prefetch=prefetch) as batches:
        states, got = [batches.get_state()], []
        for batch in batches:
            assert isinstance(batch["x"], jax.Array) and batch["x"].dtype == np.float32
            got.append(np.asarray(batch["id"]))
            states.append(batches.get_state())
    assert [g.tolist() for g in got] == [e.tolist() for e in expected]
    for step, state in enumerate(states):  # checkpointed with the training state, restored
        with to_jax(_pipeline(), prefetch=prefetch) as resumed:
            resumed.set_state(state)
            rest = [np.asarray(b["id"]).tolist() for b in resumed]
        assert rest == [e.tolist() for e in expected[step:]]


def test_each_process_reads_its_own_shard(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("TF_CONFIG", raising=False)
    seen = []
    for process in range(3):
        monkeypatch.setattr(jax, "process_count", lambda: 3)
        monkeypatch.setattr(jax, "process_index", lambda p=process: p)
        ds = hr.Dataset.range(30).batch(2)
        seen.append([int(v) for b in to_jax(ds) for v in np.asarray(b)])
    assert sorted(v for part in seen for v in part) == list(range(30))
    assert all(set(a).isdisjoint(b) for i, a in enumerate(seen) for b in seen[i + 1:])


SHARDED = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import jax, numpy as np, headrace as hr
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from headrace.adapters.jax import to_jax
mesh = Mesh(np.array(jax.devices()), ("batch",))
ds = hr.Dataset.from_tensor_slices(np.arange(40, dtype=np.float32)).batch(10)
batches = list(to_jax(ds, sharding=NamedSharding(mesh, P("batch"))))
assert len(jax.devices()) == 2 and len(batches) == 4
assert all(len(b.addressable_shards) == 2 and b.addressable_shards[0].data.shape == (5,)
           for b in batches)
assert np.concatenate([np.asarray(b) for b in batches]).tolist() == list(range(40))
print("OK")
"""


def test_global_arrays_sharded_over_two_cpu_devices() -> None:
    src = Path(__file__).resolve().parents[2] / "src"
    done = subprocess.run([sys.executable, "-c", SHARDED], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(src)}, timeout=120)
    assert done.stdout.strip().endswith("OK"), done.stderr[-2000:]


def test_bad_arguments() -> None:
    with pytest.raises(hr.InvalidArgumentError, match="prefetch must be >= 0"):
        to_jax(hr.Dataset.range(3), prefetch=-1)
    with pytest.raises(hr.InvalidArgumentError, match="device or a sharding"):
        to_jax(hr.Dataset.range(3), device=jax.devices()[0], sharding=object())


def test_a_checkpoint_refused_below_is_raised_when_asked_for_not_while_iterating() -> None:
    """to_jax takes a state after every batch: a pipeline whose checkpoint is refused
    there (an unbatch half-way through rows a map gave out of order) still trains; asking
    for the state raises."""
    ds = hr.Dataset.range(64).map(lambda x: x * 2, num_parallel_calls=3,
                                  deterministic=False).batch(4).unbatch().batch(2)
    with to_jax(ds, prefetch=2) as batches:
        got = [int(v) for v in np.asarray(next(batches))]
        with pytest.raises(hr.CheckpointError, match="runs out of order"):
            batches.get_state()
        got += [int(v) for batch in batches for v in np.asarray(batch)]
    assert sorted(got) == [x * 2 for x in range(64)]


@pytest.mark.parametrize("seed", range(3))
def test_the_read_ahead_is_bounded_by_the_budget(seed: int) -> None:
    """to_jax(prefetch=n) under a budget: the batches transferred ahead are booked, so
    while the caller holds one batch the pipeline has made at most what the budget
    holds beyond it; every batch still comes, in order, as under a huge budget."""
    import random
    import threading

    rng = random.Random(seed)
    batch_bytes = rng.choice([1, 2, 4]) << 20
    prefetch, budget, count = rng.choice([20, 32]), 16 << 20, 24
    made = [0]
    lock = threading.Lock()

    def make(i: object) -> np.ndarray:
        with lock:
            made[0] += 1
        return np.full(batch_bytes // 4, int(i), np.float32)  # type: ignore[call-overload]

    def run(memory: int) -> tuple[list[int], int]:
        ds = hr.Dataset.range(count).map(make).with_options(hr.Options(memory_budget=memory))
        made[0] = 0
        with to_jax(ds, prefetch=prefetch, shard_policy=None) as batches:
            got = [int(next(batches)[0])]
            ahead = made[0] - 1  # made while the caller holds the first batch
            got += [int(batch[0]) for batch in batches]
        return got, ahead

    expected, _ = run(1 << 30)
    got, ahead = run(budget)
    assert got == expected == list(range(count))
    assert ahead * batch_bytes <= budget + batch_bytes, (ahead, batch_bytes)

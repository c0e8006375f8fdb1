"""Orbax: HeadraceCheckpointHandler saves each process's iterator state in a file of
its own and restores it, through Orbax's own CheckpointManager; the rest of the epoch
after a restore is the uninterrupted run's (the oracle), for drawn pipelines."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import headrace as hr
from headrace._errors import CheckpointError

ocp = pytest.importorskip("orbax.checkpoint")
import shard_cases as sc  # noqa: E402

from headrace.adapters.orbax import (  # noqa: E402
    HeadraceCheckpointHandler,
    HeadraceCheckpointRestore,
    HeadraceCheckpointSave,
)


def _manager(path: Path, handler: Any = None) -> Any:
    handlers = None if handler is None else {"data": handler}
    return ocp.CheckpointManager(str(path), item_handlers=handlers)


@pytest.mark.parametrize("seed", range(3))
def test_manager_round_trip_resumes_exactly(tmp_path: Path, seed: int) -> None:
    (tmp_path / "data").mkdir()
    env = sc.make_env(str(tmp_path / "data"), seed)
    rng = random.Random(seed)
    for number in range(3):
        case = sc.random_case(rng, env)
        expected = sc.rows(case.dataset, case.batched)
        count = len(list(case.dataset))
        cut = rng.randint(0, count)
        first = iter(case.dataset)
        head = [next(first) for _ in range(cut)]
        manager = _manager(tmp_path / f"ckpt-{number}")
        manager.save(cut, args=ocp.args.Composite(
            data=HeadraceCheckpointSave(first),
            params=ocp.args.StandardSave({"w": np.arange(4.0)})))
        manager.wait_until_finished()
        first.close()
        saved = tmp_path / f"ckpt-{number}" / str(cut) / "data" / "process_0-of-1.json"
        assert json.loads(saved.read_text())["format"] == "headrace.iterator"
        resumed = iter(case.dataset)
        restorer = _manager(tmp_path / f"ckpt-{number}")
        restorer.restore(restorer.latest_step(),
                         args=ocp.args.Composite(data=HeadraceCheckpointRestore(resumed)))
        got = sc.rows(head, case.batched) + sc.rows(resumed, case.batched)
        assert got == expected, f"{sc.describe(case.dataset.node)} cut at {cut}"


def test_each_host_saves_and_restores_its_own_state(tmp_path: Path) -> None:
    """Two hosts (numbered by hand here) reading their own shards save into one step;
    each restores its own position, not the primary's."""
    ds = hr.Dataset.from_tensor_slices(np.arange(200)).shuffle(64, seed=2).batch(5)
    parts = [ds.shard(2, host) for host in range(2)]
    iterators = [iter(part) for part in parts]
    for host, it in enumerate(iterators):
        for _ in range(3 + 4 * host):  # the hosts stand at different places
            next(it)
    manager = _manager(tmp_path / "ckpt", HeadraceCheckpointHandler(0, 2))
    manager.save(7, args=ocp.args.Composite(data=HeadraceCheckpointSave(iterators[0])))
    manager.wait_until_finished()
    # host 1's part of the same collective save: its handler writes into the step's item
    HeadraceCheckpointHandler(1, 2).save(
        tmp_path / "ckpt" / "7" / "data", args=HeadraceCheckpointSave(iterators[1])
    )
    names = sorted(p.name for p in (tmp_path / "ckpt" / "7" / "data").glob("*.json"))
    assert names == ["process_0-of-2.json", "process_1-of-2.json"]
    for host, it in enumerate(iterators):
        expected = [batch.tolist() for batch in it]
        resumed = iter(parts[host])
        manager = _manager(tmp_path / "ckpt", HeadraceCheckpointHandler(host, 2))
        manager.restore(7, args=ocp.args.Composite(data=HeadraceCheckpointRestore(resumed)))
        assert [batch.tolist() for batch in resumed] == expected
    # a different number of processes finds no state of its own, and says what is there
    manager = _manager(tmp_path / "ckpt", HeadraceCheckpointHandler(0, 3))
    with pytest.raises(CheckpointError, match=r"process_0-of-3\.json.*process_0-of-2\.json"):
        manager.restore(7, args=ocp.args.Composite(data=HeadraceCheckpointRestore(iter(ds))))


def test_to_jax_state_counts_only_batches_handed_out(tmp_path: Path) -> None:
    from headrace.adapters.jax import to_jax

    ds = hr.Dataset.from_tensor_slices(np.arange(64, dtype=np.float32)).batch(8)
    with to_jax(ds, prefetch=2) as batches:
        next(batches)
        manager = _manager(tmp_path / "ckpt")
        manager.save(1, args=ocp.args.Composite(data=HeadraceCheckpointSave(batches)))
        manager.wait_until_finished()
    with to_jax(ds) as resumed:
        manager.restore(1, args=ocp.args.Composite(data=HeadraceCheckpointRestore(resumed)))
        assert float(next(resumed)[0]) == 8.0

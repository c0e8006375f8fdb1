"""PyTorch's checkpoint tools: ``torch.distributed.checkpoint`` and torchdata's
``StatefulDataLoader`` save and restore headrace iterators through
``state_dict()``/``load_state_dict()``, and the rest of the epoch after a restore
is the uninterrupted run's, element for element (the oracle), for drawn pipelines.
"""

from __future__ import annotations

import json
import pickle
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import headrace as hr
from headrace._errors import CheckpointError

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")
import shard_cases as sc  # noqa: E402
from torch.distributed.checkpoint.stateful import Stateful  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

#: torchdata 0.11 calls a torch function that torch 2.13 deprecated.
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")

def _context() -> str:
    """How DataLoader workers start: ``fork`` (a fraction of a second) unless this
    process loaded TensorFlow or JAX, whose threads do not survive a fork; then a
    clean server process (seconds per worker: it imports torch)."""
    return "forkserver" if {"tensorflow", "jax"} & set(sys.modules) else "fork"


def _rows(elements: Any, batched: bool) -> list[tuple[int, ...]]:
    return sc.rows((tuple(np.asarray(leaf) for leaf in _leaves(e)) for e in elements), batched)


def _leaves(element: Any) -> list[Any]:
    """Leaves in order (a DataLoader's default_convert turns tuples into lists)."""
    if isinstance(element, (tuple, list)):
        return [leaf for part in element for leaf in _leaves(part)]
    if isinstance(element, dict):
        return [leaf for key in sorted(element) for leaf in _leaves(element[key])]
    return [element.numpy() if isinstance(element, torch.Tensor) else element]


def test_iterators_are_stateful_for_dcp() -> None:
    ds = hr.Dataset.range(10).batch(3)
    with iter(ds) as plain, iter(ds.to_torch()) as converted:
        assert isinstance(plain, Stateful) and isinstance(converted, Stateful)
        state = plain.state_dict()
        assert list(state) == ["headrace_state"]
        assert json.loads(state["headrace_state"]) == plain.get_state()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("seed", range(4))
def test_dcp_round_trip_resumes_exactly(tmp_path: Path, seed: int) -> None:
    """dcp.save of an iterator mid-epoch, dcp.load into a fresh one (one process, no
    process group): what follows is what the uninterrupted run gave after that point."""
    (tmp_path / "data").mkdir()
    env = sc.make_env(str(tmp_path / "data"), seed)
    rng = random.Random(seed)
    for case_number in range(3):
        case = sc.random_case(rng, env)
        wrap = (lambda ds: iter(ds.to_torch())) if case_number % 2 else iter
        expected = _rows(wrap(case.dataset), case.batched)
        count = len(list(wrap(case.dataset)))
        cut = rng.randint(0, count)
        where = tmp_path / f"ckpt-{case_number}"
        first = wrap(case.dataset)
        head = [next(first) for _ in range(cut)]
        dcp.save({"data": first, "step": cut}, checkpoint_id=str(where), no_dist=True)
        first.close()
        assert (where / ".metadata").is_file()
        resumed = wrap(case.dataset)
        holder: dict[str, Any] = {"data": resumed, "step": 0}
        dcp.load(holder, checkpoint_id=str(where), no_dist=True)
        got = _rows(head, case.batched) + _rows(resumed, case.batched)
        assert holder["step"] == cut
        assert got == expected, f"{sc.describe(case.dataset.node)} cut at {cut}"


def test_load_state_dict_refuses_what_state_dict_did_not_make() -> None:
    with iter(hr.Dataset.range(5)) as it:
        with pytest.raises(CheckpointError, match="expected a dict with the key 'headrace_state'"):
            it.load_state_dict({"position": 3})
        with pytest.raises(CheckpointError, match="'headrace_state' is not JSON"):
            it.load_state_dict({"headrace_state": "{broken"})
        other = iter(hr.Dataset.range(6)).state_dict()
        with pytest.raises(CheckpointError, match="different pipeline"):
            it.load_state_dict(other)


def _loader(ds: hr.Dataset, workers: int, policy: str = "auto") -> Any:
    return StatefulDataLoader(
        ds.to_torch(worker_sharding=policy),  # type: ignore[arg-type]
        batch_size=None, num_workers=workers,
        multiprocessing_context=_context() if workers else None,
    )


def _check_loader_resume(
    case: sc.Case, workers: int, cut: int, policy: str = "auto"
) -> dict[str, Any]:
    """Cut the loader's epoch after ``cut`` elements, restore a new loader from its
    state_dict: head + rest is the uninterrupted epoch. Returns the state."""
    expected = _rows(_loader(case.dataset, workers, policy), case.batched)
    loader = _loader(case.dataset, workers, policy)
    elements = iter(loader)
    head = [next(elements) for _ in range(cut)]
    state: dict[str, Any] = loader.state_dict()
    del elements, loader
    # what a checkpoint file holds: the state survives pickling (torch.save)
    state = pickle.loads(pickle.dumps(state))
    resumed = _loader(case.dataset, workers, policy)
    resumed.load_state_dict(state)
    got = _rows(head, case.batched) + _rows(resumed, case.batched)
    assert got == expected, f"{sc.describe(case.dataset.node)}, {workers} workers, cut {cut}"
    return state


@pytest.mark.parametrize("seed", range(4))
def test_stateful_dataloader_in_process_resumes_exactly(tmp_path: Path, seed: int) -> None:
    env = sc.make_env(str(tmp_path), seed)
    rng = random.Random(seed)
    for _ in range(3):
        case = sc.random_case(rng, env)
        count = len(list(case.dataset))
        _check_loader_resume(case, 0, rng.randint(0, count))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("policy", ["source", "output"])
def test_stateful_dataloader_workers_keep_each_workers_state(tmp_path: Path, policy: str) -> None:
    """Two DataLoader workers, each with its own part of the pipeline: the loader's
    state_dict holds each worker's iterator state, and a new loader (new workers)
    restored from it gives the rest of the uninterrupted run, batch for batch."""
    data = np.arange(0, 300, dtype=np.int64)
    ds = (hr.Dataset.from_tensor_slices({"x": data, "y": data * 10})
          .shuffle(40, seed=3, reshuffle_each_iteration=False)
          .map(sc.plus_one).batch(7).prefetch(2))
    state = _check_loader_resume(sc.Case(ds, True), 2, 9, policy)
    workers = state["_snapshot"]["_worker_snapshots"]
    states = [json.loads(snapshot["fetcher_state"]["dataset_iter_state"]["headrace_state"])
              for snapshot in workers.values()]
    assert len(states) == 2 and all(s["format"] == "headrace.iterator" for s in states)
    assert states[0]["fingerprint"] != states[1]["fingerprint"]  # each worker's own part

"""Scale-out preprocessing on a real local Ray cluster (2 CPUs): atomic shards, a report
of failed shards that re-run alone, and resume that skips complete shards."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import headrace as hr
from headrace.io.example import FixedLenFeature

ray = pytest.importorskip("ray")
from headrace.adapters.ray import preprocess_on_ray, shard_path  # noqa: E402

pytestmark = pytest.mark.slow
ROWS = 1000


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             object_store_memory=80 * 2**20, configure_logging=False)
    yield
    ray.shutdown()


class MakeShard:
    """Shard i of a 'raw' dataset, preprocessed; fails on shards listed in a marker file."""

    def __init__(self, fail_marker: str) -> None:
        self.fail_marker = fail_marker

    def __call__(self, index: int, num_shards: int) -> hr.Dataset:
        if os.path.exists(self.fail_marker):
            failing = {int(v) for v in Path(self.fail_marker).read_text().split()}
            if index in failing:
                raise RuntimeError(f"bad input in shard {index}")
        raw = hr.Dataset.from_tensor_slices({"id": np.arange(ROWS)}).shard(num_shards, index)
        return raw.map(lambda e: {"id": e["id"], "square": e["id"] ** 2}).batch(64)


def _read(paths: list[str]) -> list[tuple[int, int]]:
    features = {"id": FixedLenFeature((), np.int64), "square": FixedLenFeature((), np.int64)}
    rows = []
    for batch in hr.TFRecordDataset(paths).batch(100).parse_examples(features):
        rows.extend(zip(batch["id"].tolist(), batch["square"].tolist(), strict=True))
    return rows


def test_failed_shards_rerun_alone_and_resume_skips_complete(cluster: None, tmp_path: Path) -> None:
    out, marker = tmp_path / "out", tmp_path / "fail"
    marker.write_text("2 4")
    make = MakeShard(str(marker))
    report = preprocess_on_ray(make, out, 6, memory_budget="32MiB", batched=True, progress=False)
    assert report.failed_shards == [2, 4] and not report.ok
    assert "bad input in shard 2" in report.failed[2]
    assert sorted(report.written) == [0, 1, 3, 5]
    assert not os.path.exists(shard_path(out, 2, 6))  # no partial shard under a final name
    assert all(os.path.exists(p + ".hrx") for p in report.written.values())
    assert {r for r in report.records.values()} <= {166, 167}

    marker.write_text("")  # the input is fixed: re-run only what failed
    again = preprocess_on_ray(make, out, 6, shards=report.failed_shards, batched=True,
                              progress=False)
    assert again.ok and sorted(again.written) == [2, 4] and again.skipped == {}

    resumed = preprocess_on_ray(make, out, 6, batched=True, progress=False)
    assert resumed.ok and resumed.written == {} and sorted(resumed.skipped) == list(range(6))
    rows = _read(resumed.paths)
    assert sorted(rows) == [(i, i * i) for i in range(ROWS)]  # every row once, none lost
    leftovers = [name for name in os.listdir(out) if ".tmp-" in name]
    assert leftovers == []


def test_shards_are_tensorflow_readable(cluster: None, tmp_path: Path) -> None:
    tf = pytest.importorskip("tensorflow")
    report = preprocess_on_ray(MakeShard(str(tmp_path / "none")), tmp_path, 2, batched=True,
                               progress=False)
    spec = {"id": tf.io.FixedLenFeature((), tf.int64)}
    ids = [int(tf.io.parse_single_example(r, spec)["id"])
           for r in tf.data.TFRecordDataset(report.paths)]
    assert sorted(ids) == list(range(ROWS))


def test_arguments_are_checked() -> None:
    with pytest.raises(hr.InvalidArgumentError, match="num_shards must be an int >= 1"):
        preprocess_on_ray(MakeShard("x"), "/tmp", 0)
    with pytest.raises(hr.InvalidArgumentError, match=r"shard 7 is not in 0\.\.3"):
        preprocess_on_ray(MakeShard("x"), "/tmp", 4, shards=[7])


class DieOnce:
    """A map function that kills its worker (no ``finally`` runs) at element 300 of the
    first attempt; the marker file says an attempt has died."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __call__(self, element: dict) -> dict:
        if int(element["id"]) == 300 and not os.path.exists(self.marker):
            Path(self.marker).write_text("died")
            os._exit(1)
        return element


class MakeDying:
    def __init__(self, marker: str, record: str) -> None:
        self.marker, self.record = marker, record

    def __call__(self, index: int, num_shards: int) -> hr.Dataset:
        Path(self.record).write_text(
            str(ray.get_runtime_context().get_assigned_resources().get("memory", 0)))
        raw = hr.Dataset.from_tensor_slices({"id": np.arange(ROWS)}).shard(num_shards, index)
        return raw.map(DieOnce(self.marker)).batch(64)


def test_killed_attempt_leaves_no_staging_and_memory_request_counts_the_worker(
        cluster: None, tmp_path: Path) -> None:
    from headrace.adapters.ray import WORKER_BASELINE, task_memory

    out, marker, record = tmp_path / "out", tmp_path / "died", tmp_path / "memory"
    report = preprocess_on_ray(MakeDying(str(marker), str(record)), out, 1,
                               memory_budget="16MiB", batched=True, max_retries=1,
                               progress=False)
    assert marker.exists() and report.ok and report.records == {0: ROWS}
    assert sorted(os.listdir(out)) == ["part-00000-of-00001.tfrecord",
                                       "part-00000-of-00001.tfrecord.hrx"]
    ids = [int(i) for batch in hr.TFRecordDataset(report.paths).batch(100).parse_examples(
        {"id": FixedLenFeature((), np.int64)}) for i in batch["id"]]
    assert sorted(ids) == list(range(ROWS))
    # Ray's scheduler is asked for the budget and the worker's interpreter, not 16 MiB
    assert task_memory("16MiB") == (16 << 20) + WORKER_BASELINE
    assert float(record.read_text()) == (16 << 20) + WORKER_BASELINE


_DRIVER = '''
import sys
import numpy as np
import ray
import headrace as hr
from headrace.adapters.ray import preprocess_on_ray

def square(element):  # defined in the driver script: __main__ in the driver only
    return {"id": element["id"], "square": element["id"] ** 2}

def make_shard(index, num_shards):
    raw = hr.Dataset.from_tensor_slices({"id": np.arange(100)}).shard(num_shards, index)
    return raw.map(square, num_parallel_calls=2, workers="processes").batch(10)

ray.init(address=sys.argv[2], log_to_driver=False, configure_logging=False)
report = preprocess_on_ray(make_shard, sys.argv[1], 2, batched=True, progress=False)
print(report.failed or sum(report.records.values()))
'''


def test_process_workers_in_a_task_run_functions_of_the_driver_script(
        cluster: None, tmp_path: Path) -> None:
    import subprocess
    import sys

    script = tmp_path / "driver.py"
    script.write_text(_DRIVER)
    address = ray.get_runtime_context().gcs_address
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "out"), address],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "100"
    rows = _read(sorted(str(p) for p in (tmp_path / "out").glob("*.tfrecord")))
    assert sorted(rows) == [(i, i * i) for i in range(100)]

"""Preprocessing too big for one machine: one Ray task per output shard.

:func:`preprocess_on_ray` runs ``make_shard(index, num_shards)`` — a function
that builds the headrace pipeline for one part of the input (its files, its
rows) — as a Ray task per shard. Each task runs under its own memory budget
(and asks Ray's scheduler for that much memory, so a node is not
over-committed) and writes its part as one TFRecord shard of
``tf.train.Example`` records, atomically: the shard is written and indexed
under a temporary name and renamed when complete, so a shard that exists is
whole. A re-run skips the shards that exist (resume after a crash or a
preemption); failures are collected, not raised, in the returned
:class:`PreprocessReport`, whose ``failed_shards`` can be re-run alone
(``shards=report.failed_shards``).

Locally ``ray.init(num_cpus=2)`` (or nothing: the first call starts a local
Ray); on a cluster ``ray.init(address="auto")`` on the head node with
``output_dir`` on storage every node mounts — the call is the same.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray

from headrace._errors import InvalidArgumentError
from headrace._memory.units import parse_bytes
from headrace._options import Options
from headrace.io.tfrecord_index import index_path_for

if TYPE_CHECKING:
    from headrace._dataset import Dataset

__all__ = ["WORKER_BASELINE", "PreprocessReport", "preprocess_on_ray", "shard_path", "task_memory"]

#: What a Ray worker process holds before a pipeline books anything: the interpreter,
#: Ray's core worker, NumPy and headrace (~100 MiB RSS measured in a Ray 2.60 task), with
#: room for the pipeline's code and Python objects. Added to every memory request so
#: that Ray's scheduler sees a worker's real footprint, not only its buffers.
WORKER_BASELINE = 128 << 20


def task_memory(budget: int | str, worker_baseline: int | str = WORKER_BASELINE) -> int:
    """The bytes a task or actor running a pipeline under ``budget`` asks Ray for: the
    budget plus the worker's baseline (see :data:`WORKER_BASELINE`). Process workers
    that the pipeline starts are inside its budget only for what they hold for it; give
    a larger ``worker_baseline`` for pipelines with many of them."""
    return parse_bytes(budget) + parse_bytes(worker_baseline)


def _remove_staging(final: str) -> None:
    """Remove every staging directory of shard ``final``: only a task writing that shard
    makes one, and Ray starts a shard's next attempt only once the previous one's worker
    is gone, so any that exists belongs to a dead attempt (a killed worker never ran its
    ``finally``)."""
    for staging in glob.glob(glob.escape(final) + ".tmp-*"):
        shutil.rmtree(staging, ignore_errors=True)


def shard_path(output_dir: str | os.PathLike[str], index: int, num_shards: int) -> str:
    """The final name of shard ``index``: ``part-00003-of-00016.tfrecord``."""
    return os.path.join(os.fspath(output_dir), f"part-{index:05d}-of-{num_shards:05d}.tfrecord")


@dataclass
class PreprocessReport:
    """What one :func:`preprocess_on_ray` call did, shard by shard."""

    written: dict[int, str] = field(default_factory=dict)
    skipped: dict[int, str] = field(default_factory=dict)  # complete from an earlier run
    failed: dict[int, str] = field(default_factory=dict)  # shard -> the task's traceback
    records: dict[int, int] = field(default_factory=dict)  # records written per shard
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failed

    @property
    def failed_shards(self) -> list[int]:
        """Pass as ``shards=`` to re-run only these."""
        return sorted(self.failed)

    @property
    def paths(self) -> list[str]:
        """Every complete shard, in shard order."""
        done = {**self.skipped, **self.written}
        return [done[index] for index in sorted(done)]


def _write_shard(
    make_shard: Callable[[int, int], Dataset],
    index: int,
    num_shards: int,
    final: str,
    budget: int,
    batched: bool,
) -> int:
    """One task: build the shard's pipeline under ``budget``, write it, publish it whole."""
    from headrace._persist.writers import save_tfrecords

    _remove_staging(final)  # an earlier attempt's, killed mid-shard
    dataset = make_shard(index, num_shards).with_options(Options(memory_budget=budget))
    staging = f"{final}.tmp-{socket.gethostname()}-{os.getpid()}-{time.monotonic_ns()}"
    try:
        (written,) = save_tfrecords(dataset, staging, num_shards=1, batched=batched, progress=False)
        records = 0
        if os.path.exists(index_path_for(written)):
            from headrace.io.tfrecord_index import load_index

            records = len(load_index(written))
            os.replace(index_path_for(written), index_path_for(final))  # the index first:
        os.replace(written, final)  # a shard under its final name always has its index
        return records
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _wanted_shards(num_shards: int, shards: Sequence[int] | None) -> list[int]:
    """The shard indices to write, sorted; refused unless ``num_shards`` is an int >= 1
    and each index is in ``0..num_shards - 1``."""
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise InvalidArgumentError(f"num_shards must be an int >= 1, got {num_shards!r}")
    wanted = list(range(num_shards)) if shards is None else sorted(set(shards))
    for index in wanted:
        if not 0 <= index < num_shards:
            raise InvalidArgumentError(f"shard {index} is not in 0..{num_shards - 1}")
    return wanted


def preprocess_on_ray(
    make_shard: Callable[[int, int], Dataset],
    output_dir: str | os.PathLike[str],
    num_shards: int,
    *,
    memory_budget: int | str = "256MiB",
    batched: bool = False,
    shards: Sequence[int] | None = None,
    num_cpus: float = 1,
    max_retries: int = 0,
    progress: bool = True,
    worker_baseline: int | str = WORKER_BASELINE,
) -> PreprocessReport:
    """Write ``num_shards`` TFRecord shards, shard ``i`` from ``make_shard(i, num_shards)``.

    ``make_shard`` must be picklable (a module-level function, or a closure
    over picklable values: Ray sends it to the workers). ``shards`` limits
    the run to some shards (e.g. ``report.failed_shards``). ``batched``: the
    datasets yield batches whose rows are the Examples (the fast path).
    ``progress`` prints a line per finished shard to stderr. Each task asks Ray for
    ``memory_budget`` plus ``worker_baseline`` bytes of memory (:func:`task_memory`).
    A shard's staging directory left by a killed attempt is removed by its next attempt,
    and by this call once every task has ended.
    """
    wanted = _wanted_shards(num_shards, shards)
    budget = parse_bytes(memory_budget)
    os.makedirs(output_dir, exist_ok=True)
    report = PreprocessReport()
    started = time.perf_counter()
    if not ray.is_initialized():
        ray.init()
    task = ray.remote(_write_shard).options(
        num_cpus=num_cpus, memory=task_memory(budget, worker_baseline), max_retries=max_retries
    )
    pending: dict[Any, int] = {}
    for index in wanted:
        final = shard_path(output_dir, index, num_shards)
        if os.path.exists(final):
            report.skipped[index] = final
            continue
        pending[task.remote(make_shard, index, num_shards, final, budget, batched)] = index
    total = len(pending)
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1)
        index = pending.pop(ready[0])
        try:
            report.records[index] = ray.get(ready[0])
            report.written[index] = shard_path(output_dir, index, num_shards)
            outcome = "done"
        except Exception as error:  # a task's error is reported, the others go on
            report.failed[index] = "".join(traceback.format_exception(error))
            outcome = f"FAILED ({type(error).__name__})"
        if progress:
            finished = total - len(pending)
            print(
                f"headrace: shard {index} {outcome} [{finished}/{total}, "
                f"{len(report.skipped)} already complete]",
                file=sys.stderr,
            )
    for index in wanted:  # every task has ended: what any attempt left is dead
        _remove_staging(shard_path(output_dir, index, num_shards))
    report.seconds = time.perf_counter() - started
    return report

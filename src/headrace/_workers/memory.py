"""Memory of worker processes: unique (USS) and proportional (PSS) sizes, from /proc.

RSS double-counts pages that processes share (copy-on-write pages of a forked
parent, a shared-memory segment mapped by a worker and by the consumer); PSS
divides each shared page among the processes mapping it, so the PSS of a
process tree sums to the memory it really occupies, and USS is what each
process alone holds (what a copy-on-read leak grows).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["WorkerMemory", "WorkerStats", "tree_charged", "worker_memory"]


@dataclass(frozen=True)
class WorkerMemory:
    """One process's memory (bytes): unique, and proportional anonymous + shared."""

    pid: int
    uss: int
    pss_anon: int
    pss_shmem: int
    #: Resident set, pages shared with this process and other workers counted whole.
    rss: int = 0

    @property
    def charged(self) -> int:
        """What the measured bound (G1) counts for a worker: Pss_Anon + Pss_Shmem."""
        return self.pss_anon + self.pss_shmem


@dataclass(frozen=True)
class WorkerStats:
    """What a parallel stage chose to run on, why, and what its workers hold now."""

    stage: str
    kind: str  # "threads" or "processes"
    count: int
    reason: str
    processes: tuple[WorkerMemory, ...] = ()
    #: Chunks of elements sent to the workers, and the elements in them.
    chunks: int = 0
    elements: int = 0
    #: Seconds the function ran in the workers, against seconds spent moving elements
    #: (pickling, shared-memory copies; in the workers and in this process). A worker's
    #: pickling of each output as it is made counts as the function's time.
    compute_seconds: float = 0.0
    transfer_seconds: float = 0.0
    #: Bytes sent to the workers and received back (shared memory and pickles), and the
    #: shared-memory segments made for inputs.
    sent_bytes: int = 0
    received_bytes: int = 0
    segments: int = 0

    @property
    def uss(self) -> int:
        return sum(process.uss for process in self.processes)

    @property
    def charged(self) -> int:
        return sum(process.charged for process in self.processes)


def worker_memory(pid: int) -> WorkerMemory | None:
    """``pid``'s USS and PSS parts from ``/proc/<pid>/smaps_rollup``; None if it is gone."""
    fields = {"Private_Clean:": 0, "Private_Dirty:": 0, "Pss_Anon:": 0, "Pss_Shmem:": 0,
              "Rss:": 0}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            for line in rollup:
                parts = line.split()
                if parts and parts[0] in fields:
                    fields[parts[0]] = int(parts[1]) * 1024
    except OSError:
        return None
    return WorkerMemory(
        pid,
        fields["Private_Clean:"] + fields["Private_Dirty:"],
        fields["Pss_Anon:"],
        fields["Pss_Shmem:"],
        fields["Rss:"],
    )


def tree_charged(pid: int) -> int:
    """Pss_Anon + Pss_Shmem of ``pid`` and all its descendants (the measured bound's
    figure with worker processes: pages shared among them are counted once)."""
    total = 0
    for child in [*_descendants(pid), pid]:
        memory = worker_memory(child)
        if memory is not None:
            total += memory.charged
    return total


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid``. A child is listed under the *thread* that started
    it, so every thread's list is read: a pool started on a pipeline's thread (under a
    prefetch) has its forkserver, and so its workers, under that thread, not under the
    main one (read from the main thread alone, the bound missed them all)."""
    found: list[int] = []
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as handle:
                    children = [int(text) for text in handle.read().split()]
            except OSError:
                continue
            found.extend(children)
            frontier.extend(children)
    return found

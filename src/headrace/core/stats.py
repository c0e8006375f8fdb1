"""Frozen snapshots of a run: process memory, per-stage bookings, open files.

In ``core`` because ``DatasetIterator.stats()`` returns one: core imports nothing
above it (:mod:`headrace.profiling.stats` re-exports it).

Numbers a user can act on: which stage holds how much of the budget now and
at its peak, what share it was given, how big its largest element was; and
the process's anonymous, shared and file-backed memory separately (memmap
pages are file-backed: the kernel can drop them, so they are not charged).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from headrace._memory.budget import AccountStats, KeptStats, MemoryBudget
from headrace._memory.system import ProcessMemory, live_runs, open_file_count, process_memory
from headrace._memory.units import format_bytes

if TYPE_CHECKING:  # (workers are above core: a stage hands its WorkerStats in)
    from headrace._workers.memory import WorkerStats

__all__ = ["RunStats"]


@dataclass(frozen=True)
class RunStats:
    """A snapshot of one iterator: its budget, its stages, the process around it."""

    budget_total: int
    budget_used: int
    budget_peak: int
    stages: tuple[AccountStats, ...]
    elements: int
    seconds: float
    wait_seconds: float
    memory: ProcessMemory
    open_files: int
    skipped_records: int = 0
    skipped_bytes: int = 0
    #: Growth of the process's anonymous + shared memory since the first live iterator
    #: started, less the bookings of every live iterator: an upper bound on memory the
    #: budget does not see (the training loop's own included). Watch its trend.
    unaccounted: int = 0
    #: Per parallel stage with process workers (or ``workers="auto"``): what it runs on,
    #: why, and each worker process's unique and proportional memory now.
    workers: tuple[WorkerStats, ...] = ()
    #: What stages keep beyond this run (a complete in-memory cache belongs to its
    #: dataset): bytes booked for as long as the dataset lives, and on which budget.
    kept: tuple[KeptStats, ...] = ()

    @classmethod
    def capture(
        cls,
        budget: MemoryBudget,
        elements: int,
        seconds: float,
        wait_seconds: float,
        skipped: tuple[int, int] = (0, 0),
        *,
        workers: tuple[WorkerStats, ...] = (),
    ) -> RunStats:
        memory = process_memory()
        booked = budget.stats()
        return cls(
            budget_total=booked.total,
            budget_used=booked.used,
            budget_peak=booked.peak,
            stages=booked.stages,
            elements=elements,
            seconds=seconds,
            wait_seconds=wait_seconds,
            memory=memory,
            open_files=open_file_count(),
            skipped_records=skipped[0],
            skipped_bytes=skipped[1],
            unaccounted=live_runs.unaccounted(memory),
            workers=workers,
            kept=budget.kept_stats(),
        )

    def format(self) -> str:
        """A plain-text table for terminals and logs."""
        rate = self.elements / self.seconds if self.seconds > 0 else 0.0
        lines = [
            f"budget {format_bytes(self.budget_total)}: holding {format_bytes(self.budget_used)},"
            f" peak {format_bytes(self.budget_peak)}",
            f"elements {self.elements} in {self.seconds:.2f} s ({rate:,.0f}/s); consumer waited"
            f" {self.wait_seconds:.2f} s",
            f"process: anonymous {format_bytes(self.memory.anonymous)}, shared "
            f"{format_bytes(self.memory.shared)}, file-backed {format_bytes(self.memory.file_backed)}"
            f"; open files {self.open_files}; not booked by any live pipeline (upper bound) "
            f"{format_bytes(self.unaccounted)}",
            f"corrupt records skipped: {self.skipped_records} ({format_bytes(self.skipped_bytes)})",
            f"{'stage':<28}{'share':>12}{'held':>12}{'peak':>12}{'elements':>10}{'largest':>12}",
        ]
        for stage in self.stages:
            lines.append(
                f"{stage.name:<28}{format_bytes(stage.limit):>12}{format_bytes(stage.held):>12}"
                f"{format_bytes(stage.peak):>12}{stage.elements:>10}"
                f"{format_bytes(stage.max_element):>12}"
            )
        lines.extend(kept.format() for kept in self.kept)
        for workers in self.workers:
            lines.append(
                f"{workers.stage}: {workers.count} {workers.kind} ({workers.reason}); worker "
                f"processes {len(workers.processes)}, unique {format_bytes(workers.uss)}, "
                f"proportional anonymous + shared {format_bytes(workers.charged)}"
                + (f"; {workers.chunks} chunks, compute {workers.compute_seconds:.2f} s, "
                   f"transfer {workers.transfer_seconds:.2f} s, sent "
                   f"{format_bytes(workers.sent_bytes)}, received "
                   f"{format_bytes(workers.received_bytes)}" if workers.chunks else "")
            )
        return "\n".join(lines)

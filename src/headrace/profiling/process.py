"""The process around a pipeline: memory by kind, USS, descriptors, shared memory, workers.

Everything here reads ``/proc`` (Linux) and degrades to zeros elsewhere. The
cheap reads (``/proc/self/status``: a few µs) run at every sample of a
timeline; the dearer ones (``smaps_rollup`` of this process and its children,
one ``readlink`` per descriptor) run every few samples.

Why these figures: the budget's measured guarantee (G1) is about anonymous +
shared memory (``RssAnon + RssShmem``); file-backed pages (memmaps, page
cache) are reported but not charged. USS (memory only this process holds)
and PSS (its proportional share of pages shared with workers) tell a user
what killing the process would return, which RSS overstates with workers.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass

from headrace._memory.system import process_memory
from headrace._workers.memory import WorkerMemory, worker_memory
from headrace.io.filepool import get_default_pool, read_small_file

__all__ = [
    "Descriptors",
    "ProcessSnapshot",
    "descriptors",
    "headrace_threads",
    "shared_memory_segments",
    "snapshot",
]


@dataclass(frozen=True)
class Descriptors:
    """Open descriptors of this process by kind (-1 in ``total`` where unknown)."""

    total: int
    files: int = 0
    sockets: int = 0
    pipes: int = 0
    #: memfd segments and files under /dev/shm: shared memory a descriptor keeps alive.
    shared_memory: int = 0
    shared_memory_bytes: int = 0
    other: int = 0


def descriptors() -> Descriptors:
    """Classify ``/proc/self/fd`` (one ``readlink`` per descriptor)."""
    try:
        with get_default_pool().transient():  # the listing's descriptor counts (G2)
            names = os.listdir("/proc/self/fd")
    except OSError:
        return Descriptors(-1)
    files = sockets = pipes = shm = other = 0
    shm_bytes = 0
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile (the listing's own descriptor, say)
            continue
        if target.startswith("/memfd:") or target.startswith("/dev/shm/"):
            shm += 1
            with contextlib.suppress(OSError):
                shm_bytes += os.fstat(int(name)).st_size
        elif target.startswith("socket:"):
            sockets += 1
        elif target.startswith("pipe:"):
            pipes += 1
        elif target.startswith("/"):
            files += 1
        else:
            other += 1
    return Descriptors(files + sockets + pipes + shm + other, files, sockets, pipes, shm,
                       shm_bytes, other)


def _smaps_rollup(pid: int | str) -> dict[str, int]:
    """Fields of ``/proc/PID/smaps_rollup`` in bytes ({} where unreadable)."""
    fields: dict[str, int] = {}
    data = read_small_file(f"/proc/{pid}/smaps_rollup")
    if data is None:
        return {}
    for line in data.decode(errors="replace").splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[0].endswith(":") and parts[1].isdigit():
            fields[parts[0][:-1]] = int(parts[1]) * 1024
    return fields


def _children(pid: int | str) -> list[int]:
    """Direct child processes of ``pid`` (every thread's ``children`` file)."""
    out: list[int] = []
    try:
        with get_default_pool().transient():
            tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for task in tasks:
        data = read_small_file(f"/proc/{pid}/task/{task}/children")
        out.extend(int(child) for child in (data or b"").split())
    return out


def _descendants(pid: int | str) -> list[int]:
    found: list[int] = []
    pending = _children(pid)
    while pending:
        child = pending.pop()
        found.append(child)
        pending.extend(_children(child))
    return found


def headrace_threads() -> int:
    """Threads of this process started by headrace (named ``headrace-*``)."""
    return sum(thread.name.startswith("headrace") for thread in threading.enumerate())


@dataclass(frozen=True)
class ProcessSnapshot:
    """This process's memory by kind, in bytes, with its workers and descriptors.

    ``uss`` and the ``pss_*`` fields are 0 where ``smaps_rollup`` is not
    available (non-Linux, or a snapshot taken with ``detailed=False``).
    """

    anonymous: int
    shared: int
    file_backed: int
    uss: int = 0
    pss_anonymous: int = 0
    pss_shared: int = 0
    #: Proportional anonymous + shared memory of every descendant process (workers).
    workers: int = 0
    worker_count: int = 0
    descriptors: Descriptors = Descriptors(-1)
    threads: int = 0
    headrace_threads: int = 0
    #: Each descendant process (worker) by itself: RSS, USS and proportional sizes.
    worker_processes: tuple[WorkerMemory, ...] = ()
    #: Live shared-memory segments of this process's pipelines (process maps' inputs and
    #: outputs: named in /dev/shm or mapped here or by a worker) and their bytes.
    shm_segments: int = 0
    shm_bytes: int = 0

    @property
    def charged(self) -> int:
        """What the budget's measured guarantee covers: anonymous + shared, workers' share too."""
        return self.anonymous + self.shared + self.workers


def snapshot(*, detailed: bool = True, workers: bool | None = None) -> ProcessSnapshot:
    """Read this process's memory; ``detailed`` adds USS/PSS, workers and descriptors.

    ``workers`` (default: ``detailed``) reads the worker processes' memory alone
    besides the cheap read: what a profile's memory line charges, so every sample of
    it counts the workers, not only the detailed ones.
    """
    basic = process_memory()
    if not detailed:
        if not workers:
            return ProcessSnapshot(basic.anonymous, basic.shared, basic.file_backed,
                                   threads=threading.active_count(),
                                   headrace_threads=headrace_threads())
        pids = _descendants(os.getpid())
        processes = tuple(m for m in map(worker_memory, pids) if m is not None)
        return ProcessSnapshot(basic.anonymous, basic.shared, basic.file_backed,
                               workers=sum(m.charged for m in processes),
                               worker_count=len(pids), threads=threading.active_count(),
                               headrace_threads=headrace_threads(),
                               worker_processes=processes)
    rollup = _smaps_rollup("self")
    pids = _descendants(os.getpid())
    processes = tuple(m for m in map(worker_memory, pids) if m is not None)
    segments, segment_bytes = shared_memory_segments(pids=tuple(pids))
    return ProcessSnapshot(
        basic.anonymous,
        basic.shared,
        basic.file_backed,
        uss=rollup.get("Private_Clean", 0) + rollup.get("Private_Dirty", 0),
        pss_anonymous=rollup.get("Pss_Anon", 0),
        pss_shared=rollup.get("Pss_Shmem", 0),
        workers=sum(m.charged for m in processes),
        worker_count=len(pids),
        descriptors=descriptors(),
        threads=threading.active_count(),
        headrace_threads=headrace_threads(),
        worker_processes=processes,
        shm_segments=segments,
        shm_bytes=segment_bytes,
    )


def shared_memory_segments(
    owner: int | None = None, pids: tuple[int, ...] = ()
) -> tuple[int, int]:
    """Live segments of ``owner``'s pipelines (default: this process) and their bytes.

    Process maps name every segment ``headrace-<owner>-<maker>-...`` and the
    receiver unlinks the name once it has mapped it, so a live segment is one
    still named in /dev/shm (made, not yet mapped: what ``headrace doctor``
    reports when it outlives its pipeline) or one mapped by the owner or by one
    of ``pids`` (its workers), read from their ``/proc/PID/maps``.
    """
    from headrace._workers.shm import SHM_DIR

    owner = os.getpid() if owner is None else owner
    prefix = f"headrace-{owner}-"
    sizes: dict[str, int] = {}
    try:
        with get_default_pool().transient(), os.scandir(SHM_DIR) as entries:
            for entry in entries:
                if entry.name.startswith(prefix):
                    with contextlib.suppress(OSError):  # unlinked meanwhile
                        sizes[entry.name] = entry.stat().st_size
    except OSError:
        pass
    marker = f"{SHM_DIR.rstrip('/')}/{prefix}"
    for pid in (owner, *pids):
        mapped: dict[str, int] = {}
        try:
            data = read_small_file(f"/proc/{pid}/maps")
            if data is None:
                continue  # gone, or not ours to read
            for line in data.decode(errors="replace").splitlines():
                at = line.find(marker)
                if at < 0:
                    continue
                name = line[at + len(marker) - len(prefix):].split()[0]
                low, high = line.split(None, 1)[0].split("-")
                mapped[name] = mapped.get(name, 0) + int(high, 16) - int(low, 16)
        except ValueError:
            continue  # gone, or not ours to read
        for name, size in mapped.items():
            sizes[name] = max(sizes.get(name, 0), size)
    return len(sizes), sum(sizes.values())

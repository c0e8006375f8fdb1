"""Pipeline options: the memory budget, the file cap, determinism.

Options are attached to a dataset with :meth:`Dataset.with_options` and apply
to every iterator created from it. They are part of the recipe, so they are
picklable and take part in the pipeline fingerprint only where they change the
output (``memory_budget`` may shrink a shuffle buffer; ``deterministic`` may
reorder a parallel map) — see :mod:`headrace.core.iterator`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace

from headrace.errors import InvalidArgumentError

__all__ = ["AUTOTUNE", "Options", "available_memory", "parse_bytes"]

#: Pass as ``num_parallel_calls`` / ``buffer_size`` to let headrace choose,
#: inside the memory budget. Same value as ``tf.data.AUTOTUNE``.
AUTOTUNE = -1

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | str) -> int:
    """Bytes from an int or a string such as ``"512MiB"``, ``"2 GB"``, ``"1.5GiB"``.

    Binary units (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones (KB, MB,
    GB, TB) powers of 1000, so a budget means exactly what it says.
    """
    if isinstance(value, bool):
        raise InvalidArgumentError(f"a byte size must be an int or a string, got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise InvalidArgumentError(f"a byte size must be positive, got {value}")
        return value
    if not isinstance(value, str):
        raise InvalidArgumentError(f"a byte size must be an int or a string, got {value!r}")
    match = _SIZE.match(value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise InvalidArgumentError(
            f"cannot parse byte size {value!r}: expected a number with an optional unit "
            f"(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '512MiB'"
        )
    size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise InvalidArgumentError(f"a byte size must be positive, got {value!r}")
    return size


def format_bytes(size: float) -> str:
    """A short human-readable size (binary units) for messages and reports."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _read_int(path: str) -> int | None:
    try:
        with open(path) as handle:
            text = handle.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def available_memory() -> int:
    """Memory available to this process, in bytes.

    Inside a cgroup v2 container with a ``memory.max`` limit, that limit minus
    the cgroup's current usage (the host's MemAvailable would overstate it and
    get the process OOM-killed); otherwise ``MemAvailable`` from /proc/meminfo.
    The smaller of the two when both apply.
    """
    candidates = []
    limit = _read_int("/sys/fs/cgroup/memory.max")
    current = _read_int("/sys/fs/cgroup/memory.current")
    if limit is not None and current is not None:
        candidates.append(max(limit - current, 0))
    meminfo = _meminfo_available()
    if meminfo is not None:
        candidates.append(meminfo)
    if not candidates:  # not Linux: fall back to the total physical memory
        pages = os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
        candidates.append(pages * os.sysconf("SC_PAGE_SIZE") if pages else 1 << 30)
    return min(candidates)


@dataclass(frozen=True)
class Options:
    """How a pipeline may use the machine.

    Args:
        memory_budget: hard cap in bytes (or a string like ``"512MiB"``) on what
            the pipeline's buffers hold. ``None`` uses the process-wide default
            budget: half the memory available to the process (cgroup-aware),
            shared by every pipeline that sets none — what tf.data's
            ``ram_budget`` defaults to, but enforced rather than estimated.
        max_open_files: cap on descriptors this pipeline may hold; it can only
            lower the process-wide cap, never raise it.
        deterministic: ``None`` means ``True``. ``False`` lets parallel stages
            emit whichever element is ready first.
        warn_on_shrink: warn once when a requested buffer is shrunk to fit.
        tune_allocator: on glibc, fix malloc's mmap threshold (once per process)
            so freed element buffers return to the OS instead of lingering in
            per-thread arenas, where the budget cannot see them.
    """

    memory_budget: int | str | None = None
    max_open_files: int | None = None
    deterministic: bool | None = None
    warn_on_shrink: bool = True
    tune_allocator: bool = True

    def __post_init__(self) -> None:
        if self.memory_budget is not None:
            object.__setattr__(self, "memory_budget", parse_bytes(self.memory_budget))
        if self.max_open_files is not None and (
            isinstance(self.max_open_files, bool)
            or not isinstance(self.max_open_files, int)
            or self.max_open_files < 1
        ):
            raise InvalidArgumentError(
                f"max_open_files must be a positive int, got {self.max_open_files!r}"
            )

    @property
    def budget_bytes(self) -> int | None:
        """The explicit budget in bytes, or None for the process-wide default."""
        return self.memory_budget if isinstance(self.memory_budget, int) else None

    def merge(self, other: Options) -> Options:
        """These options overridden by every field ``other`` sets explicitly."""
        updates = {
            name: getattr(other, name)
            for name in ("memory_budget", "max_open_files", "deterministic")
            if getattr(other, name) is not None
        }
        for flag in ("warn_on_shrink", "tune_allocator"):
            if not getattr(other, flag):
                updates[flag] = False
        return replace(self, **updates)

"""Pipeline options: the memory budget, the file cap, determinism.

Options are attached to a dataset with :meth:`Dataset.with_options` and apply
to every iterator created from it. They are part of the recipe, so they are
picklable and take part in the pipeline fingerprint only where they change the
output (``memory_budget`` may shrink a shuffle buffer; ``deterministic`` may
reorder a parallel map) — see :mod:`headrace.core.iterator`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from headrace._errors import InvalidArgumentError
from headrace._memory.units import parse_bytes

__all__ = ["AUTOTUNE", "Options"]

#: Pass as ``num_parallel_calls`` / ``buffer_size`` to let headrace choose,
#: inside the memory budget. Same value as ``tf.data.AUTOTUNE``.
AUTOTUNE = -1

#: tf.data's option groups (``options.threading.private_threadpool_size = 2``).
_TF_GROUPS = frozenset({
    "threading", "autotune", "experimental_optimization", "experimental_distribute",
    "experimental_threading", "experimental_slack", "experimental_external_state_policy",
    "experimental_warm_start", "experimental_symbolic_checkpoint", "dataset_name",
    "framework_type",
})
_FIELDS = ("memory_budget", "max_open_files", "deterministic", "warn_on_shrink", "tune_allocator")


@dataclass
class Options:
    """How a pipeline may use the machine.

    Fields can be set after construction, tf.data style (``options =
    Options(); options.deterministic = False; ds.with_options(options)``);
    each is checked when set, and ``with_options`` takes a copy, so later
    edits never change a dataset already built. ``experimental_deterministic``
    is tf.data's older name of ``deterministic``.

    Args:
        memory_budget: hard cap in bytes (or a string like ``"512MiB"``) on what
            the pipeline's buffers hold. ``None`` uses the process-wide default
            budget: half the memory available to the process (cgroup-aware),
            shared by every pipeline that sets none — what tf.data's
            ``ram_budget`` defaults to, but enforced rather than estimated.
        max_open_files: cap on descriptors this pipeline may hold; it can only
            lower the process-wide cap, never raise it. Readers are suspended to
            stay under it; a ``cache(filename)``/``snapshot`` writer's file and lock
            count too, so each needs 2 slots beside one reader (a lower cap is an
            error naming the stage).
        deterministic: ``None`` means ``True``. ``False`` lets parallel stages
            emit whichever element is ready first.
        warn_on_shrink: warn once when a requested buffer is shrunk to fit.
        tune_allocator: on glibc, cap malloc's heap arenas at 2 (once per
            process), so that buffers freed by one map thread are reused by the
            others instead of lingering in per-thread arenas, where the budget
            cannot see them (``MALLOC_ARENA_MAX`` in the environment wins).
    """

    memory_budget: int | str | None = None
    max_open_files: int | None = None
    deterministic: bool | None = None
    warn_on_shrink: bool = True
    tune_allocator: bool = True

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "experimental_deterministic":
            name = "deterministic"
        if name not in _FIELDS:
            raise InvalidArgumentError(
                f"Options has no option {name!r}; headrace's options are {', '.join(_FIELDS)} "
                "(tf.data's threading, autotune and optimization options have no effect here)"
            )
        if name == "memory_budget" and value is not None:
            try:
                value = parse_bytes(value)
            except InvalidArgumentError as error:
                raise InvalidArgumentError(f"memory_budget: {error}") from None
        elif name == "max_open_files" and value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise InvalidArgumentError(f"max_open_files must be a positive int, got {value!r}")
        elif name == "deterministic" and value is not None and not isinstance(value, bool):
            raise InvalidArgumentError(f"deterministic must be None, True or False, got {value!r}")
        elif name in ("warn_on_shrink", "tune_allocator") and not isinstance(value, bool):
            raise InvalidArgumentError(f"{name} must be True or False, got {value!r}")
        object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        # (only for names that are not options: tf.data's option groups, read to be set)
        if name in _TF_GROUPS:
            raise AttributeError(
                f"Options has no {name!r} group (tf.data's threading, autotune and "
                "optimization options have no effect here); headrace's options are "
                f"{', '.join(_FIELDS)}"
            )
        raise AttributeError(f"'Options' object has no attribute {name!r}")

    @property
    def experimental_deterministic(self) -> bool | None:
        """tf.data's older name of :attr:`deterministic`."""
        return self.deterministic

    @experimental_deterministic.setter
    def experimental_deterministic(self, value: bool | None) -> None:
        self.deterministic = value

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

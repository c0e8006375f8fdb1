"""Reading iterator states back: every field checked for type and range (G4).

A state handed to ``set_state`` may come from a file someone edited, from
another version of a pipeline, or from a bug; restoring it blindly can hang
(replaying 10**15 shuffle draws), feed wrong data silently (a negative
``take`` counter that never reaches zero) or fail far from the cause (a bare
``StopIteration`` when a counter points past the end of the input). So every
``set_state`` reads its state through :class:`StateReader`, which raises
:class:`~headrace._errors.CheckpointError` naming the stage and the field, and
replays through :func:`replay`, which turns "the input ended first" into the
same error.

Before any field is read, :func:`check_seal` checks the checksum :func:`seal`
put over the whole state when it was taken: a state edited by hand (a position
moved forward, which would skip elements silently where the edited value is
still in range) or damaged in storage is refused as a whole. This is
*integrity*, not security: the checksum has no key, so whoever edits a state on
purpose can seal it again; it catches mistakes and corruption, and the field
checks above still guard against a producer's bugs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import xxhash

from headrace._errors import CheckpointError

__all__ = [
    "CHECKSUM",
    "EPOCH",
    "ERRORS_MET",
    "INNER",
    "INPUTS",
    "INT64_MAX",
    "POSITION",
    "PRODUCED",
    "SKIP",
    "StateReader",
    "check_seal",
    "past_end",
    "replay",
    "seal",
    "without_errors_met",
]

#: Counters are int64 wherever NumPy touches them; anything larger is corrupt.
INT64_MAX = (1 << 63) - 1

# Keys that more than one stage writes into its state. Each names one meaning
# everywhere; a stage's own keys are constants in its module.
#: The states of a stage's input iterators, in order (the base class's layout).
INPUTS = "inputs"
#: The state of the one input a stage wraps.
INNER = "inner"
#: Positions to pull again after restoring ``INNER`` (already handed out).
SKIP = "skip"
#: Marks the state of a stage running out of order (``deterministic=False``): which
#: iterator took it, after how many elements (see :func:`mark_out_of_order`).
OUT_OF_ORDER = "out_of_order"
#: Index of the next element of a stream or index sequence.
POSITION = "position"
#: Elements produced so far (replayed on restore where the input cannot seek).
PRODUCED = "produced"
#: Which repetition of its input a stage is in.
EPOCH = "epoch"
#: Errors the input raised in elements' places that a stage passed on (a shuffle
#: filling, a cache writing): replayed on restore. A count of errors met is not
#: progress through the input (:func:`without_errors_met`).
ERRORS_MET = "errors"

_MISSING = object()

#: The field of a sealed state that holds the checksum over all its other fields.
CHECKSUM = "checksum"


def _canonical(value: Any) -> Any:
    """``value`` as JSON would give it back (tuples as lists, keys as str), so a state
    checks the same before and after a round trip through ``json``."""
    if isinstance(value, dict):
        return {str(key): _canonical(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(item) for item in value]
    return value


def _checksum(state: dict[str, Any]) -> str:
    fields = {key: value for key, value in state.items() if key != CHECKSUM}
    text = json.dumps(_canonical(fields), sort_keys=True, separators=(",", ":"), default=repr)
    return xxhash.xxh3_128_hexdigest(text.encode())


def seal(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with a checksum over all its fields (:data:`CHECKSUM`), in place.

    Integrity, not security (there is no key): :func:`check_seal` refuses a state
    changed since, by hand or by damage, before any of its fields is believed."""
    state[CHECKSUM] = _checksum(state)
    return state


def is_sealed(state: dict[str, Any]) -> bool:
    """Whether ``state`` still matches the checksum :func:`seal` gave it (False if it has
    none): for callers that raise their own error naming what ``state`` is."""
    recorded = state.get(CHECKSUM)
    return isinstance(recorded, str) and recorded == _checksum(state)


def check_seal(state: dict[str, Any], what: str) -> None:
    """Refuse ``state`` (a dict :func:`seal` made; ``what`` names it) with a
    :class:`CheckpointError` if its checksum is missing or no longer matches."""
    recorded = state.get(CHECKSUM)
    if not isinstance(recorded, str):
        raise CheckpointError(
            f"{what} has no {CHECKSUM!r} field: it was not made by get_state (or by a "
            "headrace that did not seal its states)"
        )
    if recorded != _checksum(state):
        raise CheckpointError(
            f"{what} does not match its checksum: a field was changed after get_state "
            "made it (edited, or damaged in storage); resuming from it could skip or "
            "repeat elements silently. The checksum guards integrity, not security."
        )


class StateReader:
    """One stage's state dict, read field by field with the checks each field needs.

    ``stage`` names the stage in every error (``"shuffle"``, ``"take"``, ...),
    so a user with a rejected checkpoint sees which part of which pipeline
    disagreed and what value it held.
    """

    def __init__(self, state: Any, stage: str) -> None:
        if not isinstance(state, dict):
            raise CheckpointError(
                f"{stage}: its state must be a dict, got {type(state).__name__} {state!r:.60}"
            )
        self.state: dict[str, Any] = state
        self.stage = stage

    def error(self, key: str, problem: str) -> CheckpointError:
        """The error for field ``key`` of this stage's state."""
        return CheckpointError(f"{self.stage}: state field {key!r} {problem}")

    def raw(self, key: str) -> Any:
        """A field whatever its type; missing is an error."""
        value = self.state.get(key, _MISSING)
        if value is _MISSING:
            raise CheckpointError(
                f"{self.stage}: state has no field {key!r} (it has {sorted(self.state)})"
            )
        return value

    def integer(self, key: str, low: int = 0, high: int = INT64_MAX, *, why: str = "") -> int:
        """An int in ``[low, high]``; ``why`` explains the upper bound in the error."""
        return self._check_int(key, self.raw(key), low, high, why)

    def optional_integer(
        self, key: str, low: int = 0, high: int = INT64_MAX, *, why: str = ""
    ) -> int | None:
        """Like :meth:`integer`, but ``None`` (or a missing key) is allowed."""
        value = self.state.get(key)
        return None if value is None else self._check_int(key, value, low, high, why)

    def _check_int(self, key: str, value: Any, low: int, high: int, why: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(key, f"must be an int, got {type(value).__name__} {value!r:.60}")
        if not low <= value <= high:
            reason = f" ({why})" if why else ""
            raise self.error(key, f"= {value} is out of range: it must be in [{low}, {high}]{reason}")
        return value

    def flag(self, key: str) -> bool:
        value = self.raw(key)
        if not isinstance(value, bool):
            raise self.error(key, f"must be true or false, got {value!r:.60}")
        return value

    def child(self, key: str) -> dict[str, Any]:
        """A nested state (an input's), checked to be a dict; its own stage checks the rest."""
        value = self.raw(key)
        if not isinstance(value, dict):
            raise self.error(key, f"must be a state dict, got {type(value).__name__} {value!r:.60}")
        return value

    def optional_child(self, key: str) -> dict[str, Any] | None:
        return None if self.raw(key) is None else self.child(key)

    def entries(self, key: str, length: int | None = None) -> list[Any]:
        value = self.raw(key)
        if not isinstance(value, list):
            raise self.error(key, f"must be a list, got {type(value).__name__} {value!r:.60}")
        if length is not None and len(value) != length:
            raise self.error(key, f"has {len(value)} entries, this pipeline needs {length}")
        return value

    def integers(
        self, key: str, length: int | None = None, low: int = 0, high: int = INT64_MAX
    ) -> list[int]:
        values = self.entries(key, length)
        return [self._check_int(f"{key}[{i}]", v, low, high, "") for i, v in enumerate(values)]


def replay(pull: Callable[[], object], count: int, stage: str, key: str) -> None:
    """Call ``pull`` ``count`` times to replay a stream up to its checkpoint.

    ``pull`` raises ``StopIteration`` when the input ends: the state then
    points past the end of this input, which is a :class:`CheckpointError`
    (never a bare ``StopIteration`` escaping from ``set_state``).
    """
    for done in range(count):
        try:
            pull()
        except StopIteration:
            raise past_end(stage, key, count, done) from None


def past_end(stage: str, key: str, count: int, done: int) -> CheckpointError:
    """The error for a replay of ``count`` elements whose input ended after ``done``."""
    return CheckpointError(
        f"{stage}: state field {key!r} = {count} points past the end of the input, "
        f"which ended after {done} elements; the state belongs to other data"
    )


def mark_out_of_order(state: dict[str, Any], iterator: Any) -> dict[str, Any]:
    """Mark ``state`` as taken from ``iterator``, a stage handing out elements out of
    order, after its ``handed`` elements. ``Run.get_state`` refuses a checkpoint that
    holds such a state while elements went out after it (:func:`stale_out_of_order`)."""
    state[OUT_OF_ORDER] = [id(iterator), iterator.handed]
    return state


def stale_out_of_order(iterator: Any, mark: Any) -> bool:
    """Whether ``mark`` (of :func:`mark_out_of_order`) is ``iterator``'s and elements went
    out since: a stage above that kept the state counts positions past it, which a
    restore (another order) would not give back the same."""
    return isinstance(mark, list) and mark[0] == id(iterator) and mark[1] != iterator.handed


def settle_out_of_order(state: dict[str, Any], stages: Any) -> dict[str, Any]:
    """``state``, taken now to be restored as it is (no count of elements taken after
    it: a batch boundary a device ring keeps), without the marks of out-of-order
    ``stages`` that are current: restoring it is at-least-once whatever comes out
    after. Stale marks (a stage below kept an earlier state) stay, to be refused."""
    stages = list(stages)
    if stages:
        for marked in out_of_order_marked(state):
            if not any(stale_out_of_order(stage, marked[OUT_OF_ORDER]) for stage in stages):
                del marked[OUT_OF_ORDER]
    return state


def out_of_order_marked(state: Any) -> list[dict[str, Any]]:
    """Every dict in ``state`` (nested dicts and lists) with an ``OUT_OF_ORDER`` mark."""
    found: list[dict[str, Any]] = []
    pending: list[Any] = [state]
    while pending:
        value = pending.pop()
        if isinstance(value, dict):
            if OUT_OF_ORDER in value:
                found.append(value)
            pending.extend(value.values())
        elif isinstance(value, list):
            pending.extend(value)
    return found


def without_errors_met(state: Any) -> Any:
    """``state`` without its stages' counts of errors met (:data:`ERRORS_MET`): what
    says whether a stream moved. A stage above one that raises the same error again and
    again counts each, so its state changes while the stream stands still."""
    if isinstance(state, dict):
        return {key: without_errors_met(value) for key, value in state.items()
                if key != ERRORS_MET}
    if isinstance(state, list):
        return [without_errors_met(value) for value in state]
    return state

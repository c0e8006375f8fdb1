"""``map(parse one record).batch(n)`` run as one columnar parse per batch.

tf.data traces a map function once and fuses ``map`` with the ``batch`` after it; a
recipe written that way - ``records.map(lambda r: parse_single_example(r, spec))
.batch(n)`` - is the form its users know, and per-record parsing is ~16x slower than
``parse_example`` on a batch. headrace does the same rewrite:

* **Seeing the function.** A map function qualifies when it mentions
  ``parse_single_example`` (in its own code, or in a function it calls by name, a
  few levels deep, or as a ``functools.partial``). Such a function is called once, when
  the first iterator is built, on a :class:`~headrace.io.example.deferred.DeferredRecord`
  (as tf.data calls it once to trace it): if it only parses its record - with one or
  more specs - and returns features from the results, arranged in a dict/tuple/list
  nest, the map is fused. Anything else it does to a feature makes the trace fail, and
  the map runs per record as written. ``FixedLenSequenceFeature`` is not fused: batching
  per-record results of different lengths fails in tf.data and in headrace, and the
  columnar parse would pad instead.
* **Results.** A batch is ``parse_example(records, spec)`` arranged as the function
  arranges one record's features: the same values as ``batch(n).parse_examples(spec)``
  (VarLen and Ragged features as :class:`RaggedColumn`, Sparse as
  :class:`SparseColumn`).
* **Errors.** When the columnar parse refuses a batch, the map function runs on its
  records one by one and the first error it raises is raised - the same exception,
  message and note (stage, element index) as without fusion. The whole batch is taken
  first, so the next batch starts after it: tf.data's default behaviour, whose
  map_and_batch_fusion does the same (unfused, both start the next batch right after the
  failing record).
* **Checkpoints.** The state is the batch's input state plus the count of records
  consumed; fusion depends only on the recipe, so a state restores into the same
  pipeline on any process.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from headrace._errors import HeadraceError, note_element_error
from headrace._memory.buffer import Buffer, Reservation
from headrace._structure import flatten, pack_as
from headrace.core.iterator import Context, Iterator, origin_probe
from headrace.core.state import INNER, StateReader
from headrace.io.example.deferred import DeferredFeature, DeferredRecord
from headrace.io.example.parsing import parse_example
from headrace.io.example.specs import FeatureSpec, FixedLenSequenceFeature

__all__ = ["FUSION_RULES", "FusedParse", "FusedParseIterator", "fused_parse", "trace"]

_PARSE_NAME = "parse_single_example"
_SEARCH_DEPTH = 3


def _code_names(code: types.CodeType) -> set[str]:
    """Global and attribute names a code object (and the code nested in it) uses."""
    names = set(code.co_names)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names |= _code_names(constant)
    return names


def mentions_parse(fn: Any, depth: int = 0, name: str = _PARSE_NAME) -> bool:
    """Whether ``fn`` may call ``parse_single_example`` (or the function ``name``): a
    cheap look at its code, so that no other function is ever called on a stand-in."""
    if depth > _SEARCH_DEPTH:
        return False
    if isinstance(fn, functools.partial):
        return mentions_parse(fn.func, depth + 1, name)
    if getattr(fn, "__name__", None) == name:
        return True
    function = getattr(fn, "__func__", fn)  # a bound method
    code = getattr(function, "__code__", None)
    if code is None:  # a callable object: look at its __call__
        call = None if isinstance(fn, type) else type(fn).__dict__.get("__call__")
        return isinstance(call, types.FunctionType) and mentions_parse(call, depth + 1, name)
    names = _code_names(code)
    if name in names:
        return True
    scope: dict[str, Any] = dict(getattr(function, "__globals__", {}))
    for cell_name, cell in zip(code.co_freevars, getattr(function, "__closure__", None) or (),
                               strict=False):
        try:
            scope[cell_name] = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        names.add(cell_name)
    return any(
        callable(scope.get(used)) and mentions_parse(scope[used], depth + 1, name)
        for used in names
        if used in scope and isinstance(scope[used], types.FunctionType | functools.partial)
    )


def trace(fn: Callable[..., Any], placeholder: Any,
          made_by: Callable[[Any], bool]) -> tuple[Any, list[Any]] | None:
    """``fn`` applied to ``placeholder`` (a deferred record or line) as (structure, leaves),
    if every leaf it returns is one ``made_by`` the placeholder's parse; None if it
    raises or returns anything else (it does more than parse: it runs per record)."""
    try:
        output = fn(placeholder)
    except Exception:
        return None
    structure, leaves = nest_leaves(output)
    if not leaves or not all(made_by(leaf) for leaf in leaves):
        return None
    return structure, leaves


def nest_leaves(output: Any) -> tuple[Any, list[Any]]:
    """``output`` as (structure, leaves) when it is a dict/tuple/list nest; lists become
    tuples (a list of features batches as a tuple, as in tf.data)."""
    if isinstance(output, list):
        output = tuple(output)
    if isinstance(output, Mapping):
        output = {key: _nest_leaves_value(value) for key, value in output.items()}
    elif isinstance(output, tuple):
        output = tuple(_nest_leaves_value(value) for value in output)
    return output, flatten(output)


def _nest_leaves_value(value: Any) -> Any:
    if isinstance(value, list | tuple | Mapping):
        return nest_leaves(value)[0]
    return value


class FusedParse:
    """The batched form of a per-record parse function: its parses and its arrangement."""

    def __init__(self, parses: list[dict[str, FeatureSpec]], structure: Any) -> None:
        self.parses = parses
        self.structure = structure
        self.leaves: list[DeferredFeature] = flatten(structure)

    def __call__(self, records: list[bytes]) -> Any:
        parsed = [parse_example(records, spec) for spec in self.parses]
        return pack_as(self.structure, [parsed[leaf.parse][leaf.name] for leaf in self.leaves])


#: More rules of the same shape, ``fn -> FusedParse | None``, added by the packages that
#: own them (above this layer, so they register themselves when imported):
#: :mod:`headrace._csv.fusion` fuses ``map(decode_csv of a line).batch(n)``.
FUSION_RULES: list[Callable[[Callable[..., Any]], FusedParse | None]] = []


def fused_parse(fn: Callable[..., Any]) -> FusedParse | None:
    """The batched form of ``fn`` if it only parses its record (see the module doc), or
    the form one of :data:`FUSION_RULES` finds."""
    if not mentions_parse(fn):
        for rule in FUSION_RULES:
            fused = rule(fn)
            if fused is not None:
                return fused
        return None
    record = DeferredRecord()
    traced = trace(fn, record,
                   lambda leaf: isinstance(leaf, DeferredFeature) and leaf.record is record)
    if traced is None:
        return None
    structure, leaves = traced
    if any(
        isinstance(spec, FixedLenSequenceFeature)
        for spec in (record.parses[leaf.parse][leaf.name] for leaf in leaves)
    ):
        return None
    return FusedParse(record.parses, structure)


class FusedParseIterator(Iterator):
    """Batches of records from ``inner`` (a batch iterator), parsed in one call each.

    The columns are booked on the batch stage's ``account`` as they are (they exist
    once the parse returns), and the records' booking is released. Under
    ``drop_remainder`` (``whole``: the batch size) a short last batch is parsed before
    it is dropped, so a bad record in it raises, as in tf.data's fused map and batch.
    """

    stage = "batch"

    def __init__(
        self,
        inner: Iterator,
        parse: FusedParse,
        fn: Callable[..., Any],
        map_stage: str,
        ctx: Context,
        account: Buffer,
        whole: int = 0,
    ) -> None:
        super().__init__(inner)
        self.inner, self.parse, self.fn, self.map_stage = inner, parse, fn, map_stage
        self.ctx, self.account, self.whole = ctx, account, whole
        self.index = 0  # records consumed: the element index an error names
        origin_probe(inner, tokens=False)  # an error names its record's file and offset

    def pull(self) -> tuple[Any, Reservation]:
        batch, reservation = self.inner.pull()
        try:
            first = self.index
            records = batch.tolist() if isinstance(batch, np.ndarray) else list(batch)
            self.index += len(records)
            try:
                columns = self.parse(records)
            except HeadraceError as error:
                raise self._per_record_error(records, first, error) from None
            if len(records) < self.whole:  # a short last batch, checked: dropped
                raise StopIteration
            (booking,) = self.account.admit_existing([self.ctx.sizeof(columns)])
        finally:
            reservation.release()
        return columns, booking

    def _per_record_error(
        self, records: list[bytes], first: int, batch_error: Exception
    ) -> Exception:
        """The error the map function raises on the first record it refuses."""
        for offset, record in enumerate(records):
            try:
                self.fn(record)
            except Exception as error:
                batch = self.inner.origin()  # (the input is still on this batch)
                origin = batch.rows[offset] if batch is not None and offset < len(
                    batch.rows) else None
                return note_element_error(error, self.map_stage, first + offset, origin)
        return batch_error

    def get_state(self) -> dict[str, Any]:
        return {INNER: self.inner.get_state(), "index": self.index}

    def set_state(self, state: dict[str, Any]) -> None:
        reader = StateReader(state, self.stage)
        self.inner.set_state(reader.child(INNER))
        self.index = reader.integer("index")

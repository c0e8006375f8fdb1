"""``Dataset.parse_examples``: a map whose outputs are booked before they are made.

A parse is a map whose output can be many times its input (an int64 of one wire byte
is 8 bytes parsed), so booking it at its input's size breaks the budget (G1). This
stage books each batch's parsed features on its own share, through
:meth:`~headrace.io.example.parsing.BatchParser.parse_booked`: a batch that cannot fit
is refused before its values are made, with an error naming the stage.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from headrace.core.iterator import Context, Iterator
from headrace.errors import InvalidArgumentError, note_element_error
from headrace.io.example.parsing import BatchParser
from headrace.memory.buffer import Buffer, Reservation
from headrace.transforms.map import MapNode, _MapIterator

__all__ = ["ParseExamples", "ParseExamplesNode"]


class ParseExamples:
    """A picklable batched parse (the function of ``Dataset.parse_examples``)."""

    def __init__(self, features: Mapping[str, Any]) -> None:
        # Planned now, once (a spec mistake raises here), never mid-run: the pipeline's
        # fingerprint describes this object's attributes, and must not change once a
        # batch has been parsed (a checkpoint would no longer restore into a new one).
        self.parser = BatchParser(features)
        self.__qualname__ = f"parse_examples({sorted(self.parser.features)})"

    def records(self, serialized: Any) -> list[bytes]:
        if not isinstance(serialized, np.ndarray) or serialized.ndim != 1:
            raise InvalidArgumentError(
                "parse_examples expects batches of serialized records: apply it after batch()"
            )
        records: list[bytes] = serialized.tolist()
        return records

    def __call__(self, serialized: Any) -> Any:
        return self.parser(self.records(serialized))


class ParseExamplesNode(MapNode):
    """``batch(n).parse_examples(spec)``: each batch parsed with its output booked."""

    def __init__(self, source: Any, features: Mapping[str, Any]) -> None:
        super().__init__(source, ParseExamples(features), None, None, stage="parse_examples")

    def make_iterator(self, ctx: Context) -> Iterator:
        if self.index_plan() is not None:  # read by index, element by element, as a map
            return super().make_iterator(ctx)
        inner = self.inputs[0].make_iterator(ctx)
        return _ParseIterator(inner, self.fn, self.stage, ctx.epochs, ctx.account(self))


class _ParseIterator(_MapIterator):
    def __init__(self, inner: Iterator, fn: Any, stage: str, epochs: tuple[int, ...],
                 account: Buffer) -> None:
        super().__init__(inner, fn, stage, epochs)
        self.account = account

    def pull(self) -> tuple[Any, Reservation]:
        index = self.index
        try:
            element, reservation = self.inner.pull()
        except StopIteration:
            raise
        except Exception:  # an input element's error takes its position, as in a map
            self.index = index + 1
            raise
        self.index = index + 1
        fn = self.fn
        assert isinstance(fn, ParseExamples)
        try:
            parsed, booking = fn.parser.parse_booked(fn.records(element), self.account)
        except Exception as error:  # the batch is dropped; the next one goes on
            reservation.release()
            origin = self.inner.origin()
            raise note_element_error(error, self.stage, index, origin)  # noqa: B904
        reservation.release()  # the records are given back: the features replace them
        return parsed, booking

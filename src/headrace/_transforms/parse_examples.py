"""``Dataset.parse_examples``: a map whose outputs are booked before they are made.

A parse is a map whose output can be many times its input (an int64 of one wire byte
is 8 bytes parsed), so booking it at its input's size breaks the budget (G1). This
stage books each batch's parsed features on its own share, through
:func:`parse_booked`: a batch that cannot fit
is refused before its values are made, with an error naming the stage.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from headrace._errors import InvalidArgumentError, note_element_error
from headrace._memory.buffer import NO_RESERVATION, Buffer, Reservation
from headrace._memory.sizeof import sizeof
from headrace._transforms.map import MapIterator, MapNode
from headrace.core.iterator import Context, Iterator
from headrace.io.example.parsing import BatchParser

__all__ = ["ParseExamples", "ParseExamplesNode", "parse_booked"]


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


class _ParseIterator(MapIterator):
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
            parsed, booking = parse_booked(fn.parser, fn.records(element), self.account)
        except Exception as error:  # the batch is dropped; the next one goes on
            reservation.release()
            origin = self.inner.origin()
            raise note_element_error(error, self.stage, index, origin)  # noqa: B904
        reservation.release()  # the records are given back: the features replace them
        return parsed, booking


def parse_booked(
    parser: BatchParser, records: Sequence[bytes], account: Buffer
) -> tuple[Any, Reservation]:
    """Parse ``records`` with their output booked on ``account`` (G1), refused at its
    share before the values are made.

    Why: a parse can make 8 bytes of an int64 from one byte of a varint, so the
    input's booking says little of the output's. A FixedLen feature's size is known
    from its shape and the row count: it is checked first. When the most the records
    could make (``BatchParser.most_nbytes``) fits twice beside what the stage holds (the
    scan's buffers grow), the batch parses at once and its output is booked. Otherwise
    the values are counted first, a slice of records at a time, each slice booked as it
    is counted, so a batch that cannot fit is refused after at most one slice.
    """
    what = (f"the parsed features of a batch of {len(records)} records (a smaller "
            "batch before parse_examples fits)" if len(records) > 1 else
            "the parsed features of one record")
    account.expect(parser.fixed_nbytes(len(records)), together=what)
    most = parser.most_nbytes(records)
    if 2 * most <= account.room():
        parsed = parser(records)
        return parsed, account.admit(sizeof(parsed), together=what)
    booking = _count_booked(parser, records, account, what, most)
    try:
        account.expect(booking.nbytes, together=what)  # room to grow them
        parsed = parser(records)
        extra = sizeof(parsed) - booking.nbytes
        if extra > 0:  # defaults and padding the counts did not include
            booking = booking.absorb(account.admit(extra, together=what))
    except BaseException:
        booking.release()
        raise
    return parsed, booking


def _count_booked(
    parser: BatchParser, records: Sequence[bytes], account: Buffer, what: str, most: int
) -> Reservation:
    """Count the values of ``records`` a slice at a time, each slice booked together
    with the ones before it."""
    booking = NO_RESERVATION
    per_record = max(1, most // max(1, len(records)))
    try:
        start = 0
        while start < len(records):
            room = max(0, account.room())
            end = start + max(1, min(len(records) - start, room // (2 * per_record)))
            cost = parser.values_nbytes(records[start:end])
            if cost is None:  # the parse itself reports it, with the batch's row
                break
            booking = booking.absorb(account.admit(cost, together=what))
            start = end
    except BaseException:
        booking.release()
        raise
    return booking

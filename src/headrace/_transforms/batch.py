"""``batch(batch_size, drop_remainder=False)``, with tf.data's order.

Batching a random-access input is one slice (consecutive rows) or one gather
(shuffled rows) per batch — no per-row Python work. Batching a stream books
every element on the stage's share of the budget while the batch is being
assembled, plus the output: that pair is the stage's minimum working set, and
a batch that cannot fit raises :class:`MemoryBudgetError` instead of
over-running the budget. Such a batch is refused whole: its rows are taken from
the input and dropped, and its error stands in their place, so the batches after
it are the ones a larger budget makes.

Bytes and strings batch into NumPy ``object`` arrays of the exact Python
objects (fixed-width ``S``/``U`` would drop trailing NULs).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from headrace._errors import (
    ElementSpecError,
    MemoryBudgetError,
    Origin,
)
from headrace._memory.allocator import ArrayPool
from headrace._memory.buffer import NO_RESERVATION, Assembly, Buffer, Reservation
from headrace._memory.sizeof import ARRAY_HEADER_BYTES, plain_array, sizeof
from headrace._structure import (
    flatten,
    map_structure,
    pack_as,
    structure_paths,
)
from headrace.core.indexing import (
    BatchedAccess,
    GatherBatchIterator,
    IndexPlan,
    RandomAccess,
    Reach,
    Refusal,
)
from headrace.core.iterator import (
    PROFILE_RECORD,
    BatchToken,
    Context,
    Iterator,
    origin_probe,
)
from headrace.core.node import (
    INFINITE,
    UNKNOWN,
    Node,
    ShardRole,
    Traits,
    batching_role,
    check_positive,
)
from headrace.core.stack import row_item
from headrace.core.state import INNER, POSITION, StateReader

__all__ = ["BatchNode", "ColumnarBatchIterator", "batch_iterator", "batched_cardinality"]


def _batched_spec(spec: Any, batch_size: int, drop_remainder: bool) -> Any:
    size = batch_size if drop_remainder else None
    return map_structure(lambda leaf: leaf.with_leading(size), spec)


class BatchNode(Node):
    stage = "batch"
    budget_weight = 2

    def element_access(self, reach: Reach) -> RandomAccess | Refusal:
        if not self.drop_remainder:
            return Refusal(self, "only with drop_remainder=True: a partial last batch")
        inner = reach(self.inputs[0])
        return inner if isinstance(inner, Refusal) else BatchedAccess(inner, self.batch_size)

    def traits(self) -> Traits:
        return Traits(groups=True)

    def __init__(self, source: Node, batch_size: int, drop_remainder: bool) -> None:
        super().__init__(source)
        self.batch_size = check_positive("batch: batch_size", batch_size)
        self.drop_remainder = bool(drop_remainder)

    def shard_role(self) -> ShardRole:
        return batching_role(self.inputs[0], self.drop_remainder)

    def params(self) -> tuple[Any, ...]:
        return (self.batch_size, self.drop_remainder)

    @property
    def element_spec(self) -> Any:
        return _batched_spec(self.inputs[0].element_spec, self.batch_size, self.drop_remainder)

    def cardinality(self) -> int:
        return batched_cardinality(
            self.inputs[0].cardinality(), self.batch_size, self.drop_remainder
        )

    def index_plan(self) -> IndexPlan | None:
        return None  # a batch is one element made of many: not addressable by one index

    def make_iterator(self, ctx: Context) -> Iterator:
        return batch_iterator(
            self.inputs[0], ctx, ctx.account(self), self.batch_size, self.drop_remainder
        )


def batch_iterator(
    source: Node, ctx: Context, account: Buffer, batch_size: int, drop_remainder: bool
) -> Iterator:
    """Batches of ``source``'s elements, booked on ``account``, by the best route: one
    gather per batch of a random-access source, a batch the source makes itself (a
    reader; a map that parses a batch at once), or assembled element by element."""
    plan = source.index_plan()
    if plan is not None:
        access, make_stream = plan
        if not access.gathers_batches():  # rows are computed (a map): assemble in place
            pushed = source.batched_iterator(ctx, batch_size, drop_remainder, account)
            if pushed is not None:
                return pushed
            return _BatchIterator(
                source.make_iterator(ctx), ctx, account, batch_size, drop_remainder
            )
        access.prepare(ctx)
        return _ChargedBatches(
            GatherBatchIterator(access, make_stream(ctx), batch_size, drop_remainder),
            ctx,
            account,
        )
    pushed = source.batched_iterator(ctx, batch_size, drop_remainder, account)
    if pushed is not None:
        return pushed  # books each batch on `account` as it reads it
    return _BatchIterator(source.make_iterator(ctx), ctx, account, batch_size, drop_remainder)


def batched_cardinality(inner: int, batch_size: int, drop_remainder: bool) -> int:
    if inner in (INFINITE, UNKNOWN):
        return inner
    return inner // batch_size if drop_remainder else -(-inner // batch_size)


#: A batch costing no more than this is views of memory that predates the run (array
#: headers only): not booked, which keeps two lock round trips off the per-batch path.
_HEADERS_ONLY = 16 * ARRAY_HEADER_BYTES


class _ChargedBatches(Iterator):
    """Books each batch made below (a gather, a reader) on the batch stage's share."""

    stage = "batch"
    passes_origin = True  # (the batch's origin is its maker's)

    def __init__(self, inner: Iterator, ctx: Context, account: Buffer) -> None:
        super().__init__(inner)
        self.inner, self.ctx, self.account = inner, ctx, account
        # Bound once: this runs per batch, and each attribute/method hop costs ~0.05 us.
        self._pull_batch = inner.pull
        self._preexisting = ctx.preexisting  # the run's set, filled in place by prepare()

    def pull(self) -> tuple[Any, Reservation]:
        # (the inner's pull, not its __next__, and an array costed by plain_array, not
        # through sizeof: two Python calls less a batch, ~1,000 instructions, where a
        # batch sliced from an array costs ~18,000 in all)
        batch, upstream = self._pull_batch()
        if upstream is not NO_RESERVATION:  # (what the inner's __next__ does)
            upstream.release()
        plain = plain_array(batch, self._preexisting) if type(batch) is np.ndarray else None
        cost = sizeof(batch, self._preexisting) if plain is None else plain[0]
        if cost <= _HEADERS_ONLY:  # a slice of the user's memory: only array headers are new
            return batch, NO_RESERVATION
        return batch, self.account.admit(cost, together="one batch")


class Assembler(Iterator):
    """Shared by the streaming batchers: pull and book up to N elements of a batch."""

    def __init__(self, inner: Iterator, ctx: Context, account: Buffer) -> None:
        super().__init__(inner)
        self.inner, self.ctx, self.account = inner, ctx, account
        self.position = 0  # elements consumed, for error messages

    def pull_many(self, count: int, what: str) -> tuple[list[Any], Assembly]:
        """Up to ``count`` elements, held together on this stage's share as one
        :class:`Assembly` (``what`` names it in a refusal)."""
        elements: list[Any] = []
        assembly = Assembly(self.account, what)
        sizeof = self.ctx.sizeof
        try:
            for _ in range(count):
                element, reservation = self.inner.pull()
                elements.append(element)
                try:
                    assembly.take(sizeof(element), reservation)
                except MemoryBudgetError:  # refused whole (see drop_rest_of_batch)
                    self.position += len(elements)
                    self.drop_rest_of_batch(count - len(elements))
                    raise
        except StopIteration:
            pass
        except BaseException:
            assembly.abandon()
            raise
        return elements, assembly

    def drop_rest_of_batch(self, rows: int) -> None:
        """A batch the budget refuses (its output, or the rows it keeps) is refused
        whole: its other ``rows`` rows are pulled and dropped, so its error stands in
        its place and the batches after it are the ones an unrefused run makes (the
        next batch used to start with its unpulled rows, and the last refused one could
        end the stream without its error)."""
        for _ in range(rows):
            try:
                _, reservation = self.inner.pull()
            except StopIteration:
                return
            except Exception:  # (a row's own error: the batch's refusal stands for it)
                self.position += 1
                continue
            self.position += 1
            reservation.release()

    def get_state(self) -> dict[str, Any]:
        return {INNER: self.inner.get_state(), POSITION: self.position}

    def set_state(self, state: dict[str, Any]) -> None:
        reader = StateReader(state, self.stage)
        self.position = reader.integer(POSITION)
        self.inner.set_state(reader.child(INNER))


def _leaf_dtype(leaf: Any) -> np.dtype[Any]:
    """The dtype ``np.stack`` would give this leaf (object for bytes, str, objects)."""
    if isinstance(leaf, (np.ndarray, np.generic)):
        return leaf.dtype
    if type(leaf) in _PYTHON_SCALARS:
        return _PYTHON_SCALARS[type(leaf)]
    if isinstance(leaf, (bytes, str)):
        return np.dtype(object)
    return np.asarray(leaf).dtype


_PYTHON_SCALARS: dict[type, np.dtype[Any]] = {
    bool: np.dtype(np.bool_),
    int: np.dtype(np.int64),
    float: np.dtype(np.float64),
    complex: np.dtype(np.complex128),
}


_KIND_ORDER = {"b": 0, "u": 1, "i": 1, "f": 2, "c": 3}


class _Column:
    """One component of a batch being assembled in place: its output array and row shape."""

    __slots__ = ("dtype", "item", "out", "path", "scalar", "shape")

    def __init__(self, leaf: Any, path: str) -> None:
        dtype = _leaf_dtype(leaf)
        self.dtype = np.dtype(object) if dtype.kind in "OSU" else dtype
        self.shape: tuple[int, ...] = np.shape(leaf)
        self.path = path
        self.out: np.ndarray[Any, Any] | None = None
        #: The NumPy scalar type a row of a scalar column is (np.int64 for range's
        #: elements): such a row goes in as it is, without the general checks.
        self.scalar: type | None = None
        #: A scalar object column: a 0-d array's row is its item, as np.stack gives it
        #: (stored whole in an object slot the array would nest: a row that is not bytes).
        self.item = self.shape == () and self.dtype.hasobject
        if self.shape == ():
            self.scalar = type(leaf) if type(leaf) in (bytes, str) else (
                None if self.dtype.hasobject else self.dtype.type
            )

    def row_bytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


class _BatchIterator(Assembler):
    """Assembles each batch *in place*: the output is booked and allocated from the
    first element's shapes, every element is copied into its row as it arrives and
    its booking released at once. The working set is one batch (plus one element),
    not a batch of inputs plus its output, and a batch that cannot fit raises
    :class:`MemoryBudgetError` before anything is allocated. Components of Python
    objects (bytes, str, object arrays) keep references to the elements' objects,
    whose bookings stay with the batch.
    """

    stage = "batch"

    def __init__(
        self,
        inner: Iterator,
        ctx: Context,
        account: Buffer,
        batch_size: int,
        drop_remainder: bool,
    ) -> None:
        super().__init__(inner, ctx, account)
        self.batch_size, self.drop_remainder = batch_size, drop_remainder
        self._assembly: Assembly | None = None  # the batch being assembled
        #: The input's origin probe, once a stage above asks for origins: each row's
        #: token is taken as it is pulled, and the batch's token holds them all.
        self.probe: tuple[Callable[[], Any], Callable[[Any], Origin | None]] | None = None
        self.last_token: BatchToken | None = None
        #: Large columns reuse batches the consumer let go of (no fresh pages to zero):
        #: kept as a booked spare where the share has room for one beside a batch, else
        #: booked while the stage awaits its next batch, or handed over to the batch
        #: being filled (see ArrayPool).
        self._pool = ArrayPool(booker=self._book_idle)
        self._spare: Reservation = NO_RESERVATION
        #: Columns of the batch being assembled in fresh memory that would move into a
        #: batch the consumer lets go of meanwhile (ArrayPool.exchange).
        self._pending: list[_Column] = []

    def close(self) -> None:
        self._drop_spare()
        self._pool.close()
        super().close()

    def _drop_spare(self) -> None:
        self._pool.clear()
        self._pool.keep_bytes = 0
        self._spare.release()
        self._spare = NO_RESERVATION

    def _book_spare(self, columns: list[_Column]) -> None:
        """Book what the pool may keep of a released batch: this batch's pooled columns,
        if the share has room for them beside it; else the pool keeps nothing."""
        pooled = sum(self._pool.pooled_bytes((self.batch_size, *column.shape), column.dtype)
                     for column in columns)
        if pooled == self._spare.nbytes:
            return
        if self._spare.nbytes:  # (the batch's shapes changed)
            self._drop_spare()
        if pooled and self.account.room() >= pooled:
            try:
                self._spare = self.account.admit(pooled, elements=0)
            except MemoryBudgetError:  # (a budget shared with other pipelines): no spare
                return
            self._pool.keep_bytes = pooled

    def origin(self) -> Origin | None:
        token = self.last_token
        return None if token is None else token.origin()

    def origin_token(self) -> Any:
        return self.last_token

    def origin_of(self, token: Any) -> Origin | None:
        return token.origin() if isinstance(token, BatchToken) else None

    def track_origins(self, tokens: bool = True) -> bool:
        if self.probe is None:
            self.probe = origin_probe(self.inner)
        return self.probe is not None

    def _pull_first(self) -> tuple[Any, Reservation]:
        """A batch's first element; at the end of the input the pool's spare goes back."""
        try:
            return self.inner.pull()
        except StopIteration:
            self._drop_spare()
            raise

    def pull(self) -> tuple[Any, Reservation]:
        first, reservation = self._pull_first()  # StopIteration: no more batches
        first_index = self.position
        self.position += 1
        probe = self.probe
        take = None if probe is None else probe[0]  # (bound once: it runs per row)
        tokens = None if take is None else [take()]
        single = not isinstance(first, (dict, tuple))
        leaves, columns = _columns_of(first, single)
        # The structure alone: the element itself (a process map's output: a view of a
        # shared-memory segment) must not outlive its booking, released once it is placed.
        structure = None if single else pack_as(first, [None] * len(leaves))
        del first
        keeps_objects = any(column.dtype.hasobject for column in columns)
        # The batch's one booking: its output, and the objects it keeps of its rows.
        assembly = self._allocate_whole(columns, reservation)
        objects_cost = self._objects_cost
        count = 0
        pulled = 1  # rows of this batch taken from the input (-1: the input raised)
        failure: ElementSpecError | None = None  # an element that does not fit the batch
        try:
            while True:
                if failure is None:
                    # tf.data takes the whole batch before it finds out (and drops a
                    # short last one under drop_remainder without a word): so do we
                    failure = self._place(columns, leaves, count, first_index)
                if keeps_objects and failure is None:  # its objects live on in the batch
                    assembly.take(
                        objects_cost(leaves) if reservation.account is None
                        else reservation.nbytes,
                        reservation,
                    )
                else:
                    reservation.release()
                count += 1
                if count == self.batch_size:
                    break
                leaves, element = [], None  # (placed, its booking gone: not kept while pulling)
                try:
                    element, reservation = self.inner.pull()
                except StopIteration:
                    break
                except BaseException:
                    pulled = -1  # an input's error: the rows after it start the next batch
                    raise
                pulled += 1
                self.position += 1
                if tokens is not None:
                    tokens.append(take())  # type: ignore[misc]
                leaves = [element] if single else flatten(element)
            booking = self._finish(assembly, count, failure)
        except BaseException as error:
            self._abandon(assembly, reservation, error, pulled)
            raise
        batch = _packed(columns, count, structure, single)
        if tokens is not None:
            self.last_token = BatchToken(probe[1], tokens)  # type: ignore[index]
        return batch, booking

    def _allocate_whole(self, columns: list[_Column], reservation: Reservation) -> Assembly:
        """The batch's output, booked; refused, the batch is refused whole."""
        try:
            return self._allocate(columns)
        except BaseException as error:
            reservation.release()
            if isinstance(error, MemoryBudgetError):
                self.drop_rest_of_batch(self.batch_size - 1)
            raise

    def _abandon(self, assembly: Assembly, reservation: Reservation, error: BaseException,
                 pulled: int) -> None:
        """A batch that failed while its rows were placed: its bookings go back, and one
        the budget refused is refused whole (``pulled`` rows taken so far)."""
        self._settle()
        reservation.release()
        assembly.abandon()
        if isinstance(error, MemoryBudgetError) and pulled > 0:
            self.drop_rest_of_batch(self.batch_size - pulled)

    def _finish(self, assembly: Assembly, count: int,
                failure: ElementSpecError | None) -> Reservation:
        """The batch's booking, once its ``count`` rows are in place; StopIteration for
        a short last batch under ``drop_remainder``, else the element that did not fit."""
        self._settle()
        if self.drop_remainder and count < self.batch_size:
            raise StopIteration
        if failure is not None:
            raise failure
        return assembly.finish()

    def _allocate(self, columns: list[_Column]) -> Assembly:
        """Book, then allocate, every column's output for a whole batch."""
        rows = self.batch_size
        nbytes = sum(
            ARRAY_HEADER_BYTES + rows * column.row_bytes() for column in columns
        )
        assembly = Assembly(self.account, f"a batch of {rows} elements")
        kept = self._pool.begin()  # released batches booked while this one was awaited
        try:
            self._reserve(assembly, nbytes, kept)
        except BaseException:
            self._settle()
            raise
        try:
            self._book_spare(columns)
            pool = self._pool
            for column in columns:
                reused = pool.reused
                column.out = pool.empty((rows, *column.shape), column.dtype, exchange=True)
                if pool.reused == reused and column.out.base is not None:
                    self._pending.append(column)  # fresh pooled memory (a plain np.empty
                    # owns its data: base None)
        except BaseException:
            self._settle()
            assembly.abandon()
            raise
        self._assembly = assembly
        return assembly

    @staticmethod
    def _reserve(assembly: Assembly, nbytes: int, kept: list[Reservation]) -> None:
        """Book the batch's output over the bookings of released batches it will reuse."""
        replacing = NO_RESERVATION
        for booking in kept:
            replacing = replacing.absorb(booking)
        if replacing.nbytes > nbytes:  # (more kept than this batch takes: the rest goes)
            booked, replacing.nbytes = replacing.nbytes, nbytes
            Reservation(replacing.account, booked - nbytes).release()
        assembly.reserve(nbytes, elements=1, replacing=replacing)

    def _book_idle(self, nbytes: int) -> Reservation | None:
        """Book a batch the consumer let go of, kept for the next one while this stage
        waits for it, if the share has room (called by the pool, in the consumer's
        thread); else None and the memory is freed."""
        if self.account.room() < nbytes:
            return None
        try:
            return self.account.admit(nbytes, elements=0)
        except MemoryBudgetError:  # (a budget shared with other pipelines)
            return None

    def _exchange(self, rows: int) -> None:
        """Move the columns still in fresh memory into batches the consumer let go of,
        where one waits: the ``rows`` rows already placed are copied, the rest of the
        fresh pages are never touched (the kernel zeroes a page only when first written)."""
        pool, pending = self._pool, self._pending
        for column in list(pending):
            assert column.out is not None
            found = pool.exchange(column.out, rows)
            if found is not None:
                column.out, booking = found  # (the fresh array goes here...)
                booking.release()  # (... then the booking of its touched pages)
                pending.remove(column)

    def _settle(self) -> None:
        """The batch is filled (or abandoned): nothing more waits for released memory."""
        self._pending.clear()
        self._pool.settle()

    def _place(self, columns: list[_Column], leaves: list[Any], row: int,
               first: int) -> ElementSpecError | None:
        """Copy one element's leaves into row ``row``; the error naming what does not fit
        the batch (its components, a shape, a dtype), which the batch raises once whole."""
        if self._pending:  # (before the row: none copied if the release came first)
            self._exchange(row)
        if len(leaves) != len(columns):
            return ElementSpecError(
                f"batch: element {self.position - 1} has {len(leaves)} components, but "
                f"element {first} of the same batch has {len(columns)}"
            )
        for column, leaf in zip(columns, leaves, strict=True):
            out = column.out
            assert out is not None
            if (
                type(leaf) is np.ndarray
                and leaf.dtype is column.dtype
                and leaf.shape == column.shape
            ):
                out[row] = leaf[()] if column.item else leaf  # the common case: same
                continue  # dtype object, same shape
            if type(leaf) is column.scalar:
                out[row] = leaf  # a NumPy scalar of the column's own type, or bytes/str
                continue
            failure = self._place_other(column, leaf, row, first)
            if failure is not None:
                return failure
        return None

    def _place_other(self, column: _Column, leaf: Any, row: int,
                     first: int) -> ElementSpecError | None:
        """:meth:`_place` of a leaf that is not an array or scalar of the column's own
        dtype and shape: checked, converted (a column widened where it must be)."""
        out = column.out
        assert out is not None
        if np.shape(leaf) != column.shape:
            return ElementSpecError(
                f"batch: element {self.position - 1} has shape {np.shape(leaf)} for "
                f"component {column.path}, but element {first} of the same batch has shape "
                f"{column.shape}; all elements of a batch need equal shapes (use "
                "padded_batch for variable sizes)"
            )
        dtype = _leaf_dtype(leaf)
        # Python scalars are "weak" (NEP 50): they take the column's dtype unless
        # their kind is wider (a float in an int column widens it, as np.stack does).
        if (
            type(leaf) in _PYTHON_SCALARS
            and not column.dtype.hasobject
            and _KIND_ORDER[dtype.kind] <= _KIND_ORDER.get(column.dtype.kind, 3)
        ):
            dtype = column.dtype
        if dtype != column.dtype and not column.dtype.hasobject:
            if dtype.kind in "OSU":
                return ElementSpecError(
                    f"batch: element {self.position - 1} has a {type(leaf).__name__} for "
                    f"component {column.path}, but element {first} of the same batch has "
                    f"{column.dtype} values"
                )
            if not np.can_cast(dtype, column.dtype, "safe"):
                out = self._promote(column, np.result_type(column.dtype, dtype), row)
        out[row] = row_item(leaf)
        return None

    def _promote(
        self, column: _Column, dtype: np.dtype[Any], rows: int
    ) -> np.ndarray[Any, Any]:
        """Widen a column (an int column meeting a float), as np.stack would: booked first."""
        assert column.out is not None
        old, assembly = column.out, self._assembly
        assert assembly is not None
        if column in self._pending:  # (its fresh memory no longer waits for a release)
            self._pending.remove(column)
            self._pool.withdraw(old)
        assembly.reserve(
            len(old) * int(np.prod(column.shape, dtype=np.int64)) * dtype.itemsize,
            what="a widened batch column",
        )
        column.out, column.dtype = np.empty(old.shape, dtype=dtype), dtype
        column.out[:rows] = old[:rows]
        assembly.shrink(old.nbytes)
        return column.out

    def _objects_cost(self, leaves: list[Any]) -> int:
        """What the objects of an element that the batch keeps a reference to cost."""
        total = 0
        for leaf in leaves:
            if type(leaf) is bytes or type(leaf) is str:
                total += sys.getsizeof(leaf)
            elif _leaf_dtype(leaf).hasobject:
                total += self.ctx.sizeof(leaf)
        return total


class ColumnarBatchIterator(_BatchIterator):
    """Batches a reader below decodes column by column where it can — the cache stage
    of ``cache(filename).batch(n)`` (:meth:`headrace._persist.cache._CacheIterator.pull_batch`),
    a saved dataset's gather (``load().batch(n)``) — assembled element by element
    otherwise (writing the cache, elements that need objects, a short last batch under
    ``drop_remainder``, origins asked for). ``fetch(count, account, whole=...)`` is the
    reader's: a batch, its booking on ``account`` and its size, or None having consumed
    nothing, or fewer than ``count`` only under ``whole=False``. Once a batch was made,
    a short last batch under ``drop_remainder`` is asked for with ``whole=False`` and
    dropped here (its records read and checked as the element route would, with no
    element made beside the batch's rows). Both routes move the same positions, so its
    checkpoints are the plain batch's."""

    def __init__(
        self, inner: Iterator, ctx: Context, account: Buffer, batch_size: int,
        drop_remainder: bool, fetch: Callable[..., tuple[Any, Reservation, int] | None],
    ) -> None:
        super().__init__(inner, ctx, account, batch_size, drop_remainder)
        self._pull_batch = fetch
        #: The input stage's profile record, where a profile counts its pulls: the
        #: elements it hands over in a batch are counted there too.
        self._record: Any = inner.__dict__.get(PROFILE_RECORD)  # (a profile's, or None)
        #: Whether a batch was made: from then on a full batch's rows are the stage's
        #: minimum, so a short last batch under drop_remainder is read column by column
        #: and dropped (before, it goes element by element, refused as they would be).
        self._made = False

    def pull(self) -> tuple[Any, Reservation]:
        if self.probe is None:
            # A batch released since an element-by-element one is not booked beside the
            # reader's batches: they take the room it was kept in.
            self._pool.clear()
            record = self._record
            started = 0.0 if record is None else time.perf_counter()
            whole = self.drop_remainder and not self._made
            found = self._pull_batch(self.batch_size, self.account, whole=whole)
            if found is not None:
                batch, booking, count = found
                self.position += count
                if record is not None:
                    record.count += count
                    record.seconds += time.perf_counter() - started
                if self.drop_remainder and count < self.batch_size:
                    booking.release()  # a short last batch, read and checked, then dropped
                    raise StopIteration
                self._made = True
                return batch, booking
        pair = super().pull()
        self._made = True
        return pair


def _columns_of(first: Any, single: bool) -> tuple[list[Any], list[_Column]]:
    """A batch's first element's leaves, and a column for each (named by its path)."""
    leaves = [first] if single else flatten(first)
    paths = ["element"] if single else structure_paths(first)
    return leaves, [_Column(leaf, path) for leaf, path in zip(leaves, paths, strict=True)]


def _packed(columns: list[_Column], count: int, structure: Any, single: bool) -> Any:
    """The batch of ``count`` rows, in its elements' structure (a short last batch is a
    view of the first rows of each column)."""
    outputs = [column.out[:count] if count < len(column.out) else column.out
               for column in columns if column.out is not None]
    return outputs[0] if single else pack_as(structure, outputs)

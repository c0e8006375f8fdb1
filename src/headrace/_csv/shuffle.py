"""``make_csv_dataset``'s shuffled path as columns: files shuffled, rows shuffled, repeated.

TensorFlow's pipeline ``files.shuffle(n).interleave(CsvDataset).shuffle(buffer_size)
.repeat(num_epochs).batch(b)`` moves one record at a time through the shuffle. Here
the block-parsed CSV source feeds a buffer of ``buffer_size`` rows held as columns
(one NumPy array per column) and each batch is drawn at once:

* **Order.** tf.data's windowed semantics: fill to ``buffer_size`` rows; each output
  row is a uniformly drawn slot, which is refilled with the next input row; when the
  input is done, the rows left come out in a uniformly random order (what drawing
  slots one by one gives). For the draws
  ``r_1..r_b`` of a batch, a slot drawn twice gives, the second time, the row that
  refilled it, and after the batch each drawn slot holds the row of its last refill:
  both come from one stable sort of the draws (no per-row Python). Every row comes
  out exactly once per epoch. The random numbers are NumPy's Philox (one per output
  row), so the order is headrace's, not TensorFlow's.
* **Epochs.** The file order is shuffled again each epoch (as ``files.shuffle`` is
  under ``repeat``), the buffer drains at each epoch's end and batches run across
  epochs' edges, as ``repeat`` before ``batch`` gives.
* **Memory (G1).** The buffer's bytes are booked on the stage's share; a buffer that
  cannot fit shrinks, with one warning, to the rows that do.
* **Resuming.** The state is the seed, the epoch and the rows drawn in it: restoring
  re-reads the epoch from its start and replays the draws (exact for the same files).

Only numeric columns take this path (the buffer's bytes are then known in advance);
``make_csv_dataset`` shuffles string columns record by record.
"""

from __future__ import annotations

import secrets
from typing import Any

import numpy as np

from headrace._csv.reader import CsvError
from headrace._csv.source import CsvCursor, CsvNode
from headrace._errors import HeadraceWarning
from headrace._memory.buffer import NO_RESERVATION, Buffer, Reservation
from headrace._memory.sizeof import ARRAY_HEADER_BYTES, sizeof
from headrace._memory.units import format_bytes
from headrace._transforms.batch import batch_iterator
from headrace._transforms.repeat import RepeatNode
from headrace._transforms.shuffle import ShuffleNode
from headrace._warn import warn_user
from headrace.core.indexing import RandomAccess, Reach, Refusal
from headrace.core.iterator import Context, Iterator
from headrace.core.node import (
    INFINITE,
    UNKNOWN,
    Node,
    ShardRole,
    Traits,
    UnaryNode,
    check_positive,
)
from headrace.core.state import EPOCH, StateReader, past_end

__all__ = ["CsvShuffleNode", "columnar_shuffle_fits"]

#: Rows pulled from the source at once while the buffer first fills.
_FILL_ROWS = 1 << 16


def columnar_shuffle_fits(node: CsvNode) -> bool:
    """Whether ``node``'s rows can be shuffled as columns (all columns numeric)."""
    return all(not column.dtype.hasobject for column in node.spec.columns)


def _key(seed: int, epoch: list[int], stream: int) -> int:
    words = np.random.SeedSequence([seed, stream, *epoch]).generate_state(2, dtype=np.uint64)
    return int(words[0]) << 64 | int(words[1])


class CsvShuffleNode(UnaryNode):
    """Internal: the records of a :class:`CsvNode`'s files, shuffled (files and rows) and
    repeated ``num_epochs`` times (None: forever); batched by the columnar path."""

    stage = "shuffle"
    budget_weight = 4  # a buffer of rows, as transforms.shuffle's
    sets_order = True

    def __init__(self, source: CsvNode, buffer_size: int, seed: int | None,
                 num_epochs: int | None) -> None:
        super().__init__(source)
        self.buffer_size = check_positive("shuffle: buffer_size", buffer_size)
        if seed is not None:
            check_positive("shuffle: seed", seed, allow_zero=True)
        if num_epochs is not None:
            check_positive("num_epochs", num_epochs, allow_zero=True)
        self.seed = seed
        self.base_seed = seed if seed is not None else secrets.randbits(63)
        self.num_epochs = num_epochs

    def params(self) -> tuple[Any, ...]:
        return (self.buffer_size, self.seed, self.num_epochs)

    def cardinality(self) -> int:
        return INFINITE if self.num_epochs is None else UNKNOWN

    def traits(self) -> Traits:
        return Traits(shuffle_buffer=self.buffer_size, unseeded=self.seed is None)

    def shard_role(self) -> ShardRole:
        return ShardRole.BY_CONTENT  # a shuffle and a repeat: any part's rows, reordered

    def element_access(self, reach: Reach) -> RandomAccess | Refusal:
        return Refusal(self)  # a row is drawn from a buffer of those before it

    def make_iterator(self, ctx: Context) -> Iterator:
        if not isinstance(self.inputs[0], CsvNode):
            return self._records().make_iterator(ctx)
        return _OneByOne(self._columns(ctx, 1, None))

    def batched_iterator(self, ctx: Context, batch_size: int, drop_remainder: bool,
                         account: Buffer) -> Iterator:
        if not isinstance(self.inputs[0], CsvNode):
            return batch_iterator(self._records(), ctx, account, batch_size, drop_remainder)
        return _ShuffledBatches(self._columns(ctx, batch_size, account), drop_remainder)

    def _records(self) -> Node:
        """The same stages record by record, over an input sharding has rewritten (a
        worker's every n-th record of a file that cannot be split by file)."""
        shuffled = ShuffleNode(self.inputs[0], self.buffer_size, self.seed, True)
        shuffled.base_seed = self.base_seed  # (the same seed in every worker)
        return shuffled if self.num_epochs == 1 else RepeatNode(shuffled, self.num_epochs)

    def _columns(self, ctx: Context, batch_size: int,
                 account: Buffer | None) -> _ShuffledColumns:
        source = self.inputs[0]
        assert isinstance(source, CsvNode)
        return _ShuffledColumns(self, source, ctx, batch_size, account)


class _ShuffledColumns:
    """The shuffled rows, ``batch_size`` at a time, as lists of column arrays."""

    def __init__(self, node: CsvShuffleNode, source: CsvNode, ctx: Context, batch_size: int,
                 out_account: Buffer | None) -> None:
        self.node, self.source, self.ctx = node, source, ctx
        self.batch_size = batch_size
        self.out_account = out_account
        self.account = ctx.account(node)
        self.block_account = ctx.account(source, f"{source.stage} (parsed block)")
        self.spec = source.spec
        self.dtypes = [column.dtype for column in self.spec.columns]
        self.row_bytes = sum(dtype.itemsize for dtype in self.dtypes)
        self.headers = ARRAY_HEADER_BYTES * len(self.dtypes)
        self.seed = ctx.seed_of(node, node.base_seed)
        self.outer = [ctx.run.iteration, *ctx.epochs]
        self.capacity = node.buffer_size
        self.warn = ctx.options.warn_on_shrink
        self.booking: Reservation = NO_RESERVATION
        self.cursor: CsvCursor | None = None
        self.container = sizeof(self.spec.pack([None] * len(self.dtypes)))
        self._start_epoch(0)

    # -- one epoch ---------------------------------------------------------------------------
    def _start_epoch(self, epoch: int) -> None:
        if self.cursor is not None:
            self.cursor.close()
        self.epoch = epoch
        self.drawn = 0
        self.epoch_rows = 0
        key = [*self.outer, epoch]
        files = list(self.source.filenames)
        order = np.random.Generator(np.random.Philox(key=_key(self.seed, key, 0))).permutation(
            len(files))
        epoch_files = self.source.with_files([files[i] for i in order])
        assert isinstance(epoch_files, CsvNode)
        self.cursor = CsvCursor(epoch_files, self.ctx, self.block_account)
        self.bits = np.random.Philox(key=_key(self.seed, key, 1))
        self.raw: np.ndarray[Any, Any] = np.empty(0, np.uint64)
        self.raw_at = 0
        self.columns: list[np.ndarray[Any, Any]] = []
        self.live = 0  # rows in the buffer
        self.slots: np.ndarray[Any, Any] | None = None  # draining: the order of the rows left
        self.slots_at = 0
        self.exhausted = False
        self.filled = False
        self.pending: list[list[np.ndarray[Any, Any]]] = []  # rows read, not yet in the buffer
        self.pending_rows = 0

    def _epochs_left(self) -> bool:
        total = self.node.num_epochs
        return total is None or self.epoch + 1 < total

    def _read(self, count: int) -> None:
        """Have ``count`` rows pending (fewer at the end of the epoch's files)."""
        cursor = self.cursor
        assert cursor is not None
        while self.pending_rows < count and not self.exhausted:
            try:
                columns, got = cursor.take(count - self.pending_rows)
            except CsvError:
                cursor.error_raised()
                self.pending = [[column.copy() for column in part] for part in self.pending]
                raise
            if not got:
                self.exhausted = True
                break
            # Views of the cursor's block, which is released when the next one is read:
            # rows that stay pending past this call are copied (here while the buffer
            # first fills, in _take_pending for a remainder).
            self.pending.append(columns if self.filled else [c.copy() for c in columns])
            self.pending_rows += got
            self.epoch_rows += got

    def _take_pending(self, count: int) -> list[np.ndarray[Any, Any]]:
        """The first ``count`` pending rows as columns."""
        if len(self.pending) == 1 and self.pending_rows == count:
            rows = self.pending[0]
            self.pending, self.pending_rows = [], 0
            return rows
        # column by column, each column's pieces let go once joined: the first fill
        # joins a whole buffer, which must not exist twice (pieces and joined) at once
        by_column = [list(parts) for parts in zip(*self.pending, strict=True)]
        self.pending = []
        taken, rest = [], []
        for index, parts in enumerate(by_column):
            by_column[index] = []
            joined = np.concatenate(parts)
            del parts
            rest.append(joined[count:].copy())
            taken.append(joined[:count])
        self.pending = [rest] if len(rest[0]) else []
        self.pending_rows -= count
        return taken

    def _book(self, rows: int) -> int:
        """Book a buffer of ``rows`` rows (fewer, with one warning, if they cannot fit)."""
        self.booking.release()
        self.booking = NO_RESERVATION
        needed = self.headers + rows * self.row_bytes
        room = self.account.room()
        if needed > room:
            fits = max((room - self.headers) // max(self.row_bytes, 1), 1)
            rows = min(rows, fits)
            self.capacity = min(self.capacity, fits)
            if self.warn:
                self.warn = False  # once per iterator
                warn_user(
                    f"shuffle: buffer_size={self.node.buffer_size} does not fit in this "
                    f"stage's share of the memory budget ({self.account.share_text()}); at "
                    f"{format_bytes(self.row_bytes)} per row it shuffles within {fits} rows. "
                    "Raise Options(memory_budget=...).", HeadraceWarning)
            needed = self.headers + rows * self.row_bytes
        self.booking = self.account.admit(needed, together=f"a shuffle buffer of {rows} rows",
                                          elements=0)
        return rows

    def _fill(self) -> None:
        """The first fill: up to ``capacity`` rows, booked as they come (a buffer that
        cannot fit stops growing where the share ends)."""
        while self.pending_rows < self.capacity and not self.exhausted:
            self._read(min(self.capacity, self.pending_rows + _FILL_ROWS))
            self._book(min(self.pending_rows, self.capacity))  # may lower the capacity
        rows = min(self.pending_rows, self.capacity)
        # (pending rows are copies while filling; a slice of joined ones is copied out)
        self.columns = [column if column.base is None else column.copy()
                        for column in self._take_pending(rows)] if rows else []
        self.live = rows
        self.filled = True

    def _raw(self, count: int) -> np.ndarray[Any, Any]:
        """The next ``count`` 64-bit draws (one per output row), made a block at a time."""
        if len(self.raw) - self.raw_at < count:
            block = self.bits.random_raw(max(count, _FILL_ROWS))
            self.raw = np.concatenate([self.raw[self.raw_at:], block])
            self.raw_at = 0
        values = self.raw[self.raw_at:self.raw_at + count]
        self.raw_at += count
        return values  # type: ignore[no-any-return]

    def _draw(self, count: int) -> list[np.ndarray[Any, Any]] | None:
        """Up to ``count`` rows of this epoch (None when it has none left)."""
        if not self.filled:
            self._fill()
        if not self.exhausted and self.slots is None:
            self._read(count)
        steady = min(count, self.pending_rows) if self.slots is None else 0
        parts: list[list[np.ndarray[Any, Any]]] = []
        if steady:
            parts.append(self._steady(steady))
        if steady < count and self.exhausted and self.pending_rows == 0 and self.live:
            parts.append(self._drain(count - steady))
        if not parts:
            return None
        if len(parts) == 1:
            return parts[0]
        return [np.concatenate(pair) for pair in zip(*parts, strict=True)]

    def _steady(self, count: int) -> list[np.ndarray[Any, Any]]:
        """``count`` draws from a full buffer, each drawn slot refilled with the next row."""
        incoming = self._take_pending(count)
        # a slot from the draw's high 32 bits times the slots, shifted (no division)
        draws = ((self._raw(count) >> np.uint64(32)) * np.uint64(self.live)
                 >> np.uint64(32)).astype(np.intp)
        out = _draw_batch(self.columns, incoming, draws)
        self.drawn += count
        return out

    def _drain(self, count: int) -> list[np.ndarray[Any, Any]]:
        """Draws once the input is done: the rows left, in a uniformly random order.

        Drawing a live slot uniformly and filling it from the last live one, until
        none is left, gives every order of the rows left with the same chance: that
        order is made at once (one draw per row, as each row would take).
        """
        if self.slots is None:
            self.slots = np.argsort(self._raw(self.live), kind="stable")
            self.slots_at = 0
        count = min(count, self.live)
        taken = self.slots[self.slots_at:self.slots_at + count]
        self.slots_at += count
        self.live -= count
        self.drawn += count
        return [buffer[taken] for buffer in self.columns]

    # -- batches -----------------------------------------------------------------------------
    def next_columns(self) -> list[np.ndarray[Any, Any]] | None:
        """The next ``batch_size`` rows (fewer at the very end; None after it)."""
        parts: list[list[np.ndarray[Any, Any]]] = []
        rows = 0
        while rows < self.batch_size:
            part = self._draw(self.batch_size - rows)
            if part is None:
                if not self._epochs_left() or self.epoch_rows == 0:
                    break  # an epoch with no rows ends a forever repeat, as tf.data's
                self._start_epoch(self.epoch + 1)
                continue
            parts.append(part)
            rows += len(part[0])
        if not parts:
            self.booking.release()  # the last epoch is done: the buffer is empty
            self.booking = NO_RESERVATION
            self.columns = []
            return None
        if len(parts) == 1:
            return parts[0]
        return [np.concatenate(group) for group in zip(*parts, strict=True)]

    def cost(self, rows: int) -> int:
        return self.container + self.headers + rows * self.row_bytes

    def get_state(self) -> dict[str, Any]:
        return {"seed": self.seed, EPOCH: [*self.outer, self.epoch], "drawn": self.drawn,
                "capacity": self.capacity}

    def set_state(self, state: dict[str, Any]) -> None:
        node, reader = self.node, StateReader(state, "shuffle")
        seed = reader.integer("seed")
        if node.seed is not None and seed != node.seed:
            raise reader.error("seed", f"= {seed}, but this shuffle has seed={node.seed}")
        epoch = reader.integers(EPOCH)
        self.outer = [self.ctx.run.iteration, *self.ctx.epochs]  # (a restored run's)
        if epoch[:-1] != self.outer:
            raise reader.error(EPOCH, f"= {epoch}, but this iterator is at {self.outer} (its "
                                      "iteration and the epoch of each enclosing repeat)")
        total = node.num_epochs
        if total is not None and epoch[-1] >= max(total, 1):
            raise reader.error(EPOCH, f"= {epoch}, but num_epochs={total}")
        drawn = reader.integer("drawn")
        capacity = reader.integer("capacity", 1, node.buffer_size, why="the buffer_size")
        if node.seed is None:
            self.ctx.restore_seed(node, seed)
        self.seed, self.capacity = seed, capacity
        self._start_epoch(epoch[-1])
        done = 0
        while done < drawn:  # replay: re-read the epoch up to the checkpoint
            try:
                part = self._draw(min(drawn - done, _FILL_ROWS))
            except CsvError:
                continue  # raised to the user before the checkpoint
            if part is None:
                raise past_end("shuffle", "drawn", drawn, done)
            done += len(part[0])

    def close(self) -> None:
        self.booking.release()
        self.booking = NO_RESERVATION
        self.columns = []
        self.pending = []
        if self.cursor is not None:
            self.cursor.close()


class _OverRows(Iterator):
    """An iterator over the shuffled rows: their state and closing are the rows'."""

    def __init__(self, rows: _ShuffledColumns) -> None:
        super().__init__()
        self.rows = rows

    def get_state(self) -> dict[str, Any]:
        return self.rows.get_state()

    def set_state(self, state: dict[str, Any]) -> None:
        self.rows.set_state(state)

    def close(self) -> None:
        self.rows.close()


class _ShuffledBatches(_OverRows):
    """Batches of the shuffled rows (tuples of columns), booked on the batch's share."""

    stage = "batch"

    def __init__(self, rows: _ShuffledColumns, drop_remainder: bool) -> None:
        super().__init__(rows)
        self.drop_remainder = drop_remainder
        self.what = f"one batch of {rows.batch_size} CSV records"

    def pull(self) -> tuple[Any, Reservation]:
        rows = self.rows
        columns = rows.next_columns()
        if columns is None or (self.drop_remainder and len(columns[0]) < rows.batch_size):
            raise StopIteration
        assert rows.out_account is not None
        booking = rows.out_account.admit(rows.cost(len(columns[0])), together=self.what)
        return rows.spec.pack(columns), booking


class _OneByOne(_OverRows):
    """The shuffled rows one at a time (the node outside a batch)."""

    stage = "shuffle"

    def pull(self) -> tuple[Any, Reservation]:
        columns = self.rows.next_columns()
        if columns is None:
            raise StopIteration
        return self.rows.spec.pack([column[0] for column in columns]), NO_RESERVATION


def _draw_batch(buffers: list[np.ndarray[Any, Any]], incoming: list[np.ndarray[Any, Any]],
                draws: np.ndarray[Any, Any]) -> list[np.ndarray[Any, Any]]:
    """Internal: the rows of slots ``draws`` (one per incoming row) as columns, each
    drawn slot then refilled with its incoming row, all in ``buffers`` at once: what
    drawing and refilling one row at a time gives."""
    count = len(draws)
    # Sorted by (slot, position): a slot drawn more than once in the batch is a run,
    # and each draw of it after the first gives the row the one before refilled it
    # with (an unstable sort of unique keys: stable argsort costs 3x as much).
    keys = np.sort(draws * count + np.arange(count))
    slots = keys // count
    positions = keys - slots * count
    again = slots[1:] == slots[:-1]
    out = []
    if not again.any():
        for buffer, new in zip(buffers, incoming, strict=True):
            out.append(buffer[draws])
            buffer[draws] = new
        return out
    earlier, refill_of = positions[1:][again], positions[:-1][again]
    ends = again.copy()  # the last draw of each repeated slot: what the slot keeps
    ends[:-1] &= ~again[1:]
    end_slots, end_rows = slots[1:][ends], positions[1:][ends]
    for buffer, new in zip(buffers, incoming, strict=True):
        column = buffer[draws]
        column[earlier] = new[refill_of]
        buffer[draws] = new
        buffer[end_slots] = new[end_rows]
        out.append(column)
    return out

"""One reader process feeding several trainer processes on one host.

Why: k training processes (one per GPU) that each build the input pipeline
each open every shard (k times the descriptors, seed 003), read and parse
everything k times, and each hold a budget of their own. Here one *producer*
process owns the files and the pipeline; each *consumer* connects with its
index and receives its own disjoint, deterministic part of the stream.

Parts. Consumer ``i`` of ``k`` gets ``dataset.shard(k, i)``: every k-th element
of the stream from the i-th on, in the stream's order, so the parts are
disjoint, their union is the stream, and which elements a consumer sees never
depends on timing or on the other consumers. Each part's iterator reads and
parses the whole stream to keep its k-th of it; with ``shard_policy="file"``
consumer ``i`` gets ``auto_shard(dataset, "file", num_shards=k, index=i)``
instead: the pipeline's file list split round-robin, so each part reads only
its own files and the producer reads everything once, not k times (the parts
are still disjoint and deterministic; their union is the stream's elements, in
another order). The producer runs one iterator
per connected consumer, all under **one** memory budget, split in ``k + 1``
equal parts: one for each consumer's run (a child budget of the producer's,
whose stages' shares add up to its part) and one for the segments, so that
together they never exceed it (a consumer's pipeline must fit its part) and **one**
descriptor cap (``Options(max_open_files=...)`` of the dataset, or
``max_open_files=``, shared by every consumer's readers).

Transport. A Unix socket (``multiprocessing.connection`` with an authkey: a
process without the key is refused) carries small messages; each element's
arrays travel in shared-memory segments of a per-consumer pool
(:mod:`headrace.workers.shm`), which the consumer maps once and reports free
again when the last array viewing it is gone — the payloads are copied once,
into the segment, whatever their size. Every segment is booked on the shared
budget (account ``served segments``) from its creation until its consumer's
connection ends: what consumers hold counts against the producer's budget, so
its readers slow down rather than overrun it; a consumer that keeps more than
the budget gets its elements all the same, booked as an overdraft (its memory
exists either way), never a hang.

Independence. A consumer is served by a thread of its own that pulls only when
that consumer asks for its next element, so a slow, stopped or dead consumer
never stalls the others. A consumer that exits or dies (SIGKILL included) is
noticed as the end of its connection: its iterator is closed, its files and
segments released. A consumer whose producer dies gets :class:`ProducerError`
at once (its connection ends), never a hang.

Checkpoints. :meth:`ServedIterator.get_state` returns the consumer's own
position (the state of its part's iterator in the producer, wrapped with ``k``
and ``i``); a consumer that connects again, to this producer or a new one
over the same recipe, resumes exactly there with :meth:`ServedIterator.set_state`
(or ``connect(..., state=...)``).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import pickle
import socket
import stat
import threading
import time
import traceback
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

from headrace._closing import ClosesOnExit
from headrace.core.run import DatasetIterator, default_budget
from headrace.core.state import StateReader
from headrace.dataset import Dataset
from headrace.distribute import AutoShardPolicy, auto_shard
from headrace.errors import CheckpointError, InvalidArgumentError, IteratorClosedError, WorkerError
from headrace.io.filepool import FileLimiter, get_default_pool
from headrace.memory.budget import MemoryBudget, Reservation
from headrace.workers.shm import SegmentMaps, SegmentPool, pack, sweep_stale

__all__ = ["ProducerError", "ServedIterator", "Server", "connect", "serve"]

_PROTOCOL = 1
_STATE_FORMAT = "headrace.served"


class ProducerError(WorkerError):
    """The producer a consumer reads from died, closed, or refused the consumer."""


def _wake_socket(address: str) -> None:
    """Connect and hang up at once: wakes a listener blocked in ``accept``."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as probe:
        probe.settimeout(1.0)
        probe.connect(address)


def _hang_up(conn: Connection) -> None:
    """End a connection a thread is blocked reading from (closing the fd does not wake it)."""
    with contextlib.suppress(OSError):
        sock = socket.socket(fileno=os.dup(conn.fileno()))
        with sock:
            sock.shutdown(socket.SHUT_RDWR)


def _remove_stale_socket(address: str) -> None:
    """Unlink ``address`` if it is a socket nobody listens on (its producer died)."""
    try:
        if not stat.S_ISSOCK(os.stat(address).st_mode):
            return
    except OSError:
        return
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(address)
        except ConnectionRefusedError:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(address)
        except OSError:
            return


class Server(ClosesOnExit):
    """The producer side: serves ``consumers`` disjoint parts of one dataset (see the module).

    Made by :func:`serve`; listening from then on, on threads of its own, until
    :meth:`close` (or the end of a ``with`` block). At most one connection per
    consumer index at a time; an index may connect again after its last
    connection ended (a restarted trainer, or a new epoch).
    """

    def __init__(
        self,
        dataset: Dataset,
        consumers: int,
        address: str,
        *,
        authkey: bytes | None = None,
        max_open_files: int | None = None,
        shard_policy: AutoShardPolicy | str = AutoShardPolicy.DATA,
    ) -> None:
        if not isinstance(dataset, Dataset):
            raise InvalidArgumentError(f"serve needs a headrace Dataset, got {type(dataset).__name__}")
        if isinstance(consumers, bool) or not isinstance(consumers, int) or consumers < 1:
            raise InvalidArgumentError(f"serve: consumers must be an integer >= 1, got {consumers!r}")
        self.address = os.fspath(address)
        self.consumers = consumers
        try:
            by_file = AutoShardPolicy(
                shard_policy.lower() if isinstance(shard_policy, str) else shard_policy
            ) is AutoShardPolicy.FILE
        except ValueError:
            raise InvalidArgumentError(
                f"serve: shard_policy must be 'data' or 'file', got {shard_policy!r}"
            ) from None
        self._parts = [
            auto_shard(dataset, AutoShardPolicy.FILE, num_shards=consumers, index=index)
            if by_file and consumers > 1 else dataset.shard(consumers, index)
            for index in range(consumers)
        ]
        self._fingerprints = [part.fingerprint() for part in self._parts]
        options = dataset.options
        explicit = options.budget_bytes
        #: One budget for every consumer's run: each run's budget is a child of it.
        self.budget = MemoryBudget(explicit if explicit is not None else default_budget().total)
        cap = max_open_files if max_open_files is not None else options.max_open_files
        #: One descriptor cap for every consumer's readers (None: the process-wide pool's).
        self.file_limiter: FileLimiter | None = (
            None if cap is None else get_default_pool().limiter(cap)
        )
        #: The budget is split in ``consumers + 1`` equal parts: one for each consumer's
        #: run (its stages' shares add up to it), one for the segments. Each run drawing
        #: on the whole budget let k runs plus the segments book up to (k + 1) times it
        #: (27 MB booked under 16 MiB for 3 consumers: the served fuzz case).
        self.part = self.budget.total // (consumers + 1)
        #: The shared-memory segments each consumer's elements travel in, booked on the
        #: same budget from creation until dropped (G1): what consumers hold counts; past
        #: their part, as an overdraft (a consumer that keeps what it got).
        self.segments = self.budget.account("served segments", weight=1.0)
        self.budget.allot()
        self.segments.limit = self.budget.total - consumers * self.part
        self._lock = threading.Lock()
        self._connections: dict[int, Connection] = {}
        self._threads: list[threading.Thread] = []
        self._served: dict[int, int] = dict.fromkeys(range(consumers), 0)  # runs finished
        self._runs: dict[int, DatasetIterator] = {}  # the connected consumers' runs
        self._closed = False
        sweep_stale()
        _remove_stale_socket(self.address)
        try:
            self._listener = Listener(self.address, "AF_UNIX", authkey=authkey)
        except OSError as error:
            raise InvalidArgumentError(f"serve: cannot listen on {self.address!r}: {error}") from error
        self._acceptor = threading.Thread(
            target=self._accept_loop, name=f"headrace-serve-{self.address}", daemon=True
        )
        self._acceptor.start()

    # -- public ------------------------------------------------------------------------
    @property
    def connected(self) -> list[int]:
        """The consumer indices connected now."""
        with self._lock:
            return sorted(self._connections)

    def finished(self, index: int) -> int:
        """How many times consumer ``index`` has read its part to the end."""
        with self._lock:
            return self._served[index]

    def booked(self) -> dict[int, int]:
        """Bytes each connected consumer's run books now on the shared budget (its
        buffers; the segments its elements travel in are the ``segments`` account's)."""
        with self._lock:
            runs = dict(self._runs)
        return {index: run.context.budget.used for index, run in runs.items()}

    def overdrawn(self) -> int:
        """Bytes booked past their stages' shares now, as counted overdrafts: segments a
        hoarding consumer keeps, outputs of parallel calls that outgrew their estimate."""
        with self._lock:
            runs = list(self._runs.values())
        accounts = [self.segments] + [a for run in runs for a in run.context.budget.accounts]
        return sum(account.overdrawn for account in accounts)

    def close(self) -> None:
        """Stop listening, end every connection, close every consumer's run. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            connections = list(self._connections.values())
        _wake_socket(self.address)
        for conn in connections:
            _hang_up(conn)
        self._acceptor.join(timeout=5)
        for thread in list(self._threads):
            thread.join(timeout=5)
        with contextlib.suppress(OSError):
            self._listener.close()


    # -- serving -----------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while True:
            try:
                conn = self._listener.accept()
            except Exception:  # a failed handshake (wrong key, the wake-up probe)
                if self._closed:
                    return
                continue
            if self._closed:
                conn.close()
                return
            thread = threading.Thread(target=self._serve_one, args=(conn,), daemon=True)
            with self._lock:
                self._threads = [t for t in self._threads if t.is_alive()]
                self._threads.append(thread)
            thread.start()

    def _hello(self, conn: Connection) -> int | None:
        """Check the consumer's greeting; its index, or None (refused, told why)."""
        message = conn.recv()
        if not (isinstance(message, tuple) and len(message) == 3 and message[0] == "hello"):
            conn.send(("refused", "not a headrace consumer greeting"))
            return None
        _, protocol, index = message
        if protocol != _PROTOCOL:
            conn.send(("refused", f"protocol {protocol!r}, this producer speaks {_PROTOCOL}"))
            return None
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < self.consumers:
            conn.send(("refused", f"consumer index {index!r} is not in 0..{self.consumers - 1}"))
            return None
        with self._lock:
            if self._closed:
                conn.send(("refused", "the producer is closing"))
                return None
            if index in self._connections:
                conn.send(("refused", f"consumer {index} is already connected"))
                return None
            self._connections[index] = conn
        conn.send(("ok", self.consumers, os.getpid()))
        return index

    def _serve_one(self, conn: Connection) -> None:
        index: int | None = None
        run: DatasetIterator | None = None
        pool = SegmentPool(os.getpid(), tag="serve")
        booked: list[Reservation] = []

        def allocate(nbytes: int) -> tuple[int, str, int, mmap.mmap]:
            key, name, capacity, mapping = pool.allocate(nbytes)
            if name:  # a new segment: it exists (in both processes) until the pool closes
                booked.append(self.segments.overdraw(capacity))
            return key, name, capacity, mapping

        try:
            index = self._hello(conn)
            if index is None:
                return
            part = self._parts[index]
            run = DatasetIterator(
                part.node, part.options, shared_budget=self.budget, shared_part=self.part,
                file_limiter=self.file_limiter,
            )
            with self._lock:
                self._runs[index] = run
            while True:
                request = conn.recv()
                kind = request[0]
                if kind == "next":
                    for key in request[1]:
                        pool.free(key)
                    try:
                        element = next(run)
                    except StopIteration:
                        with self._lock:
                            self._served[index] += 1
                        conn.send(("end",))
                        continue
                    except Exception as error:  # the pipeline's error: the consumer's too
                        conn.send(("error", _portable(error)))
                        continue
                    conn.send(("element", pack(element, allocate)))
                elif kind == "get_state":
                    try:  # a refused checkpoint (CheckpointError) is the consumer's to see
                        state = run.get_state()
                    except Exception as error:
                        conn.send(("error", _portable(error)))
                        continue
                    conn.send(("state", state))
                elif kind == "set_state":
                    try:
                        run.set_state(request[1])
                    except Exception as error:
                        conn.send(("error", _portable(error)))
                        continue
                    conn.send(("ok",))
                elif kind == "close":
                    return
        except (EOFError, OSError):
            return  # the consumer went away (exited, died, or we hung up on close)
        finally:
            if run is not None:
                with self._lock:
                    if index is not None and self._runs.get(index) is run:
                        del self._runs[index]
                run.close()
            pool.close()
            for reservation in booked:
                reservation.release()
            with self._lock:
                if index is not None and self._connections.get(index) is conn:
                    del self._connections[index]
            with contextlib.suppress(OSError):
                conn.close()


def _portable(error: BaseException) -> BaseException:
    """``error`` if it pickles, else a WorkerError with its text and traceback."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        return WorkerError(f"the producer's pipeline raised {type(error).__name__}: {error}\n{text}")
    return error


def serve(
    dataset: Dataset,
    consumers: int,
    address: str | os.PathLike[str],
    *,
    authkey: bytes | None = None,
    max_open_files: int | None = None,
    shard_policy: AutoShardPolicy | str = AutoShardPolicy.DATA,
) -> Server:
    """Serve ``dataset`` to ``consumers`` processes on this host; returns the :class:`Server`.

    Consumer ``i`` (see :func:`connect`) gets ``dataset.shard(consumers, i)``, or with
    ``shard_policy="file"`` its round-robin part of the pipeline's files (each file
    read once for all consumers; see :func:`headrace.auto_shard` and the module doc).
    ``address`` is the path of the Unix socket to listen on (a stale socket left
    by a dead producer is replaced). ``authkey``: the shared secret consumers
    must present; by default this process's ``multiprocessing`` authkey, which
    processes started by ``multiprocessing`` inherit — give one explicitly for
    trainers launched otherwise (torchrun). ``max_open_files``: the cap on
    descriptors all consumers' readers share (default: the dataset's
    ``Options(max_open_files=...)``). Use as a context manager, or call
    :meth:`Server.close`.
    """
    return Server(dataset, consumers, os.fspath(address), authkey=authkey,
                  max_open_files=max_open_files, shard_policy=shard_policy)


class ServedIterator(ClosesOnExit):
    """A consumer's iterator over its part of a served dataset (from :func:`connect`)."""

    def __init__(self, conn: Connection, address: str, index: int, consumers: int, producer: int) -> None:
        self._conn = conn
        self.address = address
        #: This consumer's index, the number of consumers, the producer's process id.
        self.index, self.consumers, self.producer_pid = index, consumers, producer
        self._maps = SegmentMaps()
        self._closed = False
        self._ended = False

    def __iter__(self) -> ServedIterator:
        return self

    def _ask(self, request: tuple[Any, ...], doing: str) -> tuple[Any, ...]:
        try:
            self._conn.send(request)
            reply: tuple[Any, ...] = self._conn.recv()
        except (EOFError, OSError) as error:
            self._closed = True
            raise ProducerError(
                f"the producer (pid {self.producer_pid}) serving {self.address!r} is gone "
                f"(it died or was closed) while consumer {self.index} of {self.consumers} "
                f"was {doing}"
            ) from error
        if reply[0] == "error":
            raise reply[1]
        return reply

    def __next__(self) -> Any:
        self._check_open()
        if self._ended:
            raise StopIteration
        freed = self._maps.released()  # kept mapped: the producer reuses them by key
        reply = self._ask(("next", freed), "waiting for its next element")
        if reply[0] == "end":
            self._ended = True
            raise StopIteration
        return self._maps.unpack(reply[1])

    def get_state(self) -> dict[str, Any]:
        """This consumer's position: resume it with :meth:`set_state` after a new ``connect``."""
        self._check_open()
        reply = self._ask(("get_state",), "saving its state")
        return {
            "format": _STATE_FORMAT,
            "consumers": self.consumers,
            "index": self.index,
            "state": reply[1],
        }

    def set_state(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`get_state` of the same consumer index of the same recipe.

        Raises :class:`CheckpointError` for a state of another index, another
        number of consumers, or another pipeline.
        """
        self._check_open()
        if not isinstance(state, dict) or state.get("format") != _STATE_FORMAT:
            raise CheckpointError("not a served consumer's state (missing 'format' marker)")
        reader = StateReader(state, "served consumer")
        consumers, index = reader.integer("consumers"), reader.integer("index")
        if (consumers, index) != (self.consumers, self.index):
            raise CheckpointError(
                f"the state is consumer {index} of {consumers}'s; this is consumer "
                f"{self.index} of {self.consumers}: restoring it would feed another part"
            )
        inner = reader.child("state")
        self._ask(("set_state", inner), "restoring its state")
        self._ended = False

    def close(self) -> None:
        """Hang up: the producer closes this consumer's run. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError, EOFError):
            self._conn.send(("close",))
        with contextlib.suppress(OSError):
            self._conn.close()
        self._maps.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise IteratorClosedError(f"consumer {self.index}'s connection to {self.address!r} is closed")



def _dial(path: str, authkey: bytes | None, deadline: float, timeout: float) -> Connection:
    """A connection to the listener at ``path``, waiting until ``deadline`` for it to listen."""
    while True:
        try:
            return Client(path, "AF_UNIX", authkey=authkey)
        except (FileNotFoundError, ConnectionRefusedError) as error:
            if time.monotonic() >= deadline:
                raise ProducerError(
                    f"no headrace producer listens on {path!r} (waited {timeout:g} s)"
                ) from error
            time.sleep(0.05)
        except Exception as error:  # AuthenticationError, a reset during the handshake
            raise ProducerError(
                f"the producer at {path!r} refused the connection: {error}"
            ) from error


def connect(
    address: str | os.PathLike[str],
    index: int,
    *,
    authkey: bytes | None = None,
    state: dict[str, Any] | None = None,
    timeout: float = 30.0,
) -> ServedIterator:
    """Connect to the producer at ``address`` as consumer ``index``: an iterator of its part.

    Waits up to ``timeout`` seconds for the producer to listen (trainers and the
    producer may start in any order). ``state``: resume from this consumer's
    :meth:`ServedIterator.get_state`. Raises :class:`ProducerError` when no
    producer answers in time, the key is wrong, or the producer refuses the
    index (out of range, or already connected).
    """
    path = os.fspath(address)
    deadline = time.monotonic() + timeout
    while True:
        conn = _dial(path, authkey, deadline, timeout)
        try:
            conn.send(("hello", _PROTOCOL, index))
            reply = conn.recv()
        except (EOFError, OSError) as error:
            conn.close()
            raise ProducerError(f"the producer at {path!r} hung up during the greeting") from error
        if reply[0] == "ok":
            break
        conn.close()
        # The index's previous connection may be ending (a trainer restarted at once):
        # the producer notices a dead consumer within moments, so wait for it.
        if "already connected" not in reply[1] or time.monotonic() >= deadline:
            raise ProducerError(f"the producer at {path!r} refused consumer {index!r}: {reply[1]}")
        time.sleep(0.05)
    served = ServedIterator(conn, path, index, reply[1], reply[2])
    if state is not None:
        try:
            served.set_state(state)
        except BaseException:
            served.close()
            raise
    return served

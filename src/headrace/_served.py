"""One reader process feeding several trainer processes on one host.

Why: k training processes (one per GPU) that each build the input pipeline each
open every shard, so they hold k times the descriptors. They read and parse
everything k times, and each holds a budget of its own. Here one *producer*
process owns the files and the pipeline. Each *consumer* connects with its index
and receives its own disjoint, deterministic part of the stream.

Parts. Consumer ``i`` of ``k`` gets ``dataset.shard(k, i)``: every k-th element
of the stream from the i-th on, in the stream's order. So the parts are
disjoint and their union is the stream. Which elements a consumer sees never
depends on timing or on the other consumers. Each part's iterator reads and
parses the whole stream to keep its k-th of it. With ``shard_policy="file"``,
consumer ``i`` gets ``auto_shard(dataset, "file", num_shards=k, index=i)``
instead: the pipeline's file list split round-robin. Then each part reads only
its own files, and the producer reads everything once, not k times. The parts
are still disjoint and deterministic; their union is the stream's elements, in
another order.

One budget, one cap. The producer runs one iterator per connected consumer, all
under **one** memory budget. The budget is split in ``k + 1`` equal parts: one
for each consumer's run (a child budget, whose stages' shares add up to its
part) and one for the segments. So together they never exceed it, and a
consumer's pipeline must fit its part. They also share **one** descriptor cap:
``Options(max_open_files=...)`` of the dataset, or ``max_open_files=``.

Transport. A Unix socket carries small messages. Each element's arrays travel
in shared-memory segments of a per-consumer pool (:mod:`headrace._workers.shm`).
The consumer maps each segment once, and reports it free again when the last
array viewing it is gone. So the payloads are copied once, into the segment,
whatever their size. Every segment is booked on the shared budget (account
``served segments``) from its creation until its consumer's connection ends.
What consumers hold thus counts against the producer's budget, and its readers
slow down rather than overrun it. A consumer that keeps more than the budget
still gets its elements, booked as an overdraft (its memory exists either way),
never a hang.

Trust. A consumer is served only once both sides proved they hold the
producer's key: an HMAC-SHA256 challenge each way. Nothing else is read from a
peer before, and each frame's length is capped before anything is allocated.
Without ``authkey=`` the producer makes a random key. It writes the key to a
file only its user can read, beside the socket:

- the socket lives in a directory of its own (mode 0700, named
  ``.<name>.<random>`` beside ``address``);
- the socket is 0600, and so is the key file;
- ``address`` is a symbolic link to the socket, so :func:`connect` finds the
  key by itself.

Other users can neither connect nor read the key. Nothing is ever unpickled, on
either side. Messages are JSON; an element's arrays are raw buffers, described
by a dtype and shape that are checked (:mod:`headrace._wire` lists the leaves an
element may have). States are JSON. Errors travel as their class name (a
builtin or headrace error, else a :class:`~headrace._errors.WorkerError`) and
text. So even a peer holding the key cannot make the producer or a consumer run
code. Each connection's handshake runs on a thread of its own, with a deadline
(``handshake_timeout``), so a silent or hostile client never delays another.
``connect(timeout=...)`` bounds everything up to its return (the socket
appearing, the handshake, the greeting), and then the wait for the consumer's
first element. The key authenticates peers; it does not encrypt (the socket
never leaves the host).

Independence. Each consumer is served by a thread of its own, which pulls only
when that consumer asks for its next element. So a slow, stopped or dead
consumer never stalls the others. A consumer that exits or dies (SIGKILL
included) is noticed as the end of its connection: its iterator is closed, its
files and segments released. A consumer whose producer dies gets
:class:`ProducerError` at once (its connection ends), never a hang.

Checkpoints. :meth:`ServedIterator.get_state` returns the consumer's own
position: the state of its part's iterator in the producer, wrapped with ``k``
and ``i``. A consumer that connects again resumes exactly there, with
:meth:`ServedIterator.set_state` or ``connect(..., state=...)``. It may connect
to this producer or to a new one over the same recipe.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import stat
import tempfile
import threading
import time
from typing import Any

import headrace._wire as _wire
from headrace._closing import ClosesOnExit
from headrace._dataset import Dataset
from headrace._distribute import AutoShardPolicy, auto_shard
from headrace._errors import CheckpointError, InvalidArgumentError, IteratorClosedError, WorkerError
from headrace._memory.budget import MemoryBudget
from headrace._memory.buffer import Reservation
from headrace._workers.shm import Segment, SegmentMaps, SegmentPool, sweep_stale
from headrace.core.run import DatasetIterator, default_budget
from headrace.core.state import StateReader
from headrace.io.filepool import FileLimiter, get_default_pool

__all__ = ["ProducerError", "ServedIterator", "Server", "connect", "serve"]

_PROTOCOL = 2
_STATE_FORMAT = "headrace._served"
#: The key file in the socket's private directory (when the producer made the key).
KEY_FILE = "key"
_SOCKET_FILE = "socket"
_KEY_BYTES = 32
#: The most bytes one message from a consumer may hold (a state is small JSON).
_CONSUMER_FRAME = 16 << 20
#: Connections whose handshake is under way at once; more are hung up on at once (a
#: consumer hung up on before the challenge tries again, within its timeout).
_MAX_PENDING = 256


class ProducerError(WorkerError):
    """The producer a consumer reads from died, closed, or refused the consumer."""


def _hang_up(sock: socket.socket) -> None:
    """End a connection a thread may be blocked reading from (closing does not wake it)."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def _owner_only(st: os.stat_result) -> bool:
    return st.st_uid == os.geteuid() and not st.st_mode & 0o077


def _private_dir(address: str) -> str | None:
    """The directory of the socket ``address`` links to, if it is one a producer of this
    user made (a 0700 directory of ours); None otherwise."""
    try:
        if not stat.S_ISLNK(os.lstat(address).st_mode):
            return None
        directory = os.path.dirname(os.path.realpath(address))
        st = os.lstat(directory)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or not _owner_only(st):
        return None
    return directory


def _listening(path: str) -> bool:
    with socket.socket(socket.AF_UNIX) as probe:
        probe.settimeout(1.0)
        try:
            _connect(probe, path)
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except OSError:
            return True
    return True


def _remove_stale(address: str) -> None:
    """Remove what a dead producer left at ``address`` (its link, socket, key, directory;
    or a plain socket of an older version): only things of this user nobody listens on."""
    try:
        st = os.lstat(address)
    except OSError:
        return
    if st.st_uid != os.geteuid() or _listening(address):
        return
    if stat.S_ISLNK(st.st_mode):
        directory = _private_dir(address)
        if directory is not None:
            _remove_private(directory)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(address)
    elif stat.S_ISSOCK(st.st_mode):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(address)


def _remove_private(directory: str) -> None:
    for name in (_SOCKET_FILE, KEY_FILE):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, name))
    with contextlib.suppress(OSError):
        os.rmdir(directory)


def _bind(sock: socket.socket, directory: str) -> None:
    """Bind ``sock`` to ``directory``/socket, through ``/proc/self/fd`` when that path is
    longer than a socket address may be (108 bytes)."""
    path = os.path.join(directory, _SOCKET_FILE)
    if len(os.fsencode(path)) < 100:
        sock.bind(path)
        return
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        sock.bind(f"/proc/self/fd/{fd}/{_SOCKET_FILE}")
    finally:
        os.close(fd)


def _listen(address: str, key: bytes, write_key: bool) -> tuple[socket.socket, str]:
    """A listening socket for ``address``: bound owner-only (0600) in a new directory of
    its own (0700) beside it, with the key file (0600) when ``write_key``, and
    ``address`` a link to it. Returns the socket and the directory."""
    _remove_stale(address)
    if os.path.lexists(address):
        raise InvalidArgumentError(
            f"serve: {address!r} exists and is not a dead producer's socket of this user "
            "(another producer listens there, or it is some other file)")
    parent, name = os.path.split(os.path.abspath(address))
    directory = tempfile.mkdtemp(prefix=f".{name[:40]}.", dir=parent)  # 0700, a new name
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        os.chmod(directory, 0o700)
        _bind(sock, directory)
        os.chmod(os.path.join(directory, _SOCKET_FILE), 0o600)
        sock.listen(128)
        if write_key:
            fd = os.open(os.path.join(directory, KEY_FILE),
                         os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with open(fd, "wb") as sink:
                sink.write(key)
        os.symlink(os.path.join(os.path.basename(directory), _SOCKET_FILE), address)
    except BaseException:
        sock.close()
        _remove_private(directory)
        raise
    return sock, directory


def _read_key(address: str) -> bytes | None:
    """The key a producer wrote beside the socket ``address`` links to, when the file and
    its directory are this user's alone; None when there is no such key file."""
    directory = _private_dir(address)
    if directory is None:
        return None
    try:
        fd = os.open(os.path.join(directory, KEY_FILE), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with open(fd, "rb") as source:
        st = os.fstat(source.fileno())
        if not stat.S_ISREG(st.st_mode) or not _owner_only(st) or st.st_size != _KEY_BYTES:
            return None
        return source.read(_KEY_BYTES + 1)


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
        handshake_timeout: float = 10.0,
    ) -> None:
        if not isinstance(dataset, Dataset):
            raise InvalidArgumentError(f"serve needs a headrace Dataset, got {type(dataset).__name__}")
        if isinstance(consumers, bool) or not isinstance(consumers, int) or consumers < 1:
            raise InvalidArgumentError(f"serve: consumers must be an integer >= 1, got {consumers!r}")
        if authkey is not None and (not isinstance(authkey, bytes) or not authkey):
            raise InvalidArgumentError("serve: authkey must be non-empty bytes (or None: a "
                                       "random key, written beside the socket)")
        if not handshake_timeout > 0:
            raise InvalidArgumentError(
                f"serve: handshake_timeout must be > 0 seconds, got {handshake_timeout!r}")
        self.address = os.fspath(address)
        self.consumers = consumers
        #: The key consumers must prove they hold: ``authkey``, or a random one (in the
        #: key file, for :func:`connect` to find; give it to trainers launched elsewhere).
        self.authkey = authkey if authkey is not None else secrets.token_bytes(_KEY_BYTES)
        self.handshake_timeout = float(handshake_timeout)
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
        total = explicit if explicit is not None else default_budget().stats().total
        self.budget = MemoryBudget(total)
        cap = max_open_files if max_open_files is not None else options.max_open_files
        #: One descriptor cap for every consumer's readers (None: the process-wide pool's).
        self.file_limiter: FileLimiter | None = (
            None if cap is None else get_default_pool().limiter(cap)
        )
        #: The listening socket and a connection per consumer count against the cap too
        #: (G2): held for the producer's life, so the readers share what is left.
        self._socket_slots = get_default_pool().hold(
            consumers + 1, limiter=self.file_limiter, stage="serve",
            what=f"its listening socket and {consumers} consumer connection(s)")
        #: The budget is split in ``consumers + 1`` equal parts: one for each consumer's
        #: run (its stages' shares add up to it), one for the segments. Were each run to
        #: draw on the whole budget, k runs plus the segments could book (k + 1) times it.
        self.part = total // (consumers + 1)
        #: The shared-memory segments each consumer's elements travel in, booked on the
        #: same budget from creation until dropped (G1): what consumers hold counts; past
        #: their part, as an overdraft (a consumer that keeps what it got).
        self.segments = self.budget.account("served segments", weight=1.0)
        self.budget.allot()
        self.segments.fix_share(total - consumers * self.part)
        self._lock = threading.Lock()
        self._connections: dict[int, socket.socket] = {}
        self._sockets: set[socket.socket] = set()  # every open connection, for close()
        self._pending = 0  # connections in their handshake
        self._threads: list[threading.Thread] = []
        self._served: dict[int, int] = dict.fromkeys(range(consumers), 0)  # runs finished
        self._runs: dict[int, DatasetIterator] = {}  # the connected consumers' runs
        self._closed = False
        sweep_stale()
        try:
            self._socket, self.directory = _listen(self.address, self.authkey, authkey is None)
        except OSError as error:
            self._socket_slots.release()
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
        return {index: run.context.budget.stats().used for index, run in runs.items()}

    def overdrawn(self) -> int:
        """Bytes booked past their stages' shares now, as counted overdrafts: segments a
        hoarding consumer keeps, outputs of parallel calls that outgrew their estimate."""
        with self._lock:
            runs = list(self._runs.values())
        accounts = [self.segments] + [a for run in runs for a in run.context.budget.accounts]
        return sum(account.stats().overdrawn for account in accounts)

    def close(self) -> None:
        """Stop listening, end every connection, close every consumer's run, remove the
        socket, its key file and directory. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            connections = list(self._sockets)
        _hang_up(self._socket)  # wakes the accept loop
        for sock in connections:
            _hang_up(sock)
        self._acceptor.join(timeout=5)
        for thread in list(self._threads):
            thread.join(timeout=5)
        with contextlib.suppress(OSError):
            self._socket.close()
        with contextlib.suppress(OSError):
            if _private_dir(self.address) == os.path.realpath(self.directory):
                os.unlink(self.address)
        _remove_private(self.directory)
        self._socket_slots.release()

    # -- serving -----------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while True:
            try:
                sock, _ = self._socket.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.01)  # (out of descriptors: try again in a moment)
                continue
            with self._lock:
                refuse = self._closed or self._pending >= _MAX_PENDING
                if not refuse:
                    self._pending += 1
                    self._sockets.add(sock)
            if refuse:
                sock.close()
                if self._closed:
                    return
                continue
            thread = threading.Thread(target=self._serve_one, args=(sock,), daemon=True,
                                      name=f"headrace-serve-{self.address}-consumer")
            with self._lock:
                self._threads = [t for t in self._threads if t.is_alive()]
                self._threads.append(thread)
            thread.start()

    def _greet(self, sock: socket.socket) -> int | None:
        """The handshake, within ``handshake_timeout``: the key both ways, then the
        consumer's greeting; its index, or None (refused, told why where it proved the key)."""
        deadline = time.monotonic() + self.handshake_timeout
        try:
            if not _wire.authenticate_consumer(sock, self.authkey, deadline):
                return None
            message, _ = _wire.recv_message(sock, _wire.PRE_AUTH_FRAME * 4, deadline)
            refusal = self._check_hello(message)
            if refusal is None:
                index: int = message["index"]
                with self._lock:
                    if self._closed:
                        refusal = "the producer is closing"
                    elif index in self._connections:
                        refusal = f"consumer {index} is already connected"
                    else:
                        self._connections[index] = sock
            if refusal is not None:
                _wire.send_message(sock, {"op": "refused", "why": refusal}, deadline=deadline)
                return None
            try:
                _wire.send_message(sock, {"op": "ok", "consumers": self.consumers,
                                          "pid": os.getpid()}, deadline=deadline)
            except BaseException:
                with self._lock:
                    del self._connections[index]
                raise
            sock.settimeout(None)
            return index
        finally:
            with self._lock:
                self._pending -= 1

    def _check_hello(self, message: dict[str, Any]) -> str | None:
        if message.get("op") != "hello":
            return "not a headrace consumer greeting"
        protocol, index = message.get("protocol"), message.get("index")
        if protocol != _PROTOCOL:
            return f"protocol {protocol!r}, this producer speaks {_PROTOCOL}"
        if type(index) is not int or not 0 <= index < self.consumers:
            return f"consumer index {index!r} is not in 0..{self.consumers - 1}"
        return None

    def _serve_one(self, sock: socket.socket) -> None:
        index: int | None = None
        run: DatasetIterator | None = None
        pool = SegmentPool(os.getpid(), tag="serve")
        booked: list[Reservation] = []

        def allocate(nbytes: int) -> tuple[int, str, int, Segment]:
            key, name, capacity, mapping = pool.allocate(nbytes)
            if name:  # a new segment: it exists (in both processes) until the pool closes
                booked.append(self.segments.overdraw(capacity))
            return key, name, capacity, mapping

        try:
            index = self._greet(sock)
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
                request, _ = _wire.recv_message(sock, _CONSUMER_FRAME)
                if not self._answer(sock, request, run, index, pool, allocate):
                    return
        except (EOFError, OSError, _wire.WireError):
            return  # the consumer went away, broke the protocol, or we hung up on close
        finally:
            self._release(sock, index, run, pool, booked)

    def _answer(self, sock: socket.socket, request: dict[str, Any], run: DatasetIterator,
                index: int, pool: SegmentPool, allocate: _wire.Allocate) -> bool:
        """Answer one request of a consumer; False to hang up (its close, or a request
        that is not the protocol)."""
        kind = request["op"]
        if kind == "next":
            freed = request.get("free", [])
            if not isinstance(freed, list) or not all(type(k) is int for k in freed):
                return False
            for key in freed:
                pool.free(key)
            self._send_next(sock, run, index, allocate)
        elif kind == "get_state":
            try:  # a refused checkpoint (CheckpointError) is the consumer's to see
                reply = {"op": "state", "state": run.get_state()}
                _wire.send_message(sock, reply)
            except Exception as error:  # (a state that is not JSON: TypeError)
                _wire.send_message(sock, _wire.error_message(error))
        elif kind == "set_state":
            state = request.get("state")
            try:
                if not isinstance(state, dict):
                    raise CheckpointError("not a served part's state (not a JSON object)")
                run.set_state(state)
            except Exception as error:  # a state that is not this part's
                _wire.send_message(sock, _wire.error_message(error))
                return True
            _wire.send_message(sock, {"op": "ok"})
        else:  # close, or not the protocol
            return False
        return True

    def _release(self, sock: socket.socket, index: int | None, run: DatasetIterator | None,
                 pool: SegmentPool, booked: list[Reservation]) -> None:
        """What one consumer's connection held: its run, segments, their bookings and
        its socket."""
        if run is not None:
            with self._lock:
                if index is not None and self._runs.get(index) is run:
                    del self._runs[index]
            run.close()
        pool.close()
        for reservation in booked:
            reservation.release()
        with self._lock:
            if index is not None and self._connections.get(index) is sock:
                del self._connections[index]
            self._sockets.discard(sock)
        with contextlib.suppress(OSError):
            sock.close()

    def _send_next(self, sock: socket.socket, run: DatasetIterator, index: int,
                   allocate: _wire.Allocate) -> None:
        try:
            element = next(run)
        except StopIteration:
            with self._lock:
                self._served[index] += 1
            _wire.send_message(sock, {"op": "end"})
            return
        except Exception as error:  # the pipeline's error: the consumer's too
            _wire.send_message(sock, _wire.error_message(error))
            return
        try:
            message, blob = _wire.encode(element, allocate)
        except Exception as error:  # a leaf the wire cannot carry: this element's error
            _wire.send_message(sock, _wire.error_message(error))
            return
        _wire.send_message(sock, message, blob)


def serve(
    dataset: Dataset,
    consumers: int,
    address: str | os.PathLike[str],
    *,
    authkey: bytes | None = None,
    max_open_files: int | None = None,
    shard_policy: AutoShardPolicy | str = AutoShardPolicy.DATA,
    handshake_timeout: float = 10.0,
) -> Server:
    """Serve ``dataset`` to ``consumers`` processes on this host; returns the :class:`Server`.

    Consumer ``i`` (see :func:`connect`) gets ``dataset.shard(consumers, i)``, or with
    ``shard_policy="file"`` its round-robin part of the pipeline's files (each file
    read once for all consumers; see :func:`headrace.auto_shard` and the module doc).
    ``address``: the path consumers connect to; it becomes a link to the socket,
    which is made owner-only (0600) in a new owner-only (0700) directory beside it
    (what a dead producer left there is replaced). ``authkey``: the secret a
    consumer must prove it holds (HMAC challenge both ways); by default a random
    key, written to a file only this user can read in that directory, which
    :func:`connect` reads by itself (also :attr:`Server.authkey`); give one
    explicitly for trainers that cannot read this host's files, and pass it to
    their ``connect``. Nothing a consumer sends is ever unpickled, before or after
    it authenticated; an element must be made of the leaves :mod:`headrace._wire`
    lists (else that element's error is :class:`~headrace._errors.ElementSpecError`).
    ``handshake_timeout``: the seconds a new connection has to authenticate and
    greet (each on a thread of its own: a silent one delays nobody).
    ``max_open_files``: the cap on descriptors all consumers' readers share
    (default: the dataset's ``Options(max_open_files=...)``). Use as a context
    manager, or call :meth:`Server.close`.
    """
    return Server(dataset, consumers, os.fspath(address), authkey=authkey,
                  max_open_files=max_open_files, shard_policy=shard_policy,
                  handshake_timeout=handshake_timeout)


class ServedIterator(ClosesOnExit):
    """A consumer's iterator over its part of a served dataset (from :func:`connect`)."""

    def __init__(self, sock: socket.socket, address: str, index: int, consumers: int,
                 producer: int, first_timeout: float | None = None) -> None:
        self._sock = sock
        #: The seconds the first element may take once asked for (``connect``'s
        #: ``timeout``); None once it arrived: later elements wait as long as needed.
        self._first_timeout = first_timeout
        self.address = address
        #: This consumer's index, the number of consumers, the producer's process id.
        self.index, self.consumers, self.producer_pid = index, consumers, producer
        self._maps = SegmentMaps()
        self._closed = False
        self._ended = False

    def __iter__(self) -> ServedIterator:
        return self

    def _gone(self, doing: str, why: str = "it died or was closed") -> ProducerError:
        self._closed = True
        _hang_up(self._sock)
        return ProducerError(
            f"the producer (pid {self.producer_pid}) serving {self.address!r} is gone "
            f"({why}) while consumer {self.index} of {self.consumers} was {doing}")

    def _ask(self, request: dict[str, Any], doing: str,
             deadline: float | None = None) -> tuple[dict[str, Any], bytearray]:
        try:
            _wire.send_message(self._sock, request, deadline=deadline)
            reply, blob = _wire.recv_message(self._sock, deadline=deadline)
            if deadline is not None:
                self._sock.settimeout(None)  # (the next waits are unbounded again)
        except TimeoutError:  # (an OSError, so caught first) only with a deadline
            # The reply may still come, even half-read: the connection is of no more use.
            self._closed = True
            _hang_up(self._sock)
            raise ProducerError(
                f"consumer {self.index} of {self.consumers}'s first element did not arrive "
                f"from the producer at {self.address!r} within {self._first_timeout:g} s "
                "(connect's timeout): if its pipeline needs longer before its first "
                "element (a large shuffle buffer filling, slow files), pass a larger "
                "connect(..., timeout=...)") from None
        except (EOFError, OSError) as error:
            raise self._gone(doing) from error
        except _wire.WireError as error:
            raise self._gone(doing, f"it broke the protocol: {error}") from None
        if reply["op"] == "error":
            raise _wire.rebuild_error(reply, f"the producer at {self.address!r}")
        return reply, blob

    def __next__(self) -> Any:
        self._check_open()
        if self._ended:
            raise StopIteration
        freed = self._maps.released()  # kept mapped: the producer reuses them by key
        first = self._first_timeout
        reply, blob = self._ask({"op": "next", "free": freed}, "waiting for its next element",
                                None if first is None else time.monotonic() + first)
        if reply["op"] in ("element", "end"):
            self._first_timeout = None  # (a pipeline error is not the first element)
        if reply["op"] == "end":
            self._ended = True
            raise StopIteration
        doing = "reading its next element"
        if reply["op"] != "element":
            raise self._gone(doing, f"it broke the protocol: a {reply['op']!r} for 'next'")
        try:
            segment = _wire.segment_of(reply)
            if segment is not None and not segment[1] and segment[0] not in self._maps.maps:
                raise _wire.WireError(f"segment {segment[0]} was never announced")
            return self._maps.decode(segment, lambda mapping, on_view: _wire.decode(
                reply, blob, mapping, on_view))
        except (_wire.WireError, OSError, ValueError) as error:
            raise self._gone(doing, f"it broke the protocol: {error}") from None

    def get_state(self) -> dict[str, Any]:
        """This consumer's position: resume it with :meth:`set_state` after a new ``connect``."""
        self._check_open()
        reply, _ = self._ask({"op": "get_state"}, "saving its state")
        if reply["op"] != "state" or not isinstance(reply.get("state"), dict):
            raise self._gone("saving its state", "it broke the protocol: no state")
        return {
            "format": _STATE_FORMAT,
            "consumers": self.consumers,
            "index": self.index,
            "state": reply.get("state"),
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
        reply, _ = self._ask({"op": "set_state", "state": inner}, "restoring its state")
        if reply["op"] != "ok":
            raise self._gone("restoring its state", f"it broke the protocol: {reply['op']!r}")
        self._ended = False

    def close(self) -> None:
        """Hang up: the producer closes this consumer's run. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            _wire.send_message(self._sock, {"op": "close"}, deadline=time.monotonic() + 1)
        with contextlib.suppress(OSError):
            self._sock.close()
        self._maps.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise IteratorClosedError(f"consumer {self.index}'s connection to {self.address!r} is closed")


def _connect(sock: socket.socket, path: str) -> None:
    """``sock.connect(path)``, through ``/proc/self/fd`` when ``path`` is longer than a
    socket address may be (as :func:`_bind` binds)."""
    if len(os.fsencode(path)) < 100:
        sock.connect(path)
        return
    fd = os.open(os.path.dirname(os.path.abspath(path)) or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        sock.connect(f"/proc/self/fd/{fd}/{os.path.basename(path)}")
    finally:
        os.close(fd)


def _dial(path: str, deadline: float, timeout: float) -> socket.socket:
    """A socket connected to the producer at ``path``, waiting until ``deadline`` for it
    to listen."""
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(max(deadline - time.monotonic(), 0.01))
            _connect(sock, path)
            return sock
        except (FileNotFoundError, ConnectionRefusedError) as error:
            sock.close()
            if time.monotonic() >= deadline:
                raise ProducerError(
                    f"no headrace producer listens on {path!r} (waited {timeout:g} s)"
                ) from error
            time.sleep(0.05)
        except OSError as error:  # a timeout, a permission refused
            sock.close()
            raise ProducerError(f"cannot connect to the producer at {path!r}: {error}") from error


def _greet_producer(path: str, index: int, authkey: bytes | None, deadline: float,
                    timeout: float, refused: str | None
                    ) -> tuple[socket.socket, dict[str, Any]] | None:
    """One try at :func:`connect`'s handshake and greeting: the socket and the
    producer's reply to the greeting; None after a pause when the producer hung up
    before its challenge (too many connections under way). Any other failure closes
    the socket and raises :class:`ProducerError` (``refused``: the last refusal of the
    index, which a timeout repeats)."""
    sock = _dial(path, deadline, timeout)
    try:
        key = authkey if authkey is not None else _read_key(path)
        if key is None:
            raise ProducerError(
                f"no key for the producer at {path!r}: it was given its own authkey "
                "(pass the same authkey= to connect), or its key file is not this "
                "user's alone")
        _wire.authenticate_producer(sock, key, deadline)
        _wire.send_message(sock, {"op": "hello", "protocol": _PROTOCOL, "index": index},
                           deadline=deadline)
        reply, _ = _wire.recv_message(sock, _wire.PRE_AUTH_FRAME * 4, deadline)
    except _wire.Busy:
        sock.close()
        if time.monotonic() + 0.05 >= deadline:
            raise ProducerError(
                f"the producer at {path!r} kept hanging up before its key challenge "
                f"(too many connections under way) for {timeout:g} s") from None
        time.sleep(0.05)
        return None
    except PermissionError as error:
        sock.close()
        raise ProducerError(f"the producer at {path!r} refused the connection: {error}") from None
    except TimeoutError:
        sock.close()
        if refused is not None:
            raise ProducerError(refused) from None
        raise ProducerError(
            f"the producer at {path!r} did not complete the handshake within "
            f"{timeout:g} s") from None
    except (EOFError, OSError, _wire.WireError) as error:
        sock.close()
        raise ProducerError(
            f"the producer at {path!r} refused the connection or hung up during the "
            f"handshake: {error}") from None
    except BaseException:
        sock.close()
        raise
    return sock, reply


def connect(
    address: str | os.PathLike[str],
    index: int,
    *,
    authkey: bytes | None = None,
    state: dict[str, Any] | None = None,
    timeout: float = 30.0,
) -> ServedIterator:
    """Connect to the producer at ``address`` as consumer ``index``: an iterator of its part.

    ``timeout`` bounds everything until this returns: waiting for the producer to
    listen (trainers and the producer may start in any order), the key handshake and
    the greeting (a producer that accepts but never answers is a
    :class:`ProducerError` after ``timeout`` seconds, not a hang); and then the wait
    for this consumer's first element: it must arrive within ``timeout`` seconds of
    the first ``next`` asking for it, else that ``next`` raises a
    :class:`ProducerError` saying so and the connection is closed (a producer stuck
    before its first element is an error, not a silent hang). Once the first element
    arrived, later ones wait as long as the pipeline needs (a dead producer is still
    an error at once). Give a pipeline that legitimately takes long before its first
    element (a large shuffle buffer filling, a slow first file) a ``timeout`` longer
    than that. ``authkey``: the
    producer's explicit key; by default the key the producer wrote beside its socket
    (readable only by this user). ``state``: resume from this consumer's
    :meth:`ServedIterator.get_state`. Raises :class:`ProducerError` when no producer
    answers in time, the key is wrong, or the producer refuses the index (out of
    range, or already connected). Nothing the producer sends is unpickled.
    """
    path = os.fspath(address)
    deadline = time.monotonic() + timeout
    refused: str | None = None  # the last refusal, while waiting for the index to be free
    while True:
        greeted = _greet_producer(path, index, authkey, deadline, timeout, refused)
        if greeted is None:
            continue  # it hung up before its challenge: busy, try again
        sock, reply = greeted
        if reply.get("op") == "ok" and type(reply.get("consumers")) is int \
                and type(reply.get("pid")) is int:
            break
        sock.close()
        why = reply.get("why")
        why = why if isinstance(why, str) else f"an unexpected reply {reply.get('op')!r}"
        # The index's previous connection may be ending (a trainer restarted at once):
        # the producer notices a dead consumer within moments, so wait for it.
        refused = f"the producer at {path!r} refused consumer {index!r}: {why}"
        if "already connected" not in why or time.monotonic() + 0.05 >= deadline:
            raise ProducerError(refused)
        time.sleep(0.05)
    sock.settimeout(None)
    served = ServedIterator(sock, path, index, reply["consumers"], reply["pid"], timeout)
    if state is not None:
        try:
            served.set_state(state)
        except BaseException:
            served.close()
            raise
    return served

"""Served datasets against an outsider (issue 22): no code from a socket, no hang.

Generators of hostile peers race real consumers and producers:

- hostile *clients* (no key, a wrong key, silent, garbage bytes, pickle payloads
  that would create a marker file, sent in either framing with and without the
  right key, huge length prefixes) connect before the real consumers; the
  oracle: every real consumer receives exactly its part of the fault-free stream
  within its timeout, no marker file ever appears, and the socket, its
  directory and key file are owner-only (0600 / 0700 / 0600);
- hostile *producers* (silent, dripping, pickles, object dtypes, a segment name
  outside /dev/shm, huge frames) answer a real consumer: it gets a
  ProducerError within its timeout, never runs their code, never hangs.

The attackers speak whichever protocol the producer speaks (headrace's own, or
``multiprocessing.connection``'s where ``headrace._wire`` does not exist), so
the same cases judge the code before and after the change.
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import random
import socket
import stat
import struct
import threading
import time
from collections import namedtuple
from multiprocessing.connection import Client
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import served_fns
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import headrace as hr

try:
    from headrace import _wire
except ImportError:  # the code before the change: multiprocessing.connection's protocol
    _wire = None  # type: ignore[assignment]

KEY = b"served-trust"


class _Touch:
    """Unpickled, creates the file ``path``: the code an attacker wants run."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (Path.touch, (self.path,))


def evil_pickle(marker: Path) -> bytes:
    return pickle.dumps(_Touch(marker))


# -- hostile clients against a real producer and real consumers ---------------------------


HOSTILE = ["silent", "garbage", "pickle4", "pickle8", "huge", "wrong_key", "keyed_pickle",
           "keyed_huge", "keyed_garbage"]


def keyed_client(address: str, key: bytes | None) -> tuple[socket.socket, Any]:
    """A connection that proved it holds ``key`` (what a same-user process can do), and
    how to frame a payload in the producer's protocol."""
    if _wire is None:
        conn = Client(address, "AF_UNIX", authkey=key)
        sock = socket.socket(fileno=os.dup(conn.fileno()))
        return sock, lambda data: struct.pack("!i", len(data)) + data
    assert key is not None
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(address)
    _wire.authenticate_producer(sock, key, time.monotonic() + 5)
    return sock, lambda data: struct.pack("!Q", len(data)) + data


def attack(kind: str, address: str, key: bytes | None, marker: Path, rng: random.Random,
           connected: threading.Event, stop: threading.Event) -> None:
    """One hostile client: connect, do ``kind``, hold the connection until ``stop``."""
    sock: socket.socket | None = None
    try:
        if kind.startswith("keyed"):
            sock, frame = keyed_client(address, key)
            payload = {"keyed_pickle": frame(evil_pickle(marker)),
                       "keyed_huge": struct.pack("!Q", 1 << 62),
                       "keyed_garbage": rng.randbytes(rng.randint(1, 300))}[kind]
        else:
            sock = socket.socket(socket.AF_UNIX)
            sock.settimeout(5)
            sock.connect(address)
            pickled = evil_pickle(marker)
            payload = {
                "silent": b"",
                "garbage": rng.randbytes(rng.randint(1, 300)),
                "pickle4": struct.pack("!i", len(pickled)) + pickled,
                "pickle8": struct.pack("!Q", len(pickled)) + pickled,
                "huge": rng.choice([struct.pack("!i", 0x7FFFFFFF), struct.pack("!Q", 1 << 62)]),
                "wrong_key": b"",
            }[kind]
            if kind == "wrong_key":
                if _wire is None:
                    sock.close()
                    sock = None
                    with contextlib.suppress(Exception):
                        Client(address, "AF_UNIX", authkey=b"not the key")
                else:
                    with contextlib.suppress(Exception):
                        _wire.authenticate_producer(sock, b"not the key", time.monotonic() + 5)
        if sock is not None and payload:
            sock.sendall(payload)
    except Exception:
        pass  # refused, hung up on: what a producer may do to an attacker
    finally:
        connected.set()
    stop.wait(30)
    if sock is not None:
        sock.close()


def modes(address: str, default_key: bool) -> dict[str, int]:
    real = os.path.realpath(address)
    found = {"socket": stat.S_IMODE(os.stat(real).st_mode)}
    directory = os.path.dirname(real)
    found["directory"] = stat.S_IMODE(os.stat(directory).st_mode)
    if default_key:
        key = os.path.join(directory, "key")
        found["key"] = stat.S_IMODE(os.stat(key).st_mode) if os.path.exists(key) else -1
    return found


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(0, 24), k=st.integers(1, 3), default_key=st.booleans(),
       hostile=st.lists(st.sampled_from(HOSTILE), min_size=1, max_size=5),
       seed=st.integers(0, 2**32 - 1))
def test_hostile_clients_never_run_code_nor_delay_the_real_consumers(
    n: int, k: int, default_key: bool, hostile: list[str], seed: int,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    directory = tmp_path_factory.mktemp("trust")
    address = str(directory / "s.sock")
    marker = directory / "marker"
    stream = [served_fns.value(e) for e in served_fns.ranged(n)]
    rng = random.Random(seed)
    authkey = None if default_key else KEY
    parts: dict[int, list[int]] = {}
    failures: dict[int, str] = {}
    stop = threading.Event()

    def read(index: int) -> None:
        try:
            with hr.connect(address, index, authkey=authkey, timeout=4) as part:
                parts[index] = [served_fns.value(e) for e in part]
        except Exception as error:
            failures[index] = f"{type(error).__name__}: {error}"

    with hr.serve(served_fns.ranged(n), k, address, authkey=authkey) as server:
        key = getattr(server, "authkey", authkey)
        attackers, ready = [], []
        for kind in hostile:
            connected = threading.Event()
            thread = threading.Thread(target=attack, args=(
                kind, address, key, marker, random.Random(rng.random()), connected, stop),
                daemon=True)
            thread.start()
            attackers.append(thread)
            ready.append(connected)
        for connected in ready:
            connected.wait(10)
        started = time.monotonic()
        consumers = [threading.Thread(target=read, args=(i,)) for i in range(k)]
        for thread in consumers:
            thread.start()
        for thread in consumers:
            thread.join(10)
        took = time.monotonic() - started
        found = modes(address, default_key)
        stop.set()
        for thread in attackers:
            thread.join(10)
    assert not failures, failures
    assert parts == {i: stream[i::k] for i in range(k)}
    assert took < 5, f"the real consumers took {took:.1f} s behind {hostile}"
    assert not marker.exists(), f"a peer's pickle ran code in the producer ({hostile})"
    expected = {"socket": 0o600, "directory": 0o700}
    if default_key:
        expected["key"] = 0o600
    assert found == expected


def test_a_silent_client_is_hung_up_on_after_the_handshake_timeout(tmp_path: Path) -> None:
    address = str(tmp_path / "s.sock")
    with hr.serve(served_fns.ranged(4), 1, address, handshake_timeout=0.3):
        with socket.socket(socket.AF_UNIX) as silent:
            silent.connect(address)
            silent.settimeout(5)
            started = time.monotonic()
            while silent.recv(4096):  # the challenge, then the end of the connection
                pass
            assert time.monotonic() - started < 2
        with hr.connect(address, 0, timeout=5) as part:  # found the key by itself
            assert [served_fns.value(e) for e in part] == [0, 1, 2, 3]


@settings(max_examples=4, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(cap=st.integers(1, 4), silent=st.integers(1, 10), k=st.integers(1, 3))
def test_a_flood_of_silent_clients_only_delays_consumers_by_the_handshake_timeout(
    cap: int, silent: int, k: int, tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """More silent clients than the producer takes handshakes for at once: the excess
    is hung up on, the rest after ``handshake_timeout``; real consumers try again
    and get their parts within their own timeout."""
    from headrace import _served as served

    monkeypatch.setattr(served, "_MAX_PENDING", cap)
    address = str(tmp_path_factory.mktemp("flood") / "s.sock")
    with hr.serve(served_fns.ranged(9), k, address, handshake_timeout=0.4) as server:
        flood = []
        for _ in range(silent):
            client = socket.socket(socket.AF_UNIX)
            client.connect(address)
            flood.append(client)
        started = time.monotonic()
        for index in range(k):
            with hr.connect(address, index, timeout=5) as part:
                assert [served_fns.value(e) for e in part] == list(range(index, 9, k))
        assert time.monotonic() - started < 3
        deadline = time.monotonic() + 3
        while server._pending and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server._pending == 0  # every silent handshake ended by its deadline
        for client in flood:
            client.close()


def test_consumers_started_before_the_producer_find_its_random_key(tmp_path: Path) -> None:
    address = str(tmp_path / "s.sock")
    parts: dict[int, list[int]] = {}

    def read(index: int) -> None:
        with hr.connect(address, index, timeout=10) as part:
            parts[index] = [served_fns.value(e) for e in part]

    readers = [threading.Thread(target=read, args=(i,)) for i in range(2)]
    for reader in readers:
        reader.start()
    time.sleep(0.3)
    with hr.serve(served_fns.ranged(6), 2, address):
        for reader in readers:
            reader.join(10)
    assert parts == {0: [0, 2, 4], 1: [1, 3, 5]}


def test_a_consumer_without_the_key_or_with_a_wrong_one_is_refused(tmp_path: Path) -> None:
    address = str(tmp_path / "s.sock")
    with hr.serve(served_fns.ranged(4), 1, address, authkey=KEY):
        with pytest.raises(hr.ProducerError, match=r"no key for the producer.*own authkey"):
            hr.connect(address, 0, timeout=2)
        with pytest.raises(hr.ProducerError, match=r"refused the connection.*wrong authkey"):
            hr.connect(address, 0, authkey=b"wrong", timeout=2)
    other = str(tmp_path / "t.sock")
    with hr.serve(served_fns.ranged(4), 1, other) as server:  # a random key of its own
        assert len(server.authkey) == 32
        with pytest.raises(hr.ProducerError, match="wrong authkey"):
            hr.connect(other, 0, authkey=KEY, timeout=2)
        with hr.connect(other, 0, authkey=server.authkey) as part:
            assert len(list(part)) == 4
    assert not os.path.lexists(other) and os.listdir(tmp_path) == []  # all removed


# -- hostile producers against a real consumer ------------------------------------------------


PRODUCERS = ["silent", "drip", "pickle_hello", "pickle_element", "object_dtype", "bad_segment",
             "huge", "bad_shape", "not_json", "deep"]


def fake_producer(kind: str, path: str, marker: Path, stop: threading.Event) -> threading.Thread:
    """A producer at ``path`` that answers its first consumer with ``kind`` of malice."""
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(4)
    payload = evil_pickle(marker)

    def run() -> None:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        try:
            if kind == "silent":
                pass
            elif _wire is None:  # the old protocol: its key challenge, then a pickle
                from multiprocessing.connection import Connection, deliver_challenge
                mp = Connection(os.dup(conn.fileno()))
                deliver_challenge(mp, KEY)
                mp.recv_bytes(1 << 16)
                mp.send_bytes(payload)
            elif kind == "drip":
                for byte in struct.pack("!Q", 49) + _wire.MAGIC:
                    conn.sendall(bytes([byte]))
                    time.sleep(0.1)
            else:
                deadline = time.monotonic() + 5
                assert _wire.authenticate_consumer(conn, KEY, deadline)
                _wire.recv_message(conn, 1 << 16, deadline)
                if kind == "pickle_hello":
                    _wire.send_frame(conn, payload)
                else:
                    _wire.send_message(conn, {"op": "ok", "consumers": 1, "pid": os.getpid()})
                    _wire.recv_message(conn, 1 << 16, deadline)
                    element = {
                        "pickle_element": None,
                        "object_dtype": {"op": "element", "buffers": [[0, 0, 8]],
                                         "tree": {"t": "nd", "d": "|O8", "s": [1], "b": 0}},
                        "bad_segment": {"op": "element", "buffers": [[1, 0, 8]],
                                        "segment": [1, "../../etc/passwd", 4096],
                                        "tree": {"t": "nd", "d": "<i8", "s": [1], "b": 0}},
                        "bad_shape": {"op": "element", "buffers": [[0, 0, 8]],
                                      "tree": {"t": "nd", "d": "<i8", "s": [1000], "b": 0}},
                        "deep": {"op": "element", "buffers": [],
                                 "tree": json_deep(5000)},
                    }.get(kind)
                    if kind == "huge":
                        conn.sendall(struct.pack("!Q", 1 << 62))
                    elif kind == "not_json":
                        _wire.send_frame(conn, b"\x80\x05not json")
                    elif element is None:
                        _wire.send_frame(conn, payload)
                    elif kind == "deep":
                        _wire.send_frame(conn, element["tree"])
                    else:
                        _wire.send_message(conn, element, bytes(64))
            stop.wait(30)
        except Exception:
            pass
        finally:
            conn.close()
            listener.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def json_deep(depth: int) -> bytes:
    inner = b'{"op":"element","buffers":[],"tree":' + b'{"t":"li","v":[' * depth
    return inner + b"]}" * depth + b"}"


@settings(max_examples=14, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(PRODUCERS), timeout=st.sampled_from([0.3, 0.8]))
def test_a_hostile_producer_is_a_producer_error_within_the_timeout_never_code(
    kind: str, timeout: float, tmp_path_factory: pytest.TempPathFactory,
) -> None:
    directory = tmp_path_factory.mktemp("producer")
    path, marker = str(directory / "p.sock"), directory / "marker"
    stop = threading.Event()
    producer = fake_producer(kind, path, marker, stop)
    outcome: list[BaseException | str] = []

    def consume() -> None:
        try:
            with hr.connect(path, 0, authkey=KEY, timeout=timeout) as part:
                next(part)
            outcome.append("an element")
        except BaseException as error:
            outcome.append(error)

    consumer = threading.Thread(target=consume, daemon=True)
    started = time.monotonic()
    consumer.start()
    consumer.join(timeout + 4)
    took = time.monotonic() - started
    stop.set()
    producer.join(5)
    assert outcome, f"the consumer hung on a {kind} producer"
    assert not marker.exists(), f"a {kind} producer ran code in the consumer"
    assert isinstance(outcome[0], hr.ProducerError), outcome
    if kind in ("silent", "drip"):
        assert took < timeout + 1


# -- what an element may be -------------------------------------------------------------------


Pair = namedtuple("Pair", ["image", "label"])


class Custom(Exception):
    """An exception class of the user's own: not looked up by a consumer."""


def leaves(x: int, seed: int) -> Any:
    """A nested element of every supported kind of leaf, drawn from ``seed`` and ``x``."""
    rng = np.random.default_rng([seed, x])
    dtypes = ["<i1", ">i4", "<u8", "<f2", ">f8", "<c16", "?", "<M8[ms]", "<m8[s]", "|S5", "<U3"]
    arrays = []
    for _ in range(int(rng.integers(1, 4))):
        dtype = np.dtype(dtypes[int(rng.integers(len(dtypes)))])
        shape = tuple(int(d) for d in rng.integers(0, 5, int(rng.integers(0, 3))))
        if x % 5 == 0:
            shape = (64, 1024)  # 64 KiB or more: through shared memory
        raw = rng.integers(0, 255, 2 * int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
        array = raw.view(dtype)
        arrays.append(array[::2].reshape(shape) if len(shape) == 1 else  # strided
                      array[: array.size // 2].reshape(shape))
    words = np.array([bytes(rng.integers(0, 255, int(rng.integers(0, 9)), np.uint8))
                      for _ in range(int(rng.integers(0, 5)))], dtype=object)
    texts = np.array(["é" * int(i) for i in rng.integers(0, 4, 3)], dtype=object)
    number = float(rng.standard_normal()) if x % 3 else math.nan
    return {
        "arrays": tuple(arrays), "words": words, "texts": texts, 3: [x, number, None, True],
        "pair": Pair(np.int32(x), b"\x00label" * int(rng.integers(0, 10000))),
        ("t", 1): "text\udcff", "big": 2**70 + x, "scalar": np.float16(x / 3),
    }


def same(a: Any, b: Any) -> bool:
    if type(a) is not type(b) and not (isinstance(a, tuple) and isinstance(b, tuple)
                                       and hasattr(a, "_fields")):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes() \
            if a.dtype != object else a.shape == b.shape and a.tolist() == b.tolist()
    if isinstance(a, np.generic):
        return a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[key], b[key]) for key in a)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(map(same, a, b)) and \
            getattr(type(a), "_fields", None) == getattr(type(b), "_fields", None)
    return bool(a == b)


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 8), seed=st.integers(0, 1000))
def test_every_supported_leaf_arrives_exactly_as_the_producer_made_it(
    n: int, seed: int, tmp_path_factory: pytest.TempPathFactory,
) -> None:
    address = str(tmp_path_factory.mktemp("leaves") / "s.sock")
    expected = [leaves(x, seed) for x in range(n)]
    dataset = hr.Dataset.range(n).map(lambda x: leaves(int(x), seed))
    with hr.serve(dataset, 1, address) as server, hr.connect(address, 0) as part:
        got = list(part)
        assert server.connected == [0]
    assert len(got) == n
    for index, (mine, theirs) in enumerate(zip(got, expected, strict=True)):
        assert same(mine, theirs), index
        assert all(array.flags.writeable for array in mine["arrays"])


def test_an_element_the_wire_cannot_carry_is_that_elements_error_and_the_stream_goes_on(
    tmp_path: Path,
) -> None:
    def make(x: Any) -> Any:
        if int(x) == 1:
            return {"a": np.array([1, "two"], dtype=object)}
        if int(x) == 2:
            return {"a": Custom("not data")}
        if int(x) == 3:
            raise Custom("a class of the user's own")
        return {"a": np.full(3, int(x))}

    address = str(tmp_path / "s.sock")
    with hr.serve(hr.Dataset.range(5).map(make), 1, address) as server, \
            hr.connect(address, 0) as part:
        assert list(next(part)["a"]) == [0, 0, 0]
        with pytest.raises(hr.ElementSpecError, match=r"\['a'\] is an object array of int, str"):
            next(part)
        with pytest.raises(hr.ElementSpecError, match=r"\['a'\] is a .*Custom.*nothing is pickled"):
            next(part)
        with pytest.raises(hr.WorkerError, match=r"raised .*Custom: a class of the user's own"):
            next(part)
        assert list(next(part)["a"]) == [4, 4, 4]
        with pytest.raises(StopIteration):
            next(part)
        assert server.finished(0) == 1


@pytest.mark.parametrize("length", [40, 120, 300])
def test_an_address_of_any_length_is_served_owner_only(tmp_path: Path, length: int) -> None:
    """Socket addresses stop at 108 bytes; the socket is bound and reached through its
    directory's descriptor, so a long ``address`` (a deep job directory) works too."""
    directory = tmp_path / ("d" * max(length - len(str(tmp_path)) - 8, 1))
    directory.mkdir()
    address = str(directory / "s.sock")
    with hr.serve(served_fns.ranged(3), 1, address), hr.connect(address, 0) as part:
        assert [served_fns.value(e) for e in part] == [0, 1, 2]
        assert modes(address, True) == {"socket": 0o600, "directory": 0o700, "key": 0o600}
    assert os.listdir(directory) == []

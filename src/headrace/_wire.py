"""The served transport's wire: frames, the key handshake, and elements without pickle.

Why not ``multiprocessing.connection``? Its ``recv()`` unpickles whatever the
peer sends, so a peer that reaches the socket runs code in the receiver. Its
``Listener(authkey=None)`` skips authentication altogether. Its handshake runs
inside ``accept()`` without a timeout, so one silent client stops every other
from connecting. Here nothing is ever unpickled:

- **Frames.** Every message is a length-prefixed frame (8 bytes, big-endian),
  read with a cap on its length. A peer that has not proved it holds the key
  may send at most :data:`PRE_AUTH_FRAME` bytes per frame; an authenticated
  one, :data:`MAX_FRAME`. A larger prefix is refused before anything is
  allocated.
- **Handshake.** Mutual HMAC-SHA256 challenge-response over the shared key
  (``hmac.compare_digest``). The producer sends a random challenge; the
  consumer answers it and sends its own; the producer answers that. Neither
  side reads anything but these fixed-size frames before the other has proved
  it holds the key. Every read has a deadline.
- **Messages.** Control messages are JSON objects. An element is a JSON tree
  describing its structure (:func:`encode`). Its arrays and bytes travel as raw
  buffers: small ones inline after the JSON, large ones in a shared-memory
  segment named in the JSON. Decoding (:func:`decode`) checks every dtype,
  shape, span and segment name against what it may be. So even a peer holding
  the key can make the receiver build only plain data.

Supported element leaves:

- NumPy arrays of any non-object, non-structured dtype (``b i u f c m M S U V``),
  and NumPy scalars of those;
- object arrays whose items are all ``bytes`` or all ``str`` (headrace's string
  columns);
- ``bytes``, ``bytearray``, ``memoryview``, ``str``, ``int``, ``float``,
  ``bool``, ``None``.

Containers: ``tuple``, ``list``, ``dict`` (any mapping; keys are leaves or
tuples), namedtuples (rebuilt as a namedtuple of the same name and fields), and
headrace's :class:`~headrace.io._ragged.RaggedColumn` and
:class:`~headrace.io._sparse.SparseColumn`. Anything else raises
:class:`~headrace._errors.ElementSpecError` naming where in the element it is: an
object array of mixed items, a structured dtype, an instance of a class of
one's own.
"""

from __future__ import annotations

import builtins
import collections
import functools
import hashlib
import hmac
import json
import math
import re
import secrets
import socket
import struct
import time
import traceback
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

import headrace._errors as _errors
from headrace._errors import ElementSpecError, WorkerError, add_note
from headrace.io.columns import join_bytes, split_bytes

if TYPE_CHECKING:
    from headrace._workers.shm import Segment

#: The first bytes of the producer's challenge: the protocol and its version.
MAGIC = b"headrace-serve/2:"
CHALLENGE_BYTES = 32
_MAC_BYTES = hashlib.sha256().digest_size
#: The most bytes one frame may hold before the peer proved it holds the key.
PRE_AUTH_FRAME = 256
#: The most bytes one frame may hold from an authenticated peer (JSON, or the inline
#: buffers of one element: buffers from ``OUT_OF_BAND_BYTES`` on travel in shared memory).
MAX_FRAME = 256 << 20
#: How deep an element's containers may nest (a list that contains itself is refused).
MAX_DEPTH = 64
_REFUSED = b"\x00refused: wrong key"
_LENGTH = struct.Struct("!Q")
_ALIGN = 64


class WireError(Exception):
    """The peer sent something that is not this protocol (or too much of it)."""


class Busy(EOFError):
    """The producer hung up before its challenge: too many handshakes under way."""


# -- frames ------------------------------------------------------------------------------


def _remaining(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the peer did not answer in time")
    return left


def _recv_exact(sock: socket.socket, count: int, deadline: float | None) -> bytearray:
    """``count`` bytes from ``sock``, all arriving before ``deadline`` (not per read:
    a peer that drips a byte at a time cannot stretch it)."""
    out = bytearray(count)
    view = memoryview(out)
    got = 0
    while got < count:
        if deadline is not None:  # (settimeout is a system call: not when blocking)
            sock.settimeout(_remaining(deadline))
        n = sock.recv_into(view[got:])
        if n == 0:
            raise EOFError("the peer hung up")
        got += n
    return out


def recv_frame(sock: socket.socket, cap: int, deadline: float | None = None) -> bytearray:
    """One frame's bytes; :class:`WireError` if its length prefix is over ``cap``."""
    (length,) = _LENGTH.unpack(_recv_exact(sock, _LENGTH.size, deadline))
    if length > cap:
        raise WireError(f"a frame of {length} bytes, over the {cap} accepted")
    return _recv_exact(sock, length, deadline)


def send_frame(sock: socket.socket, data: bytes | bytearray | memoryview,
               deadline: float | None = None) -> None:
    send_frames(sock, [data], deadline)


def send_frames(sock: socket.socket, frames: list[bytes | bytearray | memoryview],
                deadline: float | None = None) -> None:
    """``frames``, each with its length prefix, in one system call when they are small
    (a copy of up to 64 KiB costs less than a call)."""
    if deadline is not None:
        sock.settimeout(_remaining(deadline))
    parts: list[bytes | bytearray | memoryview] = []
    for data in frames:
        parts += [_LENGTH.pack(len(data)), data]
    if sum(len(part) for part in parts) <= 64 << 10:
        sock.sendall(b"".join(parts))
        return
    for part in parts:
        if len(part):
            sock.sendall(part)


def send_message(sock: socket.socket, message: dict[str, Any], blob: bytes | bytearray = b"",
                 deadline: float | None = None) -> None:
    """A JSON control message, and ``blob`` (the element's inline buffers) when
    ``message["blob"]`` says it follows."""
    if blob:
        message["blob"] = len(blob)
    header = json.dumps(message, separators=(",", ":")).encode()
    send_frames(sock, [header, blob] if blob else [header], deadline)


def recv_message(sock: socket.socket, cap: int = MAX_FRAME,
                 deadline: float | None = None) -> tuple[dict[str, Any], bytearray]:
    """A message from :func:`send_message`: its JSON object and its blob (maybe empty)."""
    raw = recv_frame(sock, cap, deadline)
    try:
        message = json.loads(raw)
    except (ValueError, RecursionError) as error:  # (UnicodeDecodeError is a ValueError)
        raise WireError(f"a message that is not JSON: {error}") from None
    if not isinstance(message, dict) or not isinstance(message.get("op"), str):
        raise WireError("a message that is not a JSON object with an 'op'")
    blob = bytearray()
    if "blob" in message:
        size = message["blob"]
        if not _is_int(size) or size < 0:
            raise WireError(f"a blob length {size!r}")
        blob = recv_frame(sock, cap, deadline)
        if len(blob) != size:
            raise WireError(f"a blob of {len(blob)} bytes announced as {size}")
    return message, blob


# -- the key handshake -----------------------------------------------------------------


def _mac(key: bytes, role: bytes, challenge: bytes | bytearray) -> bytes:
    return hmac.new(key, role + bytes(challenge), hashlib.sha256).digest()


def authenticate_consumer(sock: socket.socket, key: bytes, deadline: float) -> bool:
    """The producer's side: True once the peer proved it holds ``key`` (and was told
    that the producer does); False (the peer told) when its answer is wrong."""
    challenge = secrets.token_bytes(CHALLENGE_BYTES)
    send_frame(sock, MAGIC + challenge, deadline)
    answer = recv_frame(sock, PRE_AUTH_FRAME, deadline)
    if len(answer) != _MAC_BYTES + CHALLENGE_BYTES:
        raise WireError("not a headrace consumer's answer to the key challenge")
    if not hmac.compare_digest(bytes(answer[:_MAC_BYTES]), _mac(key, b"consumer", challenge)):
        send_frame(sock, _REFUSED, deadline)
        return False
    send_frame(sock, _mac(key, b"producer", answer[_MAC_BYTES:]), deadline)
    return True


def authenticate_producer(sock: socket.socket, key: bytes, deadline: float) -> None:
    """The consumer's side: returns once both sides proved they hold ``key``; raises
    :class:`PermissionError` (wrong key) or :class:`WireError` (not a producer)."""
    try:
        challenge = recv_frame(sock, PRE_AUTH_FRAME, deadline)
    except (EOFError, ConnectionResetError):
        raise Busy("the producer hung up before its challenge") from None
    if len(challenge) != len(MAGIC) + CHALLENGE_BYTES or not challenge.startswith(MAGIC):
        raise WireError("not a headrace producer of this version (its greeting is not "
                        f"{MAGIC.decode()!r} and a challenge)")
    mine = secrets.token_bytes(CHALLENGE_BYTES)
    send_frame(sock, _mac(key, b"consumer", challenge[len(MAGIC):]) + mine, deadline)
    proof = recv_frame(sock, PRE_AUTH_FRAME, deadline)
    if proof == _REFUSED:
        raise PermissionError("the producer refused the key (a wrong authkey)")
    if not hmac.compare_digest(bytes(proof), _mac(key, b"producer", mine)):
        raise WireError("the producer did not prove it holds the key")


# -- elements ----------------------------------------------------------------------------


#: Buffers at least this large travel in the shared-memory segment, smaller ones inline.
OUT_OF_BAND_BYTES = 32 << 10
_KINDS = frozenset("biufcmMSUV")
_DTYPE = re.compile(r"[<>|=]?[biufcmMSUV][0-9]{1,9}(\[[0-9]*[A-Za-z]{1,3}\])?\Z")
_SEGMENT = re.compile(r"headrace-[0-9]+-[0-9]+-serve[0-9]+\Z")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,99}\Z")


def _is_int(value: Any) -> bool:
    return type(value) is int


def _where(path: Any) -> str:
    """Where in an element ``path`` points: a chain of ``(parent, how, key)`` (made only
    when an error names it)."""
    parts: list[str] = []
    while path is not None:
        path, how, key = path
        parts.append(f"[{key!r}]" if how == "[]" else f".{key}" if how == "." else f"(key {key!r})")
    return f"the element's {''.join(reversed(parts))}" if parts else "the element"


class _Encoder:
    def __init__(self) -> None:
        self.buffers: list[memoryview] = []

    def buffer(self, data: Any) -> int:
        self.buffers.append(memoryview(data).cast("B"))
        return len(self.buffers) - 1

    def array(self, array: np.ndarray[Any, Any], path: Any) -> dict[str, Any]:
        dtype = array.dtype
        if dtype.kind == "O":
            return self.column(array, path)
        if dtype.kind not in _KINDS or dtype.fields is not None or dtype.hasobject:
            raise ElementSpecError(
                f"{_where(path)} is an array of dtype {dtype} (structured or of objects), "
                "which a served element cannot carry: send its fields as separate arrays")
        contiguous = np.ascontiguousarray(array)
        return {"t": "nd", "d": dtype.str, "s": list(array.shape),
                "b": self.buffer(contiguous.reshape(-1).view(np.uint8))}

    def column(self, array: np.ndarray[Any, Any], path: Any) -> dict[str, Any]:
        items = array.ravel().tolist()
        kinds = set(map(type, items))
        kind = "bytes"
        if kinds == {str}:
            items = [item.encode("utf-8", "surrogatepass") for item in items]
            kind = "str"
        joined = join_bytes(items) if kinds <= {bytes, str} and len(kinds) <= 1 else None
        if joined is None:
            names = ", ".join(sorted(t.__name__ for t in kinds))
            raise ElementSpecError(
                f"{_where(path)} is an object array of {names} items: a served element's "
                "object arrays must hold only bytes or only str")
        values, offsets = joined
        return {"t": "col", "k": kind, "s": list(array.shape),
                "v": self.buffer(values), "o": self.buffer(offsets)}

    def node(self, obj: Any, path: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise ElementSpecError(f"the element nests containers deeper than {MAX_DEPTH} "
                                   "(does a container hold itself?)")
        cls = type(obj)
        if obj is None or cls in (bool, int, str):
            return obj
        exact = _ENCODE_EXACT.get(cls)
        if exact is not None:
            return exact(self, obj, path, depth)
        return self.other(obj, cls, path, depth)

    def float_node(self, obj: float, path: Any, depth: int) -> Any:
        return {"t": "f", "v": obj.hex()}  # exact, NaN and inf included

    def bytes_node(self, obj: bytes | bytearray, path: Any, depth: int) -> Any:
        return {"t": "by" if type(obj) is bytes else "ba", "b": self.buffer(obj)}

    def memoryview_node(self, obj: memoryview, path: Any, depth: int) -> Any:
        return {"t": "mv", "b": self.buffer(obj.tobytes() if not obj.contiguous else obj)}

    def array_node(self, obj: np.ndarray[Any, Any], path: Any, depth: int) -> Any:
        return self.array(obj, path)

    def mapping_node(self, obj: Mapping[Any, Any], path: Any, depth: int) -> Any:
        return {"t": "di", "v": [[self.node(k, (path, "key", k), depth + 1),
                                  self.node(v, (path, "[]", k), depth + 1)]
                                 for k, v in obj.items()]}

    def sequence_node(self, obj: tuple[Any, ...] | list[Any], path: Any, depth: int) -> Any:
        return {"t": "tu" if type(obj) is tuple else "li",
                "v": [self.node(item, (path, "[]", i), depth + 1) for i, item in enumerate(obj)]}

    def other(self, obj: Any, cls: type, path: Any, depth: int) -> Any:
        """Leaves and containers known by their base class, and headrace's columns."""
        if isinstance(obj, np.generic):
            if obj.dtype.kind not in _KINDS or obj.dtype.fields is not None:
                raise ElementSpecError(f"{_where(path)} is a NumPy scalar of dtype {obj.dtype}, "
                                       "which a served element cannot carry")
            return {"t": "np", "d": obj.dtype.str,
                    "b": self.buffer(np.asarray(obj).reshape(1).view(np.uint8))}
        if isinstance(obj, tuple) and hasattr(cls, "_fields"):
            return {"t": "nt", "n": cls.__name__, "f": list(cls._fields),
                    "v": [self.node(item, (path, ".", name), depth + 1)
                          for name, item in zip(cls._fields, obj, strict=True)]}
        if isinstance(obj, Mapping):
            return self.mapping_node(obj, path, depth)
        from headrace.io._ragged import RaggedColumn
        from headrace.io._sparse import SparseColumn

        if cls is RaggedColumn:
            return {"t": "rg", "v": self.node(obj.values, (path, ".", "values"), depth + 1),
                    "s": self.node(obj.row_splits, (path, ".", "row_splits"), depth + 1)}
        if cls is SparseColumn:
            return {"t": "sp", "i": self.node(obj.indices, (path, ".", "indices"), depth + 1),
                    "v": self.node(obj.values, (path, ".", "values"), depth + 1),
                    "d": self.node(obj.dense_shape, (path, ".", "dense_shape"), depth + 1)}
        raise ElementSpecError(
            f"{_where(path)} is a {cls.__module__}.{cls.__qualname__}, which a served element "
            "cannot carry (arrays, bytes, str, numbers, bool, None and tuples, lists, dicts "
            "of them can: nothing is pickled)")


#: How :meth:`_Encoder.node` encodes an object of exactly one of these classes (one
#: lookup: this runs for every part of every element served).
_ENCODE_EXACT: dict[type, Callable[[_Encoder, Any, Any, int], Any]] = {
    float: _Encoder.float_node,
    bytes: _Encoder.bytes_node,
    bytearray: _Encoder.bytes_node,
    memoryview: _Encoder.memoryview_node,
    np.ndarray: _Encoder.array_node,
    np.memmap: _Encoder.array_node,
    dict: _Encoder.mapping_node,
    tuple: _Encoder.sequence_node,
    list: _Encoder.sequence_node,
}


def _aligned(size: int) -> int:
    return -(-size // _ALIGN) * _ALIGN


Allocate = Callable[[int], tuple[int, str, int, "Segment"]]


def encode(element: Any, allocate: Allocate) -> tuple[dict[str, Any], bytearray]:
    """An element as a JSON-able message (``op`` "element") and its inline buffers.

    Buffers of at least :data:`OUT_OF_BAND_BYTES` are written into a segment from
    ``allocate(nbytes)`` -> ``(key, name, capacity, mapping)`` (``name`` empty when
    the receiver has it mapped already); the message names it and each buffer's
    place. :class:`ElementSpecError` for a leaf the wire cannot carry.
    """
    encoder = _Encoder()
    tree = encoder.node(element, None, 0)
    inline = [i for i, b in enumerate(encoder.buffers) if b.nbytes < OUT_OF_BAND_BYTES]
    shared = [i for i, b in enumerate(encoder.buffers) if b.nbytes >= OUT_OF_BAND_BYTES]
    places: list[list[int]] = [[]] * len(encoder.buffers)
    blob = bytearray(sum(_aligned(encoder.buffers[i].nbytes) for i in inline))
    offset = 0
    for i in inline:
        raw = encoder.buffers[i]
        blob[offset : offset + raw.nbytes] = raw
        places[i] = [0, offset, raw.nbytes]
        offset += _aligned(raw.nbytes)
    message: dict[str, Any] = {"op": "element", "tree": tree}
    if shared:
        key, name, capacity, mapping = allocate(sum(_aligned(encoder.buffers[i].nbytes)
                                                    for i in shared))
        offset = 0
        with memoryview(mapping) as target:
            for i in shared:
                raw = encoder.buffers[i]
                target[offset : offset + raw.nbytes] = raw
                places[i] = [1, offset, raw.nbytes]
                offset += _aligned(raw.nbytes)
        message["segment"] = [key, name, capacity]
    for raw in encoder.buffers:
        raw.release()
    message["buffers"] = places
    return message, blob


def segment_of(message: dict[str, Any]) -> tuple[int, str, int] | None:
    """The ``(key, name, capacity)`` of an element message's segment, checked."""
    segment = message.get("segment")
    if segment is None:
        return None
    if not (isinstance(segment, list) and len(segment) == 3 and _is_int(segment[0])
            and isinstance(segment[1], str) and _is_int(segment[2]) and 0 < segment[2] < 1 << 48
            and (segment[1] == "" or _SEGMENT.match(segment[1]))):
        raise WireError(f"a segment reference {segment!r} that is not a headrace segment")
    return segment[0], segment[1], segment[2]


class _Decoder:
    def __init__(self, message: dict[str, Any], blob: bytearray, mapping: Segment | None,
                 on_view: Callable[[Any], None]) -> None:
        self.blob = blob
        self.mapping = mapping
        self.on_view = on_view
        places = message.get("buffers")
        if not isinstance(places, list):
            raise WireError("an element without its buffer table")
        for place in places:
            if not (isinstance(place, list) and len(place) == 3 and all(map(_is_int, place))
                    and place[0] in (0, 1) and place[1] >= 0 and place[2] >= 0):
                raise WireError(f"a buffer place {place!r}")
            room = len(blob) if place[0] == 0 else (0 if mapping is None else len(mapping))
            if place[1] + place[2] > room:
                raise WireError(f"a buffer place {place!r} past the end of its buffer")
        self.places = places

    def raw(self, index: Any) -> Any:
        """Buffer ``index`` as uint8: a view (of the blob, or a finalizer-watched view of
        the segment for :meth:`array`), never a copy."""
        if not _is_int(index) or not 0 <= index < len(self.places):
            raise WireError(f"a buffer index {index!r}")
        where, offset, length = self.places[index]
        if where == 0:
            return np.frombuffer(self.blob, np.uint8, length, offset)
        assert self.mapping is not None
        with memoryview(self.mapping) as whole:
            return np.frombuffer(whole[offset : offset + length], np.uint8)

    def watched(self, index: Any) -> Any:
        view = self.raw(index)
        if self.places[index][0] == 1:
            self.on_view(view)
        return view

    @staticmethod
    def dtype(text: Any) -> np.dtype[Any]:
        if not isinstance(text, str):
            raise WireError(f"a dtype {text!r}")
        return _dtype(text)

    def shape(self, shape: Any) -> tuple[int, ...]:
        if not (isinstance(shape, list) and len(shape) <= 64
                and all(_is_int(d) and d >= 0 for d in shape)):
            raise WireError(f"a shape {shape!r}")
        return tuple(shape)

    def node(self, node: Any, depth: int = 0) -> Any:
        if depth > MAX_DEPTH + 1:
            raise WireError("an element nested too deep")
        if node is None or type(node) in (bool, int, str):
            return node
        if not isinstance(node, dict):
            raise WireError(f"an element node {type(node).__name__}")
        kind = node.get("t")
        decode = _DECODE.get(kind) if isinstance(kind, str) else None
        if decode is None:
            raise WireError(f"an element node of kind {kind!r}")
        return decode(self, node, depth)

    def float_node(self, node: dict[str, Any], depth: int) -> Any:
        try:
            return float.fromhex(node["v"])
        except (KeyError, TypeError, ValueError):
            raise WireError("a float node") from None

    def bytes_node(self, node: dict[str, Any], depth: int) -> Any:
        data = self.raw(node.get("b")).tobytes()
        return data if node["t"] == "by" else bytearray(data)

    def memoryview_node(self, node: dict[str, Any], depth: int) -> Any:
        return memoryview(self.watched(node.get("b")))

    def array_node(self, node: dict[str, Any], depth: int) -> Any:
        dtype, shape = self.dtype(node.get("d")), self.shape(node.get("s"))
        data = self.watched(node.get("b"))
        count = math.prod(shape)
        if count * dtype.itemsize != data.nbytes:
            raise WireError(f"an array of shape {shape} and dtype {dtype} in "
                            f"{data.nbytes} bytes")
        if not data.flags.writeable or data.ctypes.data % max(dtype.alignment, 1):
            data = data.copy()  # (the blob is writable and aligned: rare)
        return data.view(dtype).reshape(shape)

    def scalar_node(self, node: dict[str, Any], depth: int) -> Any:
        dtype = self.dtype(node.get("d"))
        data = self.raw(node.get("b"))
        if data.nbytes != dtype.itemsize:
            raise WireError("a scalar of the wrong size")
        return data.copy().view(dtype)[0]

    def column_node(self, node: dict[str, Any], depth: int) -> Any:
        shape = self.shape(node.get("s"))
        try:
            items = split_bytes(self.raw(node.get("v")), self.raw(node.get("o")))
        except ValueError as error:
            raise WireError(f"a bytes column: {error}") from None
        texts: list[Any] = items
        if node.get("k") == "str":
            try:
                texts = [item.decode("utf-8", "surrogatepass") for item in items]
            except UnicodeDecodeError as error:
                raise WireError(f"a str column: {error}") from None
        count = math.prod(shape)
        if count != len(texts):
            raise WireError(f"a column of {len(texts)} items for shape {shape}")
        out = np.empty(shape, dtype=object)
        out.reshape(-1)[:] = texts
        return out

    def sequence_node(self, node: dict[str, Any], depth: int) -> Any:
        values = node.get("v")
        if not isinstance(values, list):
            raise WireError("a container without items")
        items = [self.node(item, depth + 1) for item in values]
        kind = node["t"]
        if kind == "li":
            return items
        if kind == "tu":
            return tuple(items)
        return _namedtuple(node.get("n"), node.get("f"), len(items))(*items)

    def dict_node(self, node: dict[str, Any], depth: int) -> Any:
        values = node.get("v")
        if not isinstance(values, list) or not all(
                isinstance(p, list) and len(p) == 2 for p in values):
            raise WireError("a dict without its pairs")
        try:
            return {self.node(k, depth + 1): self.node(v, depth + 1) for k, v in values}
        except TypeError:
            raise WireError("a dict key that cannot be a key") from None

    def ragged_node(self, node: dict[str, Any], depth: int) -> Any:
        from headrace.io._ragged import RaggedColumn

        inner, splits = self.node(node.get("v"), depth + 1), self.node(node.get("s"), depth + 1)
        if not isinstance(inner, (np.ndarray, RaggedColumn)) or not isinstance(
                splits, np.ndarray):
            raise WireError("a ragged column of the wrong parts")
        return RaggedColumn(inner, splits)

    def sparse_node(self, node: dict[str, Any], depth: int) -> Any:
        from headrace.io._sparse import SparseColumn

        parts = [self.node(node.get(p), depth + 1) for p in "ivd"]
        if not all(isinstance(p, np.ndarray) for p in parts):
            raise WireError("a sparse column of the wrong parts")
        return SparseColumn(*parts)


#: How :meth:`_Decoder.node` decodes each kind of node :class:`_Encoder` writes.
_DECODE: dict[str, Callable[[_Decoder, dict[str, Any], int], Any]] = {
    "f": _Decoder.float_node,
    "by": _Decoder.bytes_node,
    "ba": _Decoder.bytes_node,
    "mv": _Decoder.memoryview_node,
    "nd": _Decoder.array_node,
    "np": _Decoder.scalar_node,
    "col": _Decoder.column_node,
    "tu": _Decoder.sequence_node,
    "li": _Decoder.sequence_node,
    "nt": _Decoder.sequence_node,
    "di": _Decoder.dict_node,
    "rg": _Decoder.ragged_node,
    "sp": _Decoder.sparse_node,
}


@functools.lru_cache(maxsize=256)
def _dtype(text: str) -> np.dtype[Any]:
    """The dtype a peer named, if it is one of plain values (never of objects)."""
    if not _DTYPE.match(text):
        raise WireError(f"a dtype {text!r}")
    dtype = np.dtype(text)
    if dtype.hasobject or dtype.fields is not None or dtype.kind not in _KINDS:
        raise WireError(f"a dtype {text!r}")
    return dtype


_NAMEDTUPLES: dict[tuple[str, tuple[str, ...]], Any] = {}


def _namedtuple(name: Any, fields: Any, count: int) -> Any:
    """A namedtuple class of this name and fields (made once): identifiers only."""
    if not (isinstance(name, str) and _NAME.match(name) and isinstance(fields, list)
            and len(fields) == count and all(isinstance(f, str) and _NAME.match(f)
                                             and not f.startswith("_") for f in fields)
            and len(set(fields)) == len(fields)):
        raise WireError(f"a namedtuple {name!r} with fields {fields!r}")
    key = (name, tuple(fields))
    cls = _NAMEDTUPLES.get(key)
    if cls is None:
        try:
            cls = _NAMEDTUPLES[key] = collections.namedtuple(name, fields)  # type: ignore[misc]
        except ValueError as error:  # a keyword as a field name
            raise WireError(f"a namedtuple: {error}") from None
    return cls


def decode(message: dict[str, Any], blob: bytearray, mapping: Segment | None,
           on_view: Callable[[Any], None]) -> Any:
    """The element of an :func:`encode` message; its arrays view ``mapping`` (the
    segment, each view passed to ``on_view``) or the blob. :class:`WireError` for
    anything that is not what :func:`encode` makes."""
    try:
        return _Decoder(message, blob, mapping, on_view).node(message.get("tree"))
    except RecursionError:
        raise WireError("an element nested too deep") from None
    except (ValueError, TypeError, OverflowError) as error:  # what NumPy says of a bad part
        raise WireError(f"an element that cannot be rebuilt: {error}") from None


# -- errors ----------------------------------------------------------------------------


def error_message(error: BaseException) -> dict[str, Any]:
    """An exception as JSON: its class's name and module, text, notes, traceback."""
    cls = type(error)
    info: dict[str, Any] = {
        "type": cls.__qualname__, "module": cls.__module__, "message": str(error),
        "notes": [str(n) for n in getattr(error, "__notes__", ())],
        "traceback": "".join(traceback.format_exception(cls, error, error.__traceback__)),
    }
    for field in ("path", "offset"):
        value = getattr(error, field, None)
        if isinstance(value, (str, int)) and isinstance(error, _errors.DataLossError):
            info[field] = value
    return {"op": "error", "error": info}


def rebuild_error(message: dict[str, Any], producer: str) -> BaseException:
    """The exception an :func:`error_message` describes: of the same class when that is
    a builtin exception or one of headrace's errors (no other class is looked up, so a
    peer names no code to run), else a :class:`WorkerError` with its text and traceback."""
    info = message.get("error")
    if not isinstance(info, dict):
        return WorkerError(f"{producer} sent an error without its description")
    name, module, text = info.get("type"), info.get("module"), info.get("message")
    text = text if isinstance(text, str) else ""
    cls: Any = None
    if module == "builtins" and isinstance(name, str):
        cls = getattr(builtins, name, None)
    elif isinstance(module, str) and module.startswith("headrace.") and isinstance(name, str):
        cls = getattr(_errors, name, None)
    error: BaseException | None = None
    if isinstance(cls, type) and issubclass(cls, Exception) and not issubclass(cls, Warning):
        try:
            if issubclass(cls, _errors.DataLossError):
                path, offset = info.get("path"), info.get("offset")
                error = cls(text, path=path if isinstance(path, str) else None,
                            offset=offset if _is_int(offset) else None)
            else:
                error = cls(text)
        except Exception:
            error = None
    if error is None:
        trace = info.get("traceback")
        error = WorkerError(f"the producer's pipeline raised {module}.{name}: {text}\n"
                            f"{trace if isinstance(trace, str) else ''}")
    notes = info.get("notes")
    for note in notes if isinstance(notes, list) else []:
        if isinstance(note, str):
            add_note(error, note)
    return error

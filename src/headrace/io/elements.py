"""A safe binary encoding of one pipeline element, for caches and saved datasets.

Why not pickle: a cache or a saved dataset is a file someone else may hand
you, and unpickling runs whatever code the file names. This encoding can only
ever produce NumPy arrays and scalars (never of ``object`` dtype from raw
bytes), Python numbers, ``bytes``, ``str``, ``None`` and dicts, tuples, lists
and namedtuples of them; anything else is refused when *writing*, naming the
component and its type.

One element is one payload (framed as a TFRecord record by the writers, so
every record carries CRCs and corruption is found with its file and offset)::

    u32 skeleton length | skeleton (JSON, UTF-8) | leaf data, in skeleton order

The skeleton describes the structure and each leaf's kind, dtype and shape;
elements of one dataset usually share it, so decoding parses it once and
caches a compiled decoder. Leaf data:

- array (``"a"``, dtype string with byte order, shape): the raw C-order bytes;
  decoded as a read-only view of the record (no copy).
- NumPy scalar (``"g"``, dtype string): its ``itemsize`` bytes.
- arrays of ``bytes`` / ``str`` objects (``"ab"`` / ``"as"``, shape): int64
  lengths, then the bytes (UTF-8 with ``surrogatepass`` for ``str``, so any
  Python string round-trips exactly — trailing NULs included).
- ``bytes`` / ``bytearray`` / ``str`` (``"y"`` / ``"Y"`` / ``"s"``): u64 length
  and the bytes; ``int`` (``"i"``: int64, ``"I"``: a decimal string beyond int64),
  ``float`` (``"f"``), ``complex`` (``"c"``), ``bool`` (``"b"``), ``None`` (``"n"``).

Namedtuples decode to the class that wrote them when it is known in this
process, otherwise to a plain :func:`collections.namedtuple` of the same name
and fields: a file never names code to import.
"""

from __future__ import annotations

import collections
import json
import struct
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from headrace._errors import DataLossError, ElementSpecError
from headrace._structure import TensorSpec

__all__ = [
    "ELEMENTS_FORMAT",
    "decode_element",
    "encode_element",
    "encode_element_parts",
    "spec_from_json",
    "spec_to_json",
]

#: Name and version of this encoding, written into manifests that use it.
ELEMENTS_FORMAT = "headrace.elements/1"

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")
_C128 = struct.Struct("<dd")
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
# dtype kinds whose bytes mean the same thing in any process: no object pointers,
# no structured fields whose names ``dtype.str`` would drop.
_SAFE_KINDS = frozenset("biufcSUmM")
_MAX_DECODERS = 4096

# Namedtuple classes seen by the encoder in this process, by (typename, fields): a
# decoder hands back the user's own class, never one a file could name.
_namedtuples: dict[tuple[str, tuple[str, ...]], type] = {}
# Skeletons (as hashable trees of tuples) already turned into their JSON head.
_heads: dict[Any, bytes] = {}


# --------------------------------------------------------------------------- encoding


def encode_element(element: Any) -> bytes:
    """The payload of ``element``; raises ElementSpecError for what cannot be stored."""
    return b"".join(encode_element_parts(element).parts)


class EncodedParts(NamedTuple):
    """An element's payload as the pieces it is made of, not yet joined.

    The data of contiguous arrays (and of ``bytes`` values) are *views* of the element,
    not copies: a writer that frames and writes the pieces one after another (see
    :meth:`headrace.io.tfrecord.writer.TFRecordWriter.write_parts`) stores a large
    element without ever holding a second copy of it in memory.
    """

    #: The skeleton's head first, then each leaf's bytes (``bytes`` or 1-D byte views).
    parts: list[bytes | memoryview]
    #: The payload's length (the sum of the parts' lengths).
    nbytes: int
    #: Bytes of the parts made while encoding (copies, lengths, scalars): what encoding
    #: costs in memory beyond the element itself.
    copied: int


def encode_element_parts(element: Any) -> EncodedParts:
    """:func:`encode_element`'s payload as parts (views of the element's arrays)."""
    parts: list[Any] = []
    tree = _encode(element, parts, "")
    head = _heads.get(tree)
    if head is None:
        skeleton = json.dumps(tree, separators=(",", ":")).encode()
        head = _U32.pack(len(skeleton)) + skeleton
        if len(_heads) >= _MAX_DECODERS:
            _heads.clear()
        _heads[tree] = head
    parts[0:0] = (head,)
    nbytes = copied = 0
    for part in parts:
        nbytes += len(part)
        if not isinstance(part, memoryview):
            copied += len(part)
    return EncodedParts(parts, nbytes, copied)


def _refuse(path: str, value: Any, why: str = "") -> ElementSpecError:
    where = f"component {path!r}" if path else "the element"
    return ElementSpecError(
        f"cannot store {where} of type {type(value).__name__}{why}: the on-disk format holds "
        "NumPy arrays (numbers, bool, bytes, str), Python numbers, bytes, str, None, and "
        "dicts (str keys), tuples, lists and namedtuples of them"
    )


def _encode(value: Any, parts: list[Any], path: str) -> Any:
    encode = _ENCODE_EXACT.get(type(value))
    if encode is not None:
        return encode(value, parts, path)
    for kind, encode in _ENCODE_ORDER:  # subclasses: the first base that matches
        if isinstance(value, kind):
            return encode(value, parts, path)
    raise _refuse(path, value)


def _encode_generic(value: np.generic, parts: list[Any], path: str) -> Any:
    dtype = value.dtype
    if dtype.kind in "SU":  # np.bytes_ / np.str_: their Python value, exactly
        data = value.item() if dtype.kind == "S" else str(value).encode("utf-8", "surrogatepass")
        parts.append(_U64.pack(len(data)))
        parts.append(data)
        return "gS" if dtype.kind == "S" else "gU"
    if dtype.kind not in _SAFE_KINDS:
        raise _refuse(path, value, f" (dtype {dtype})")
    parts.append(value.tobytes())
    return ("g", dtype.str)


def _encode_bool(value: bool, parts: list[Any], path: str) -> Any:
    parts.append(b"\x01" if value else b"\x00")
    return "b"


def _encode_int(value: int, parts: list[Any], path: str) -> Any:
    if _INT64_MIN <= value <= _INT64_MAX:
        parts.append(_I64.pack(value))
        return "i"
    text = str(value).encode()
    parts.append(_U64.pack(len(text)))
    parts.append(text)
    return "I"


def _encode_float(value: float, parts: list[Any], path: str) -> Any:
    parts.append(_F64.pack(value))
    return "f"


def _encode_bytes(value: bytes, parts: list[Any], path: str) -> Any:
    parts.append(_U64.pack(len(value)))
    parts.append(memoryview(value))  # the element's own bytes, not a copy
    return "y"


def _encode_str(value: str, parts: list[Any], path: str) -> Any:
    data = value.encode("utf-8", "surrogatepass")
    parts.append(_U64.pack(len(data)))
    parts.append(data)
    return "s"


def _encode_none(value: None, parts: list[Any], path: str) -> Any:
    return "n"


def _encode_dict(value: dict[Any, Any], parts: list[Any], path: str) -> Any:
    keys = list(value)
    for key in keys:
        if not isinstance(key, str):
            raise _refuse(f"{path}[{key!r}]", value, " (a dict key that is not a str)")
    return ("d", tuple(keys), tuple([_encode(value[key], parts, f"{path}/{key}") for key in keys]))


def _encode_tuple(value: tuple[Any, ...], parts: list[Any], path: str) -> Any:
    children = tuple([_encode(item, parts, f"{path}/{k}") for k, item in enumerate(value)])
    fields = getattr(value, "_fields", None)
    if fields is None:
        return ("t", children)
    kind = type(value)
    _namedtuples.setdefault((kind.__name__, tuple(fields)), kind)
    return ("N", kind.__name__, tuple(fields), children)


def _encode_list(value: list[Any], parts: list[Any], path: str) -> Any:
    return ("l", tuple([_encode(item, parts, f"{path}/{k}") for k, item in enumerate(value)]))


def _encode_bytearray(value: bytearray, parts: list[Any], path: str) -> Any:
    parts.append(_U64.pack(len(value)))
    parts.append(bytes(value))
    return "Y"


def _encode_complex(value: complex, parts: list[Any], path: str) -> Any:
    parts.append(_C128.pack(value.real, value.imag))
    return "c"


def _encode_array(array: np.ndarray[Any, Any], parts: list[Any], path: str) -> Any:
    dtype = array.dtype
    shape = array.shape
    if dtype.kind == "O":
        flat = array.ravel().tolist()
        if all(isinstance(item, bytes) for item in flat):
            kind, data = "ab", flat
        elif all(isinstance(item, str) for item in flat):
            kind, data = "as", [item.encode("utf-8", "surrogatepass") for item in flat]
        else:
            odd = next(item for item in flat if not isinstance(item, (bytes, str)))
            raise _refuse(
                path, array, f" (an object array holding {type(odd).__name__}, or bytes and "
                "str mixed)"
            )
        parts.append(np.fromiter(map(len, data), dtype="<i8", count=len(data)).tobytes())
        parts.extend(data)
        return (kind, shape)
    if dtype.kind not in _SAFE_KINDS or dtype.fields is not None:
        raise _refuse(path, array, f" (dtype {dtype})")
    if array.ndim and array.flags.c_contiguous:  # a view of its data: no copy
        parts.append(memoryview(array.reshape(-1).view(np.uint8)))  # type: ignore[arg-type]
    else:
        parts.append(np.ascontiguousarray(array).tobytes() if array.ndim else array.tobytes())
    return ("a", dtype.str, shape)


_Encode = Callable[[Any, list[Any], str], Any]

#: What ``_encode`` checks, in order: a value of a subclass takes the first base it
#: matches (``np.float64`` is a float but encodes as a NumPy scalar, ``bool`` before
#: ``int``, a namedtuple as a tuple).
_ENCODE_ORDER: tuple[tuple[type, _Encode], ...] = (
    (np.ndarray, _encode_array),
    (np.generic, _encode_generic),
    (bool, _encode_bool),
    (int, _encode_int),
    (float, _encode_float),
    (bytes, _encode_bytes),
    (str, _encode_str),
    (type(None), _encode_none),
    (dict, _encode_dict),
    (tuple, _encode_tuple),
    (list, _encode_list),
    (bytearray, _encode_bytearray),
    (complex, _encode_complex),
)
#: The same by exact class: one lookup for the values elements are made of.
_ENCODE_EXACT: dict[type, _Encode] = dict(_ENCODE_ORDER)


# --------------------------------------------------------------------------- decoding

# A compiled decoder: (payload, position) -> (value, next position).
_Decoder = Callable[[bytes, int], tuple[Any, int]]
_decoders: dict[bytes, _Decoder] = {}


class _Corrupt(Exception):
    """A payload that does not decode; the caller names the file and offset."""


def decode_element(
    payload: bytes,
    *,
    path: str = "<memory>",
    offset: int | None = None,
    start: int = 0,
    stop: int | None = None,
) -> Any:
    """The element ``payload[start:stop]`` encodes.

    ``start``/``stop`` decode a record inside a larger buffer (a framed record as read
    from its file) without copying it out: arrays are views into ``payload``.
    ``path`` and ``offset`` (of the record holding it) only serve the error a
    malformed payload raises: :class:`~headrace._errors.DataLossError` naming them.
    """
    try:
        stop = len(payload) if stop is None else stop
        size = stop - start
        if size < 4:
            raise _Corrupt(f"{size} bytes, shorter than a skeleton length")
        (length,) = _U32.unpack_from(payload, start)
        end = start + 4 + length
        if end > stop:
            raise _Corrupt(f"skeleton of {length} bytes runs past the payload's {size}")
        skeleton = payload[start + 4 : end]
        decoder = _decoders.get(skeleton)
        if decoder is None:
            decoder = _compile_skeleton(skeleton)
        value, position = decoder(payload, end)
        if position != stop:
            raise _Corrupt(
                f"{stop - position} bytes left after the element"
                if position < stop
                else f"the element runs {position - stop} bytes past its record"
            )
        return value
    except (_Corrupt, ValueError, TypeError, KeyError, IndexError, struct.error) as error:
        where = f"record at offset {offset} in file {path}" if offset is not None else path
        raise DataLossError(
            f"cannot decode the element in the {where}: {error}", path=path, offset=offset
        ) from None


def _compile_skeleton(skeleton: bytes) -> _Decoder:
    try:
        tree = json.loads(skeleton)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise _Corrupt(f"unreadable skeleton ({error})") from None
    decoder = _compile(tree)
    if len(_decoders) >= _MAX_DECODERS:  # ragged data: every shape its own skeleton
        _decoders.clear()
    _decoders[skeleton] = decoder
    return decoder


def _take(payload: bytes, position: int, size: int) -> int:
    end = position + size
    if end > len(payload):
        raise _Corrupt(f"a component of {size} bytes runs past the payload's end")
    return end


def _fixed(unpack: Callable[[bytes, int], tuple[Any, ...]], size: int, wrap: Any) -> _Decoder:
    def decode(payload: bytes, position: int) -> tuple[Any, int]:
        end = _take(payload, position, size)
        return wrap(unpack(payload, position)), end

    return decode


def _sized(convert: Callable[[bytes], Any]) -> _Decoder:
    def decode(payload: bytes, position: int) -> tuple[Any, int]:
        start = _take(payload, position, 8)
        (length,) = _U64.unpack_from(payload, position)
        end = _take(payload, start, length)
        return convert(payload[start:end]), end

    return decode


def _shape(raw: Any) -> tuple[int, ...]:
    if not isinstance(raw, list) or not all(isinstance(d, int) and d >= 0 for d in raw):
        raise _Corrupt(f"bad shape {raw!r}")
    return tuple(raw)


def _dtype(raw: Any) -> np.dtype[Any]:
    if not isinstance(raw, str):
        raise _Corrupt(f"bad dtype {raw!r}")
    dtype = np.dtype(raw)
    if dtype.kind not in _SAFE_KINDS or dtype.fields is not None:
        raise _Corrupt(f"dtype {raw!r} is not one this format writes")
    return dtype


def _compile(tree: Any) -> _Decoder:
    if isinstance(tree, str):
        leaf = _LEAVES.get(tree)
        if leaf is None:
            raise _Corrupt(f"unknown component {tree!r:.60}")
        return leaf
    if not isinstance(tree, list) or not tree:
        raise _Corrupt(f"unknown component {tree!r:.60}")
    container = _CONTAINERS.get(tree[0]) if isinstance(tree[0], str) else None
    if container is None or len(tree) != container[0]:
        raise _Corrupt(f"unknown component {tree!r:.60}")
    return container[1](tree)


def _scalar_decoder(tree: list[Any]) -> _Decoder:
    dtype = _dtype(tree[1])

    def scalar(payload: bytes, position: int) -> tuple[Any, int]:
        end = _take(payload, position, dtype.itemsize)
        return np.frombuffer(payload, dtype, 1, position)[0], end

    return scalar


def _dict_decoder(tree: list[Any]) -> _Decoder:
    keys = tree[1]
    if not isinstance(keys, list):
        raise _Corrupt(f"unknown component {tree!r:.60}")
    if not all(isinstance(key, str) for key in keys):
        raise _Corrupt("dict keys must be str")
    children = _children(tree[2], len(keys))

    def mapping(payload: bytes, position: int) -> tuple[Any, int]:
        out = {}
        for key, child in zip(keys, children):  # noqa: B905 - lengths checked
            out[key], position = child(payload, position)
        return out, position

    return mapping


def _namedtuple_decoder(tree: list[Any]) -> _Decoder:
    name, fields = tree[1], tree[2]
    if not isinstance(name, str) or not isinstance(fields, list):
        raise _Corrupt("bad namedtuple")
    if not all(isinstance(field, str) for field in fields):
        raise _Corrupt("namedtuple fields must be str")
    cls = namedtuple_class(name, tuple(fields))
    children = _children(tree[3], len(fields))
    return _sequence(children, lambda items: cls(*items))


#: The decoders of the leaves a skeleton names by a string (each made once: they keep
#: no state).
_LEAVES: dict[str, _Decoder] = {
    "i": _fixed(_I64.unpack_from, 8, lambda found: found[0]),
    "f": _fixed(_F64.unpack_from, 8, lambda found: found[0]),
    "b": _fixed(lambda payload, at: (payload[at],), 1, lambda found: found[0] != 0),
    "c": _fixed(_C128.unpack_from, 16, lambda found: complex(*found)),
    "n": lambda payload, position: (None, position),
    "y": _sized(bytes),
    "Y": _sized(bytearray),
    "s": _sized(lambda data: data.decode("utf-8", "surrogatepass")),
    "I": _sized(lambda data: int(data.decode("ascii"))),
    "gS": _sized(np.bytes_),
    "gU": _sized(lambda data: np.str_(data.decode("utf-8", "surrogatepass"))),
}

#: The components a skeleton names by a list ``[kind, ...]``: how long that list is,
#: and what compiles it.
_CONTAINERS: dict[str, tuple[int, Callable[[list[Any]], _Decoder]]] = {
    "a": (3, lambda tree: _array_decoder(_dtype(tree[1]), _shape(tree[2]))),
    "g": (2, _scalar_decoder),
    "ab": (2, lambda tree: _object_array_decoder(False, _shape(tree[1]))),
    "as": (2, lambda tree: _object_array_decoder(True, _shape(tree[1]))),
    "d": (3, _dict_decoder),
    "t": (2, lambda tree: _sequence(_children(tree[1], None), tuple)),
    "l": (2, lambda tree: _sequence(_children(tree[1], None), list)),
    "N": (4, _namedtuple_decoder),
}


def namedtuple_class(name: str, fields: tuple[str, ...]) -> Any:
    """The class that wrote these fields in this process, else a plain namedtuple."""
    cls = _namedtuples.get((name, fields))
    if cls is None:
        cls = _namedtuples[(name, fields)] = collections.namedtuple(  # type: ignore[misc]
            name, fields, rename=True
        )
    return cls


def _children(raw: Any, count: int | None) -> list[_Decoder]:
    if not isinstance(raw, list) or (count is not None and len(raw) != count):
        raise _Corrupt("children do not match their container")
    return [_compile(child) for child in raw]


def _sequence(children: list[_Decoder], make: Callable[[list[Any]], Any]) -> _Decoder:
    def decode(payload: bytes, position: int) -> tuple[Any, int]:
        items = []
        for child in children:
            item, position = child(payload, position)
            items.append(item)
        return make(items), position

    return decode


def _array_decoder(dtype: np.dtype[Any], shape: tuple[int, ...]) -> _Decoder:
    count = int(np.prod(shape, dtype=np.int64))
    size = count * dtype.itemsize

    def array(payload: bytes, position: int) -> tuple[Any, int]:
        end = _take(payload, position, size)
        if not dtype.itemsize:  # 'S0' / 'U0': nothing to view
            empty = np.zeros(shape, dtype)
            empty.flags.writeable = False
            return empty, end
        # a read-only view of the record: no copy, and an in-place edit cannot
        # change what a later epoch reads
        return np.frombuffer(payload, dtype, count, position).reshape(shape), end

    return array


def _object_array_decoder(text: bool, shape: tuple[int, ...]) -> _Decoder:
    count = int(np.prod(shape, dtype=np.int64))

    def objects(payload: bytes, position: int) -> tuple[Any, int]:
        start = _take(payload, position, 8 * count)
        lengths = np.frombuffer(payload, "<i8", count, position)
        if count and lengths.min() < 0:
            raise _Corrupt("negative string length")
        end = _take(payload, start, int(lengths.sum()))
        out = np.empty(count, dtype=object)
        at = start
        for k, length in enumerate(lengths.tolist()):
            data = payload[at : at + length]
            out[k] = data.decode("utf-8", "surrogatepass") if text else data
            at += length
        return out.reshape(shape), end

    return objects


# --------------------------------------------------------------------------- specs


def spec_to_json(spec: Any) -> Any:
    """A JSON-able description of a nested element spec (for manifests)."""
    if isinstance(spec, TensorSpec):
        dtype = spec.kind if spec.kind in ("bytes", "str", "none") else spec.dtype.str
        shape = None if spec.shape is None else list(spec.shape)  # None: unknown rank
        return {"spec": [shape, dtype]}
    if isinstance(spec, dict):
        return {"dict": {str(key): spec_to_json(value) for key, value in spec.items()}}
    if isinstance(spec, tuple) and hasattr(spec, "_fields"):
        return {
            "namedtuple": type(spec).__name__,
            "fields": list(spec._fields),
            "items": [spec_to_json(item) for item in spec],
        }
    if isinstance(spec, tuple):
        return {"tuple": [spec_to_json(item) for item in spec]}
    raise ElementSpecError(f"cannot describe element spec component {spec!r}")


#: Nesting a spec may have (what a manifest could hold before Python's recursion does).
MAX_SPEC_DEPTH = 64


def spec_from_json(raw: Any, depth: int = 0) -> Any:
    """The nested element spec :func:`spec_to_json` described.

    Raises ``ValueError`` saying what is wrong for anything else — a missing or
    extra field, a wrong type, a dtype this format never writes, a shape that is not
    a list of sizes, nesting deeper than :data:`MAX_SPEC_DEPTH` — never a bare
    KeyError, TypeError or RecursionError (a manifest is data someone may have
    edited)."""
    if depth > MAX_SPEC_DEPTH:
        raise ValueError(f"element spec nested deeper than {MAX_SPEC_DEPTH} levels")
    if not isinstance(raw, dict) or len(raw) not in (1, 3):
        raise ValueError(f"bad element spec entry {raw!r:.80}")
    if set(raw) == {"spec"}:
        return _tensor_spec_from_json(raw["spec"])
    if set(raw) == {"dict"} and isinstance(raw["dict"], dict):
        return {key: spec_from_json(value, depth + 1) for key, value in raw["dict"].items()}
    if set(raw) == {"tuple"} and isinstance(raw["tuple"], list):
        return tuple(spec_from_json(item, depth + 1) for item in raw["tuple"])
    if set(raw) == {"namedtuple", "fields", "items"}:
        return _namedtuple_spec_from_json(raw, depth)
    raise ValueError(f"bad element spec entry {raw!r:.80}")


def _tensor_spec_from_json(entry: Any) -> TensorSpec:
    """A ``[shape, dtype]`` leaf of :func:`spec_from_json`."""
    if not isinstance(entry, list) or len(entry) != 2:
        raise ValueError(f"bad tensor spec {entry!r:.80}: expected [shape, dtype]")
    shape, dtype = entry
    if shape is not None and not (
        isinstance(shape, list)
        and all(d is None or (type(d) is int and d >= 0) for d in shape)
    ):
        raise ValueError(f"bad shape {shape!r:.80} in the element spec")
    if dtype in ("bytes", "str"):
        return TensorSpec(shape, dtype)
    if dtype == "none":  # a None component (NoneTensorSpec)
        return TensorSpec((), kind="none")
    try:
        return TensorSpec(shape, _dtype(dtype))
    except (_Corrupt, TypeError) as error:
        raise ValueError(f"bad dtype {dtype!r:.40} in the element spec ({error})") from None


def _namedtuple_spec_from_json(raw: dict[str, Any], depth: int) -> Any:
    """A namedtuple entry of :func:`spec_from_json`: its class and its items' specs."""
    name, fields, items = raw["namedtuple"], raw["fields"], raw["items"]
    if not (
        isinstance(name, str)
        and name.isidentifier()
        and isinstance(fields, list)
        and all(isinstance(field, str) for field in fields)
        and isinstance(items, list)
        and len(items) == len(fields)
    ):
        raise ValueError(f"bad namedtuple entry in the element spec {raw!r:.80}")
    cls = namedtuple_class(name, tuple(fields))
    return cls(*(spec_from_json(item, depth + 1) for item in items))

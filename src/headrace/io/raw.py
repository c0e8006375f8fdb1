"""``decode_raw``: the bytes of each string reinterpreted as numbers, as ``tf.io.decode_raw``.

Records often carry an image or a tensor as one BytesList value; this turns a batch of
such values into one ``(batch, n)`` array with a single copy (the values joined), then
a NumPy view. The result is read-only, like the rest of headrace's zero-copy output.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from headrace._errors import InvalidArgumentError

__all__ = ["decode_raw"]

Array = npt.NDArray[Any]

_TF_NAMES = {
    "f2": "half", "f4": "float", "f8": "double", "i1": "int8", "i2": "int16", "i4": "int32",
    "i8": "int64", "u1": "uint8", "u2": "uint16", "u4": "uint32", "u8": "uint64",
    "b1": "bool", "c8": "complex64", "c16": "complex128",
}


def _out_dtype(out_type: Any) -> np.dtype[Any]:
    dtype: np.dtype[Any] | None
    try:
        dtype = np.dtype(getattr(out_type, "as_numpy_dtype", out_type))
    except TypeError:
        dtype = None
    if dtype is None or dtype.kind not in "biufc":
        raise InvalidArgumentError(
            f"decode_raw: out_type must be a numeric dtype (np.uint8, np.float32, ...), "
            f"got {out_type!r}"
        )
    return dtype


def _strings(input_bytes: Any) -> tuple[list[bytes], tuple[int, ...]]:
    if isinstance(input_bytes, bytes | bytearray | memoryview | np.bytes_):
        return [bytes(input_bytes)], ()
    array = np.asarray(input_bytes, dtype=object) if not isinstance(
        input_bytes, np.ndarray
    ) else input_bytes
    if array.dtype.kind not in "OS":
        raise InvalidArgumentError(
            f"decode_raw takes bytes or an array of bytes, got {array.dtype} values"
        )
    flat = array.reshape(-1).tolist()
    for index, item in enumerate(flat):
        if not isinstance(item, bytes | bytearray | memoryview):
            raise InvalidArgumentError(
                f"decode_raw: element {index} is {type(item).__name__}, not bytes"
            )
    return [bytes(item) for item in flat], array.shape


def decode_raw(
    input_bytes: Any,
    out_type: Any,
    little_endian: bool = True,
    fixed_length: int | None = None,
    name: str | None = None,
) -> Array:
    """Reinterpret each string's bytes as ``out_type`` values; adds one dimension.

    ``input_bytes`` is one ``bytes`` (giving a 1-D array) or an array/list of them (shape
    ``S`` gives ``S + (n,)``); every string must have the same length, a multiple of the
    dtype's size, unless ``fixed_length`` is given: then each is cut or zero-padded to
    that many bytes. ``little_endian`` says how the bytes are ordered. Errors are
    :class:`~headrace._errors.InvalidArgumentError` with TensorFlow's wording. ``name`` is
    ignored.
    """
    dtype = _out_dtype(out_type)
    strings, shape = _strings(input_bytes)
    tf_name = _TF_NAMES.get(dtype.str[1:], str(dtype))
    if fixed_length is not None:
        if fixed_length < 0 or fixed_length % dtype.itemsize:
            raise InvalidArgumentError(
                f"fixed_length ({fixed_length}) must be a multiple of the size of out_type "
                f"({dtype.itemsize})"
            )
        strings = [item[:fixed_length].ljust(fixed_length, b"\0") for item in strings]
    length = len(strings[0]) if strings else (fixed_length or 0)
    for index, item in enumerate(strings):
        if len(item) != length:
            raise InvalidArgumentError(
                "DecodeRaw requires input strings to all be the same size, but element "
                f"{index} has size {length} != {len(item)}"
            )
    if length % dtype.itemsize:
        raise InvalidArgumentError(
            f"Input to DecodeRaw has length {length} that is not a multiple of "
            f"{dtype.itemsize}, the size of {tf_name}"
        )
    ordered = dtype.newbyteorder("<" if little_endian else ">")
    values = np.frombuffer(b"".join(strings), dtype=ordered)
    if not ordered.isnative:
        values = values.astype(dtype)
        values.flags.writeable = False
    return values.reshape((*shape, length // dtype.itemsize))

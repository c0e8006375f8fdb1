"""A Python list of rows served as the array it stands for, without stacking it.

``from_tensor_slices([a0, a1, ...])`` means the array ``np.stack([a0, a1, ...])``
(a list is a leaf, as in tf.data). Stacking a list of 300 arrays of 1 MiB makes a
new 300 MiB array the pipeline would hold for as long as the dataset lives, and a
list of ``str`` went through a fixed-width ``<U`` array (4 bytes a character) and a
second copy as UTF-8 ``bytes``. :class:`ListRows` keeps only the user's list: row
``i`` is made from item ``i`` when it is asked for (a read-only view of the user's
array when its dtype is already the list's, a ``str`` encoded then), and a batch is
stacked from the rows it takes. Shapes and dtypes are checked up front, item by
item, so a ragged list is refused as tf.data refuses it, before any data flows.

An array of strings the source would convert (fixed-width ``<U``/``S``, or
``object`` holding ``str`` to encode) is served the same way, row by row from the
user's array: converting it made a second copy of every string.

Lists whose items are numbers (``[1, 2, 3]``, ``[[0.5, 1.5], ...]``) are still
stacked: the array is smaller than the list of Python objects it comes from, and
indexing it is what keeps a list of a million ints as fast as an array.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from headrace._errors import InvalidArgumentError
from headrace._structure import to_leaf_array

__all__ = ["ListRows", "rows_of_list"]


def rows_of_list(value: Any, *, keep_str: bool, what: str) -> ListRows | None:
    """``value`` as :class:`ListRows` where it is a list this serves (of arrays, of
    ``str``/``bytes``, or lists of them); None for anything else (a list of numbers,
    of mixed kinds), which is converted to an array as before."""
    if isinstance(value, np.ndarray):
        return ListRows.of_strings(value, keep_str=keep_str)
    if type(value) is not list or not value:
        return None
    first: Any = value[0]
    while type(first) is list and first:
        first = first[0]
    if isinstance(first, (str, bytes)):
        pass
    elif not (isinstance(first, np.ndarray) and first.ndim >= 1):
        return None
    return ListRows.checked(value, keep_str=keep_str, what=what)


#: What a bytes object costs besides its payload.
_BYTES_HEADER = sys.getsizeof(b"")


def _flat_strings(items: Any) -> Any:
    """The strings of a list of strings, of lists of them, or of an object array."""
    for item in items:
        if isinstance(item, (str, bytes)):
            yield item
        elif isinstance(item, np.ndarray):
            yield from item.ravel().tolist()
        else:
            yield from _flat_strings(item)


def _read_only(array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    view = array.view(type=np.ndarray)
    view.flags.writeable = False
    return view


class ListRows:
    """The rows of a list of equal-shape items, made one at a time (see the module doc).

    It answers as an array would where a source uses one: ``len``, ``shape``,
    ``ndim``, ``dtype``, an int index (one row), a slice or an index array (the
    rows stacked into a new array).
    """

    __slots__ = ("dtype", "encode", "items", "kind", "row_shape")

    def __init__(
        self, items: Any, row_shape: tuple[int, ...], dtype: np.dtype[Any], kind: str,
        encode: bool,
    ) -> None:
        #: The user's list, or array of strings.
        self.items = items
        self.row_shape = row_shape
        self.dtype = dtype
        #: "numeric", "bytes" or "str": what the rows are (bytes and str: object arrays).
        self.kind = kind
        #: Whether ``str`` items come out as UTF-8 ``bytes`` (tf.data's strings).
        self.encode = encode

    @classmethod
    def checked(cls, items: list[Any], *, keep_str: bool, what: str) -> ListRows | None:
        """The rows of ``items`` after checking every item's shape and dtype, or None
        when the items mix kinds this does not serve (numbers among arrays, None):
        those are converted as a whole, as before."""
        shape: tuple[int, ...] | None = None
        dtypes: set[np.dtype[Any]] = set()
        kinds: set[str] = set()
        for index, item in enumerate(items):
            if isinstance(item, str):
                item_shape: tuple[int, ...] = ()
                kinds.add("str")
            elif isinstance(item, bytes):
                item_shape = ()
                kinds.add("bytes")
            else:
                found = _array_item_shape(item, kinds, dtypes)
                if found is None:
                    return None
                item_shape = found
            if shape is None:
                shape = item_shape
            elif item_shape != shape:
                raise InvalidArgumentError(
                    f"{what}: the list's rows differ in shape: row 0 is {shape}, row {index} "
                    f"is {item_shape}; every row of a list needs the same shape (as in "
                    "tf.data): pad them, or give them one at a time with from_generator"
                )
        assert shape is not None
        if len(kinds) != 1:
            return None  # numbers with strings, str with bytes: converted whole, as before
        kind = kinds.pop()
        if kind == "numeric":
            dtype = np.result_type(*dtypes) if len(dtypes) > 1 else dtypes.pop()
            return cls(items, shape, np.dtype(dtype), "numeric", False)
        encode = kind == "str" and not keep_str
        return cls(items, shape, np.dtype(object), "bytes" if encode else kind, encode)

    @classmethod
    def of_strings(cls, array: np.ndarray[Any, Any], *, keep_str: bool) -> ListRows | None:
        """The rows of an array of strings the source would otherwise convert whole
        (``<U``/``S`` into Python objects, ``str`` objects into ``bytes``); None for any
        other array, which is served as it is."""
        if array.ndim == 0 or array.size == 0:
            return None
        kind = array.dtype.kind
        if kind == "U":
            encode = not keep_str
            return cls(array, tuple(array.shape[1:]), np.dtype(object),
                       "bytes" if encode else "str", encode)
        if kind == "S":
            return cls(array, tuple(array.shape[1:]), np.dtype(object), "bytes", False)
        if kind != "O" or keep_str:
            return None
        flat = array.ravel().tolist()
        if not all(isinstance(part, (str, bytes)) for part in flat):
            return None
        if not any(isinstance(part, str) for part in flat):
            return None  # bytes already: served as they are
        return cls(array, tuple(array.shape[1:]), np.dtype(object), "bytes", True)

    # -- what an array answers ---------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.items)

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.items), *self.row_shape)

    @property
    def ndim(self) -> int:
        return 1 + len(self.row_shape)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, (int, np.integer)):
            return self.row(self.items[index])
        if isinstance(index, slice):
            return self.stack(self.items[index])
        items = self.items
        if isinstance(items, np.ndarray):
            return self.stack(items[np.asarray(index, np.intp)])
        return self.stack([items[position] for position in np.asarray(index, np.intp).tolist()])

    def __reduce__(self) -> Any:
        return (ListRows, (self.items, self.row_shape, self.dtype, self.kind, self.encode))

    # -- rows ---------------------------------------------------------------------------------
    def row(self, item: Any) -> Any:
        """The row item ``i`` stands for, as the stacked array's row ``i`` would be."""
        if self.kind == "numeric":
            if type(item) is np.ndarray and item.dtype == self.dtype:
                return _read_only(item)
            return _read_only(np.asarray(to_leaf_array(item), dtype=self.dtype))
        if isinstance(item, (str, bytes)):
            if self.encode and isinstance(item, str):
                return item.encode()
            if type(self.items) is list:
                return item  # the user's own object
            return str(item) if isinstance(item, str) else bytes(item)  # np.str_, np.bytes_
        out = np.empty(self.row_shape, dtype=object)
        source = np.asarray(to_leaf_array(item), dtype=object)
        flat = [part.encode() if self.encode and isinstance(part, str) else part
                for part in source.ravel().tolist()]
        out.reshape(-1)[:] = flat
        out.flags.writeable = False
        return out

    def stack(self, items: Any) -> np.ndarray[Any, Any]:
        """The rows of ``items`` (a list, or part of an array of strings) in one new
        array (a batch), made in one pass."""
        if len(items) == 0:
            return np.empty((0, *self.row_shape), dtype=self.dtype)
        if self.kind == "numeric":
            return np.stack(items, dtype=self.dtype)  # type: ignore[call-overload,no-any-return]
        if not self.row_shape:  # strings (each a str or bytes): one pass in C
            if isinstance(items, np.ndarray):
                items = items.tolist()  # Python str and bytes, as the converted array held
            if not self.encode:
                return np.fromiter(items, object, len(items))
            try:
                return np.fromiter(map(str.encode, items), object, len(items))
            except TypeError:  # bytes among the str: kept as they are
                return np.fromiter((item.encode() if isinstance(item, str) else item
                                    for item in items), object, len(items))
        out = np.empty((len(items), *self.row_shape), dtype=object)
        for position, item in enumerate(items):
            out[position] = self.row(item)
        return out

    def arrays(self) -> list[np.ndarray[Any, Any]]:
        """The user's arrays among the items (rows are views of them: they cost nothing)."""
        if isinstance(self.items, np.ndarray):
            return []  # an array of strings: its rows are new objects, costed as made
        return [item for item in self.items if isinstance(item, np.ndarray)]

    def least_bytes(self) -> int:
        """At least the bytes :meth:`whole` allocates, found without making it: the
        array, and for strings their bytes objects (a ``str``'s UTF-8 has at least one
        byte a character)."""
        count = len(self.items) * int(np.prod(self.row_shape, dtype=np.int64))
        if self.kind == "numeric":
            return count * self.dtype.itemsize
        items = self.items
        if isinstance(items, np.ndarray) and items.dtype.kind in "SU":
            lengths = int(np.char.str_len(items).sum())
        else:
            lengths = sum(len(part) for part in _flat_strings(items))
        return count * (np.dtype(object).itemsize + _BYTES_HEADER) + lengths

    def whole(self) -> np.ndarray[Any, Any]:
        """The array the list stands for (``from_tensors`` of a list: one element)."""
        whole = self.stack(self.items)
        whole.flags.writeable = False
        return whole


def _array_item_shape(item: Any, kinds: set[str], dtypes: set[np.dtype[Any]]
                      ) -> tuple[int, ...] | None:
    """The shape of an array (or nested list) item of a list of rows, noting its kind
    (and dtype) in ``kinds`` and ``dtypes``; None when the list is to be converted as
    a whole, as before: the item is another object, ragged inside, 0-d, or an object
    array of something other than str and bytes."""
    if isinstance(item, np.ndarray) and item.dtype.kind not in "SUO":
        array = item
    elif isinstance(item, (np.ndarray, list)):
        try:
            array = to_leaf_array(item)  # one item's conversion, for its spec
        except ValueError:  # ragged inside: NumPy's error, as before
            return None
    else:
        return None
    shape = tuple(array.shape)
    if not shape:
        return None  # a 0-d array among strings
    if array.dtype.kind == "O":
        flat = array.ravel()
        if not all(isinstance(part, (str, bytes)) for part in flat):
            return None
        kinds.update("str" if isinstance(part, str) else "bytes" for part in flat)
    else:
        kinds.add("numeric")
        dtypes.add(array.dtype)
    return shape

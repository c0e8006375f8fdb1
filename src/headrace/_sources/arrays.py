"""In-memory and memory-mapped sources: tensor slices, tensors, ranges, ``.npy`` files.

Slices are **read-only views**: nothing is copied, and a user's in-place edit
of a batch cannot corrupt the source for the next epoch. A batch of an array
source is one slice (or one gather when shuffled), not N element copies. Memory
the arrays already occupied is never charged to the budget; a memory-mapped
file's pages are file-backed and are not anonymous memory at all.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import xxhash

from headrace._errors import (
    DataLossError,
    ElementSpecError,
    InvalidArgumentError,
    MemoryBudgetError,
    Origin,
)
from headrace._memory.units import format_bytes
from headrace._sources.listrows import ListRows, rows_of_list
from headrace._structure import (
    TensorSpec,
    encode_str,
    flatten,
    leaf_spec,
    pack_as,
    structure_paths,
    to_leaf_array,
)
from headrace.core.fingerprint import array_digest, file_identity, unmemoized_digest
from headrace.core.indexing import RandomAccess
from headrace.core.iterator import Context
from headrace.core.node import SourceNode
from headrace.io.filepool import borrowed_slot
from headrace.io.files import require_regular_file
from headrace.io.mapped import map_file

__all__ = ["RangeNode", "TensorSlicesNode", "TensorsNode", "load_npy"]


def _read_only(leaf: Any) -> Any:
    """A read-only view of an array leaf (the user's array itself stays writable; a
    list's rows are read-only as they are made)."""
    if isinstance(leaf, np.ndarray):
        view = np.asarray(leaf).view(type=np.ndarray)
        view.flags.writeable = False
        return view
    return leaf


def _array_params(leaves: list[Any]) -> tuple[Any, ...]:
    return tuple(
        (type(leaf).__name__, getattr(leaf, "shape", None), str(getattr(leaf, "dtype", "")))
        for leaf in leaves
    )


class SlicesAccess(RandomAccess):
    def __init__(
        self, structure: Any, leaves: list[Any], length: int,
        copies: dict[int, tuple[str, int | None]] | None = None,
    ) -> None:
        self.structure = structure
        self.leaves = leaves
        self.length = length
        self.single = not isinstance(structure, (dict, tuple))
        #: Leaves the source made from the user's data (by position), and what each is.
        self.copies = copies or {}

    def __len__(self) -> int:
        return self.length

    def get(self, index: int) -> Any:
        if self.single:
            return self.leaves[0][index]
        return pack_as(self.structure, [leaf[index] for leaf in self.leaves])

    def get_many(self, indices: range | np.ndarray) -> Any:
        if type(indices) is range and indices.step == 1:
            selector: Any = slice(indices.start, indices.stop)
        else:
            selector = np.asarray(indices, dtype=np.intp)
        if self.single:
            return self.leaves[0][selector]
        return pack_as(self.structure, [leaf[selector] for leaf in self.leaves])

    def origin(self, index: int) -> Origin | None:
        return Origin(None, index)

    def prepare(self, ctx: Context) -> None:
        _register(ctx, self.leaves, self.copies)


def _register(
    ctx: Context, leaves: list[Any], copies: dict[int, tuple[str, int | None]]
) -> None:
    """Mark the user's arrays free, and book the copies the source made of its data."""
    for position, leaf in enumerate(leaves):
        if isinstance(leaf, ListRows):
            for array in leaf.arrays():
                ctx.register_preexisting(array)
        elif position in copies and isinstance(leaf, np.ndarray):
            what, nbytes = copies[position]
            ctx.register_copy(leaf, what, nbytes)
        else:
            ctx.register_preexisting(leaf)


def _copies(
    stage: str, tensors: Any, given: list[Any], leaves: list[Any]
) -> dict[int, tuple[str, int | None]]:
    """The leaves converted into new arrays (a list of numbers stacked, objects
    converted), by position, with how a refusal names them and what they cost (None:
    what they keep alive; an array of the user's own bytes objects: its pointers).
    Everything else is the user's."""
    copies: dict[int, tuple[str, int | None]] = {}
    for position, (path, original, leaf) in enumerate(
            zip(structure_paths(tensors), given, leaves, strict=True)):
        if isinstance(leaf, np.ndarray) and leaf is not original and leaf.base is None:
            pointers = type(original) is list and leaf.dtype == object and all(
                mine is theirs for mine, theirs in zip(leaf.tolist(), original, strict=False))
            copies[position] = (f"{stage}: component {path} (a {type(original).__name__})",
                                leaf.nbytes if pointers else None)
    return copies


class TensorSlicesNode(SourceNode):
    """``Dataset.from_tensor_slices``: element i is the i-th row of every component."""

    stage = "from_tensor_slices"
    shared_capabilities = ("cardinality",)  # (and SourceNode's)

    def names_files(self) -> bool:
        """One column of names (``list_files``): what an interleave may split by file."""
        if len(self.leaves) != 1:
            return False
        leaf = self.leaves[0]
        return leaf.dtype == object and all(isinstance(name, (str, bytes)) for name in leaf[:8])

    def __init__(self, tensors: Any, *, keep_str: bool = False, paths: bool = False) -> None:
        super().__init__()
        self.structure = tensors
        #: Whether the rows are paths of files the pipeline reads (list_files, a reader's
        #: num_parallel_reads): then the files' identities are part of its content.
        self.paths = paths
        # tf.data's strings are bytes: str components come out UTF-8 encoded, except
        # where headrace documents str (list_files' paths pass keep_str). A list of
        # arrays or strings is served row by row, never stacked (see ListRows).
        given = flatten(tensors)
        leaves = [_pointers(_leaf(leaf, keep_str, "from_tensor_slices")) for leaf in given]
        if not leaves:
            raise InvalidArgumentError("from_tensor_slices needs at least one component")
        for path, leaf in zip(structure_paths(tensors), leaves, strict=True):
            if isinstance(leaf, (bytes, str)) or np.ndim(leaf) == 0:
                raise InvalidArgumentError(
                    f"from_tensor_slices: component {path} is a scalar; every component "
                    "needs a first dimension to slice (use from_tensors for one element)"
                )
        sizes = {path: len(leaf) for path, leaf in zip(structure_paths(tensors), leaves, strict=True)}
        if len(set(sizes.values())) > 1:
            listed = ", ".join(f"{path}: {size}" for path, size in sizes.items())
            raise InvalidArgumentError(
                f"from_tensor_slices: components have different first dimensions ({listed}); "
                "all components must have the same number of rows"
            )
        #: Leaves made from the user's data: the recipe holds them, each run books them.
        self.copies = _copies("from_tensor_slices", tensors, given, leaves)
        self.leaves = [_read_only(leaf) for leaf in leaves]
        self.length = len(leaves[0])

    def params(self) -> tuple[Any, ...]:
        return _array_params(self.leaves)

    def content(self) -> tuple[Any, ...]:
        digests = tuple(_digest(leaf) for leaf in self.leaves)
        if not self.paths:
            return digests
        names = [os.fsdecode(name) for leaf in self.leaves for name in _values(leaf)]
        return (*digests, *(file_identity(name) for name in names))

    @property
    def element_spec(self) -> Any:
        return pack_as(
            self.structure,
            [
                TensorSpec(tuple(leaf.shape[1:]), *_dtype_kind(leaf))
                for leaf in self.leaves
            ],
        )

    def cardinality(self) -> int:
        return self.length

    def random_access(self) -> RandomAccess:
        return SlicesAccess(self.structure, self.leaves, self.length, self.copies)


def _dtype_kind(leaf: Any) -> tuple[np.dtype[Any], str]:
    if isinstance(leaf, ListRows):
        return leaf.dtype, leaf.kind
    spec = leaf_spec(leaf[:1] if len(leaf) else leaf)
    return spec.dtype, spec.kind


def _pointers(leaf: Any) -> Any:
    """A list of ``bytes`` as an object array of the user's own bytes objects (made in
    one pass, without the fixed-width ``S`` array NumPy would go through): the new
    memory is one pointer a row, booked as a copy, and a batch is one C gather, as
    fast as before. Other leaves as they are."""
    if (isinstance(leaf, ListRows) and type(leaf.items) is list and leaf.kind == "bytes"
            and not leaf.encode and not leaf.row_shape):
        return np.fromiter(leaf.items, object, len(leaf.items))
    return leaf


def _leaf(value: Any, keep_str: bool, what: str) -> Any:
    """A component as the source serves it: a list of arrays or strings as its rows
    (nothing copied), anything else as an array (str encoded unless ``keep_str``)."""
    rows = rows_of_list(value, keep_str=keep_str, what=what)
    if rows is not None:
        return rows
    try:
        return to_leaf_array(value if keep_str else encode_str(value))
    except ValueError as error:  # NumPy's "inhomogeneous shape": rows of other lengths
        if "inhomogeneous" not in str(error):
            raise
        raise ElementSpecError(
            f"{what}: a nested list whose rows have different lengths cannot be one "
            "tensor (tf.data refuses it too); give arrays of equal shapes, a list of "
            "arrays (served row by row), or a ragged form (Dataset.from_generator, or "
            "padded rows)"
        ) from None


def _values(leaf: Any) -> Any:
    """Every value of a component, flat (a list's or string array's rows as served)."""
    if isinstance(leaf, ListRows):
        return leaf[0:len(leaf)].ravel().tolist()
    return np.asarray(leaf).flat


def _digest(leaf: Any) -> str:
    """What a component holds, for content fingerprints: a list's rows are hashed one
    at a time (its items, or the row made of one where it is converted)."""
    if not isinstance(leaf, ListRows):
        return array_digest(leaf)
    digest = xxhash.xxh3_128(f"rows {leaf.kind} {leaf.dtype.str}{leaf.shape}".encode())
    if isinstance(leaf.items, np.ndarray):  # an array of strings: its own digest
        digest.update(array_digest(leaf.items).encode())
        return digest.hexdigest()
    for item in leaf.items:
        same = type(item) is np.ndarray and item.dtype == leaf.dtype
        row = item if same or isinstance(item, (str, bytes)) else leaf.row(item)
        digest.update(array_digest(row).encode() if same else unmemoized_digest(row).encode())
    return digest.hexdigest()


class TensorsNode(SourceNode):
    """``Dataset.from_tensors``: the whole structure as one element."""

    stage = "from_tensors"

    def __init__(self, tensors: Any) -> None:
        super().__init__()
        self.structure = tensors
        # A list of arrays or strings is kept as the user's list and stacked each time
        # the element is made: the element is that array, but the recipe never holds it.
        given = flatten(tensors)
        leaves = [_leaf(leaf, False, "from_tensors") for leaf in given]
        self.copies = _copies("from_tensors", tensors, given, leaves)
        self.leaves = [_read_only(leaf) for leaf in leaves]

    def params(self) -> tuple[Any, ...]:
        return _array_params(self.leaves)

    def content(self) -> tuple[Any, ...]:
        return tuple(_digest(leaf) for leaf in self.leaves)

    @property
    def element_spec(self) -> Any:
        return pack_as(self.structure, [
            TensorSpec(leaf.shape, leaf.dtype, leaf.kind) if isinstance(leaf, ListRows)
            else leaf_spec(leaf) for leaf in self.leaves
        ])

    def cardinality(self) -> int:
        return 1

    def random_access(self) -> RandomAccess:
        return _TensorsAccess(self.structure, self.leaves, self.copies)


def _boxed(value: Any) -> Any:
    box = np.empty(1, dtype=object)
    box[0] = value
    return box


class _TensorsAccess(RandomAccess):
    """The one element of ``from_tensors``; a list component is stacked each time the
    element is made (see :class:`ListRows`), so only the element holds the array."""

    def __init__(
        self, structure: Any, leaves: list[Any], copies: dict[int, tuple[str, int | None]]
    ) -> None:
        self.structure = structure
        self.leaves = leaves
        self.single = not isinstance(structure, (dict, tuple))
        self.copies = copies
        #: The run's budget total: the element a list is stacked into must fit it.
        self.budget: int | None = None

    def __len__(self) -> int:
        return 1

    def whole(self) -> list[Any]:
        stacked = [
            (path, leaf.least_bytes()) for path, leaf in zip(
                structure_paths(self.structure), self.leaves, strict=True)
            if isinstance(leaf, ListRows)
        ]
        total = sum(nbytes for _, nbytes in stacked)
        if stacked and self.budget is not None and total > self.budget:
            listed = ", ".join(f"{path}: {format_bytes(nbytes)}" for path, nbytes in stacked)
            raise MemoryBudgetError(
                f"from_tensors: its one element stacks the lists it was given into new "
                f"arrays of at least {format_bytes(total)} ({listed}), more than the memory "
                f"budget ({format_bytes(self.budget)}). Use from_tensor_slices for one row "
                "per element, or raise Options(memory_budget=...)"
            )
        return [leaf.whole() if isinstance(leaf, ListRows) else leaf for leaf in self.leaves]

    def get(self, index: int) -> Any:
        if index != 0:
            raise IndexError(index)
        return pack_as(self.structure, self.whole())

    def get_many(self, indices: range | np.ndarray) -> Any:
        count = len(indices)
        if count and (min(indices) != 0 or max(indices) != 0):
            raise IndexError(f"from_tensors has one element (index 0), asked for {indices}")
        leaves = [
            _repeated(np.expand_dims(leaf, 0) if isinstance(leaf, np.ndarray) else _boxed(leaf),
                      count)
            for leaf in self.whole()
        ]
        return pack_as(self.structure, leaves)

    def origin(self, index: int) -> Origin | None:
        return Origin(None, index)

    def prepare(self, ctx: Context) -> None:
        _register(ctx, self.leaves, self.copies)
        self.budget = ctx.budget.stats().total


def _repeated(batched: Any, count: int) -> Any:
    """``count`` copies of a one-row array (the one element, asked for again: a batch
    of ``from_tensors(x).repeat()`` takes index 0 each time)."""
    if count == 1:
        return batched
    return batched[np.zeros(count, dtype=np.intp)]


class _RangeAccess(RandomAccess):
    def __init__(self, start: int, step: int, length: int, dtype: np.dtype[Any]) -> None:
        self.start, self.step, self.length = start, step, length
        self.dtype = dtype
        self.scalar = dtype.type

    def __len__(self) -> int:
        return self.length

    def get(self, index: int) -> Any:
        return self.scalar(self.start + index * self.step)

    def get_many(self, indices: range | np.ndarray) -> Any:
        if isinstance(indices, range):
            values = np.arange(
                self.start + indices.start * self.step,
                self.start + indices.stop * self.step,
                self.step * indices.step,
                dtype=np.int64,
            )[: len(indices)]
        else:
            values = self.start + np.asarray(indices, dtype=np.int64) * self.step
        return values if self.dtype == np.int64 else values.astype(self.dtype)


class RangeNode(SourceNode):
    """``Dataset.range``: int64 scalars, like ``tf.data.Dataset.range``."""

    stage = "range"

    def __init__(
        self, start: int, stop: int | None, step: int, output_type: Any = np.int64
    ) -> None:
        super().__init__()
        spec = TensorSpec((), output_type)
        if spec.kind != "numeric" or spec.dtype.kind not in "iuf":
            raise InvalidArgumentError(
                f"range: output_type must be an integer or float dtype, got {output_type!r}"
            )
        self.dtype = spec.dtype
        if stop is None:
            start, stop = 0, start
        for name, value in (("start", start), ("stop", stop), ("step", step)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise InvalidArgumentError(f"range: {name} must be an int, got {value!r}")
        if step == 0:
            raise InvalidArgumentError("range: step must not be zero")
        self.start, self.stop, self.step = int(start), int(stop), int(step)
        self.length = len(range(self.start, self.stop, self.step))

    def params(self) -> tuple[Any, ...]:
        return (self.start, self.stop, self.step, str(self.dtype))

    @property
    def element_spec(self) -> Any:
        return TensorSpec((), self.dtype)

    def cardinality(self) -> int:
        return self.length

    def random_access(self) -> RandomAccess:
        return _RangeAccess(self.start, self.step, self.length, self.dtype)


def _npy_header(path: str) -> tuple[tuple[int, ...], bool, np.dtype[Any], int]:
    """Shape, dtype and data offset of a ``.npy`` file, read and checked before mapping
    it, so a corrupt or truncated file is named as such: NumPy alone says "contains
    pickled data" for any file without the magic, "mmap length is greater than file
    size" for a short one."""
    fmt = np.lib.format
    size = require_regular_file(path, "from_npy").st_size
    with open(path, "rb") as file:
        try:
            version = fmt.read_magic(file)
        except ValueError:
            raise DataLossError(
                f"from_npy: {path} is not a .npy file (it does not start with the .npy "
                "magic bytes)", path=path, offset=0
            ) from None
        try:
            read = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
            shape, fortran, dtype = read(file)
        except ValueError as error:
            raise DataLossError(
                f"from_npy: {path} has a corrupt or truncated .npy header: {error}",
                path=path, offset=file.tell(),
            ) from None
        offset = file.tell()
    if dtype.hasobject:
        raise InvalidArgumentError(
            f"from_npy: cannot memory-map {path}: it holds Python objects ({dtype}), "
            "which are pickled, not stored as bytes"
        )
    needed = offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if size < needed:
        raise DataLossError(
            f"from_npy: {path} is truncated: its header says {shape} {dtype} "
            f"({needed:,} bytes with the header), the file has {size:,}",
            path=path, offset=size,
        )
    return shape, bool(fortran), dtype, offset


def load_npy(path: str | os.PathLike[str]) -> np.ndarray[Any, Any]:
    """Memory-map a ``.npy`` file read-only: its pages stay file-backed, never anonymous.

    A path that is not a regular file, a file that is not ``.npy``, a corrupt header or
    a truncated file raise (``InvalidArgumentError``, ``DataLossError``) naming it.
    The mapping keeps no descriptor open (see :mod:`headrace.io.mapped`): an interleave
    over many ``.npy`` files holds none per slot, and the header read and the mapping
    each open the file for a moment on a file-pool slot, so they count against
    ``max_open_files`` too (G2).
    """
    name = os.fspath(path)
    with borrowed_slot():
        shape, fortran, dtype, offset = _npy_header(name)
    if not shape:
        raise InvalidArgumentError(f"from_npy: {path} holds a scalar; nothing to slice")
    try:
        with borrowed_slot():
            mapping = map_file(name)
        array: np.ndarray[Any, Any] = np.ndarray(
            shape, dtype, buffer=np.asarray(mapping), offset=offset,
            order="F" if fortran else "C",
        )
        return array
    except (OSError, ValueError, TypeError) as error:
        raise InvalidArgumentError(f"from_npy: cannot memory-map {path}: {error}") from error

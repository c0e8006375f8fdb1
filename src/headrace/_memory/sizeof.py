"""What an element really costs in memory, and making elements cost what they show.

``sys.getsizeof`` of an ndarray view is ~112 bytes, whatever it points at.
``arr.nbytes`` ignores Python object overhead: an 8-byte int costs ~28 bytes.
The budget needs the truth, so costs are *owner-based*:

* An array that owns its data costs ``nbytes`` plus its header.
* A view keeps its owning buffer alive, so it costs the **owner's** bytes. It
  counts once per element, however many views of it the element holds (the
  columns of one batch, ``x`` and ``x[0]``).
* Two owners are not the pipeline's to cap: one that predates the iteration
  (the user's array, registered by the sources) and a file-backed one (a
  memory-map). A view of either costs its header.
* Containers are costed deeply, with a cycle guard: list, tuple, dict keys and
  values, set, an object's ``__dict__`` and ``__slots__`` (dataclasses too).
* A function costs what its closure cells, defaults, attributes and code
  constants hold, not its globals. A bound method costs its object.
* A generator or coroutine costs what its suspended frame holds: its locals and
  the loop iterators on its stack.
* A built-in iterator costs what its ``__reduce__`` names: a list iterator its
  list, a dict or set iterator the items it has left, ``zip`` or ``map`` their
  iterators and function. ``itertools`` objects and ``operator.itemgetter`` & co
  are costed the same way.
* An exception also costs its ``args``, cause, context and group members: an
  error a stage holds for its turn keeps them alive.
* A ``memoryview`` costs the buffer it exposes; an object array, its items.
* A slice costs its bounds. A built-in bound method (``a.sum``) costs its
  ``__self__``, unless that is a module. ``property``, ``staticmethod`` and
  ``classmethod`` cost their functions; ``ndarray.flat``, its array.
* A class made at run time costs its own ``__dict__`` (not its bases', not a
  built-in type's).
* Another framework's array costs its ``nbytes``: ``jax.Array``, or any object
  with an ``nbytes`` that exports ``__dlpack__`` or ``__array__``. No framework
  is imported for this.
* Types registered with :func:`register_sizer` use their sizer. Built-in sizers
  cover torch tensors, PIL images and pyarrow arrays, tables and buffers; each
  is installed only once its library is imported.
* Anything else costs ``sys.getsizeof``, with one warning per type name.

Costing one element takes bounded time. A container of more than
:data:`SAMPLE_ITEMS` items is costed from its first items and extrapolated,
deterministically. So a list of a million objects costs microseconds to book,
not seconds.

A view that pins a much larger owner is a problem all the same:
``big_temp[0]`` returned by a map, or one row of an unbatched batch. A buffer
of such views costs, and holds, far more than the rows it shows. So a
buffering stage calls :func:`admit` before it keeps an element. ``admit``
*compacts* such views: it copies the rows out, so the large owner is freed as
soon as the producer drops it. It returns the element with its cost. Views of
memory that predates the iteration are never copied.
"""

from __future__ import annotations

import collections
import ctypes
import datetime
import decimal
import functools
import gc
import mmap
import sys
import threading
import types
from collections.abc import Callable, ItemsView, Iterable, KeysView, Mapping, ValuesView
from typing import Any

import numpy as np

from headrace._errors import ElementSpecError, HeadraceWarning
from headrace._memory.allocator import pooled_storage
from headrace._memory.units import is_byte_count
from headrace._warn import warn_user
from headrace.io.columns import bytes_total
from headrace.io.mapped import is_file_backed

__all__ = [
    "ARRAY_HEADER_BYTES",
    "FLAT_TYPES",
    "SAMPLE_ITEMS",
    "admit",
    "owner_of",
    "register_sizer",
    "sizeof",
]

#: What a bytes object costs besides its payload (33 B on CPython 3.11).
_BYTES_HEADER = sys.getsizeof(b"")

#: Leaf objects whose cost is exactly ``sys.getsizeof`` (a Decimal's counts its digits:
#: from_sql hands out exact numerics as Decimal).
_FLAT_TYPES = frozenset(
    {bytes, str, int, float, bool, complex, type(None), bytearray, range, type(...),
     decimal.Decimal}
    | {type(t(0)) for t in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
                            np.uint32, np.uint64, np.float16, np.float32, np.float64,
                            np.bool_, np.complex64, np.complex128)}
)
#: The same, for a hot loop that costs its scalars inline (``sys.getsizeof`` is exactly
#: what :func:`sizeof` and :func:`admit` give them).
FLAT_TYPES = _FLAT_TYPES

#: What an ndarray object costs besides its data (measured: 112 B on CPython 3.11).
ARRAY_HEADER_BYTES = sys.getsizeof(np.empty(0))

#: Items of one container costed one by one; past this the rest is extrapolated.
SAMPLE_ITEMS = 1024

#: A view is copied out by :func:`admit` when its owner is more than this many times
#: its own size, and the copy saves at least :data:`_COMPACT_MIN_SAVING` bytes.
_COMPACT_RATIO = 2
_COMPACT_MIN_SAVING = 64 << 10

Sizer = Callable[[Any], int]
_sizers: dict[type, Sizer] = {}
_sizers_lock = threading.Lock()
_warned: set[str] = set()


def register_sizer(cls: type, sizer: Sizer) -> None:
    """Tell the budget what objects of ``cls`` (and its subclasses) cost, in bytes.

    Why: the budget can only cap what it can measure. headrace sizes NumPy,
    Python containers and objects, and (once imported) torch, PIL and pyarrow;
    a type from another library that keeps its payload outside the Python
    heap (a C buffer, a GPU-staged tensor) is invisible to ``sys.getsizeof``.
    ``sizer(obj)`` returns the bytes ``obj`` keeps alive, payload included.
    """
    if not isinstance(cls, type):
        raise TypeError(f"register_sizer: cls must be a type, got {cls!r}")
    if not callable(sizer):
        raise TypeError(f"register_sizer: sizer must be callable, got {sizer!r}")
    with _sizers_lock:
        _sizers[cls] = sizer
        _lookup_cache.clear()


def _sized(sizer: Sizer, value: Any) -> int:
    """What a registered sizer says ``value`` costs: a whole number of bytes, at least 0
    (a negative one would credit the budget with every element)."""
    size = sizer(value)
    if not is_byte_count(size):
        name = getattr(sizer, "__qualname__", repr(sizer))
        raise TypeError(
            f"the sizer registered for {type(value).__module__}.{type(value).__qualname__} "
            f"({name}) returned {size!r}: it must return the bytes the object keeps alive, "
            "a finite number of at least 0 (see headrace.register_sizer)")
    return int(size)


# -- sizers for libraries headrace does not depend on, installed when they are imported --


def _torch_sizer(tensor: Any) -> int:
    storage = tensor.untyped_storage()
    return int(sys.getsizeof(tensor) + storage.nbytes())


def _pil_sizer(image: Any) -> int:
    bands = len(image.getbands())
    bytes_per_band = 4 if image.mode in ("I", "F", "I;32") else 2 if image.mode.startswith("I;16") else 1
    return int(sys.getsizeof(image) + image.width * image.height * bands * bytes_per_band)


def _arrow_sizer(value: Any) -> int:
    getter = getattr(value, "get_total_buffer_size", None)
    nbytes = getter() if getter is not None else getattr(value, "size", 0)
    # The object's own header: pyarrow's __sizeof__ (so sys.getsizeof) already adds the
    # buffers of arrays and tables (not of a Buffer), which would count them twice.
    return int(object.__sizeof__(value) + nbytes)


def _install_optional() -> None:
    """Register the optional libraries' sizers for those already imported (cheap to repeat)."""
    torch = sys.modules.get("torch")
    if torch is not None and getattr(torch, "Tensor", None) is not None:
        _sizers.setdefault(torch.Tensor, _torch_sizer)
    image = sys.modules.get("PIL.Image")
    if image is not None and getattr(image, "Image", None) is not None:
        _sizers.setdefault(image.Image, _pil_sizer)
    arrow = sys.modules.get("pyarrow")
    if arrow is not None:
        for name in ("Array", "ChunkedArray", "RecordBatch", "Table", "Buffer"):
            cls = getattr(arrow, name, None)
            if isinstance(cls, type):
                _sizers.setdefault(cls, _arrow_sizer)


_lookup_cache: dict[type, Sizer | None] = {}


def _sizer_for(cls: type) -> Sizer | None:
    try:
        return _lookup_cache[cls]
    except KeyError:
        pass
    with _sizers_lock:
        _install_optional()
        found = next((_sizers[base] for base in cls.__mro__ if base in _sizers), None)
        # Only cache hits, and misses of types whose library cannot register later.
        if found is not None or cls.__module__.split(".")[0] not in ("torch", "PIL", "pyarrow"):
            _lookup_cache[cls] = found
        return found


def _warn_unsized(cls: type) -> None:
    name = f"{cls.__module__}.{cls.__qualname__}"
    if name in _warned:
        return
    _warned.add(name)
    warn_user(
        f"headrace cannot see inside {name} objects: they are booked at sys.getsizeof "
        "(their Python header), which misses any payload they keep outside it. "
        "Tell the budget their real size with headrace.register_sizer(type, fn).",
        HeadraceWarning,
    )


def owner_of(array: np.ndarray[Any, Any]) -> object:
    """The object that owns the memory a (possibly nested) view points at."""
    base: object = array
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    return base


_CAPSULE = type(datetime.datetime_CAPI)


def _costed_owner(array: np.ndarray[Any, Any]) -> object:
    """What a view is costed by: its owner, or where the owner is an opaque capsule (a C
    library's buffer handed to NumPy: pyarrow's converted columns) the outermost array
    over it, which spans the buffer the capsule keeps alive."""
    base: object = array
    outermost = array
    while isinstance(base, np.ndarray) and base.base is not None:
        outermost = base
        base = base.base
    return outermost if type(base) is _CAPSULE else base


def _is_file_backed(owner: object) -> bool:
    return is_file_backed(owner)


class _Costing:
    """One element's costing: owners and objects seen once, views worth compacting found."""

    __slots__ = ("compactable", "made", "preexisting", "seen")

    def __init__(self, preexisting: frozenset[int] | set[int]) -> None:
        self.preexisting = preexisting
        self.seen: set[int] = set()
        self.compactable = False
        #: Objects made while costing (what ``__reduce__`` returned), kept alive until the
        #: costing ends: their ids are in ``seen``, and a freed id may be reused.
        self.made: list[Any] | None = None

    def owner_cost(self, owner: object) -> int:
        """Bytes of a view's owner, the first time this element refers to it."""
        key = id(owner)
        if key in self.seen or key in self.preexisting or _is_file_backed(owner):
            return 0
        self.seen.add(key)
        if isinstance(owner, np.ndarray):
            return ARRAY_HEADER_BYTES + owner.nbytes + self.object_items(owner)
        if isinstance(owner, (bytes, bytearray)):
            return sys.getsizeof(owner)
        pooled = pooled_storage(owner)
        if pooled is not None:  # a pooled batch: its memory (the pool is not its cost)
            return ARRAY_HEADER_BYTES + pooled.nbytes
        try:
            with memoryview(owner) as view:  # type: ignore[arg-type]
                return sys.getsizeof(owner) + view.nbytes
        except TypeError:
            # Not a buffer (a pyarrow ChunkedArray behind a zero-copy column, a torch
            # tensor): costed as an object. `cost` skips what `seen` holds, so the mark
            # set above must go first, or the owner would cost nothing.
            self.seen.discard(key)
            return self.cost(owner)

    def object_items(self, array: np.ndarray[Any, Any]) -> int:
        if not array.dtype.hasobject:
            return 0
        items = array.ravel().tolist()
        # A batch of records: getsizeof(b) is len(b) + a fixed header, summed in one C
        # pass (a generator over the items cost ~0.1 us each, as much as parsing them).
        total = bytes_total(items)
        if total >= 0:
            return total + _BYTES_HEADER * len(items)
        if set(map(type, items)) <= _FLAT_TYPES:
            return sum(map(sys.getsizeof, items))
        return self.items_cost(items)

    def array_cost(self, array: np.ndarray[Any, Any]) -> int:
        if array.base is None:
            owned = self.owner_cost(array)
            return owned if owned else ARRAY_HEADER_BYTES  # seen already, or the user's
        owned = self.owner_cost(_costed_owner(array))
        if owned > _COMPACT_RATIO * array.nbytes + _COMPACT_MIN_SAVING:
            self.compactable = True
        return ARRAY_HEADER_BYTES + owned

    def items_cost(self, items: Any) -> int:
        """The items of a container: one by one, or from a sample when there are many."""
        count = len(items)
        if count <= SAMPLE_ITEMS:
            return sum(self.cost(item) for item in items)
        sample = 0
        for position, item in enumerate(items):
            if position == SAMPLE_ITEMS:
                break
            sample += self.cost(item)
        return sample * count // SAMPLE_ITEMS

    def cost(self, value: Any) -> int:
        cls = type(value)
        if cls is np.ndarray:
            return self.array_cost(value)
        if cls in _FLAT_TYPES:
            return sys.getsizeof(value)
        key = id(value)
        if key in self.seen:
            return 0  # the same object twice in one element (or a cycle): counted once
        self.seen.add(key)
        if cls is dict or cls is tuple or cls is list:
            own = sys.getsizeof(value)
            if cls is dict:
                return own + self.items_cost(value.keys()) + self.items_cost(value.values())
            return own + self.items_cost(value)
        return self.cost_other(value, cls)

    def cost_other(self, value: Any, cls: type) -> int:
        """Anything but a plain dict, list, tuple, array or flat value: the checks run
        in a fixed order, since a subclass may match several."""
        if isinstance(value, np.ndarray):  # subclasses: memmap, masked arrays
            self.seen.discard(id(value))
            return self.array_cost(value)
        if isinstance(value, np.generic):
            return sys.getsizeof(value)
        sizer = _sizer_for(cls)
        if sizer is not None:
            return _sized(sizer, value)
        for kinds, part_cost in _BY_KIND:
            if isinstance(value, kinds):
                return sys.getsizeof(value) + part_cost(self, value)
        parts = self.runtime_parts(value, cls)
        if parts is not None:
            return sys.getsizeof(value) + parts
        nbytes = None if cls in _PLAIN_CLASSES else _framework_nbytes(value, cls)
        if nbytes is not None:
            # Its own attributes may hold more than its data says (a frame's object
            # columns): the larger of the two, never both (they may be the same memory).
            attributes = getattr(value, "__dict__", None)
            if isinstance(attributes, dict) and attributes:
                nbytes = max(nbytes, self.cost(attributes))
            return sys.getsizeof(value) + nbytes
        return self.object_cost(value, cls)

    def memoryview_parts(self, value: memoryview) -> int:
        return self.owner_cost(value.obj) if value.obj is not None else value.nbytes

    def mapping_parts(self, value: Mapping[Any, Any]) -> int:
        return self.items_cost(list(value.keys())) + self.items_cost(list(value.values()))

    def sequence_parts(self, value: Any) -> int:
        return self.items_cost(value)

    def listed_parts(self, value: Any) -> int:
        return self.items_cost(list(value))

    def view_parts(self, value: Any) -> int:
        """A dict view keeps its dict alive."""
        mapping = getattr(value, "mapping", getattr(value, "_mapping", None))
        return self.cost(mapping) if mapping is not None else self.items_cost(list(value))

    def partial_parts(self, value: functools.partial[Any]) -> int:
        return self.items_cost([value.func, value.args, value.keywords])

    def set_parts(self, value: set[Any] | frozenset[Any]) -> int:
        # A set's order follows str/bytes hash randomization, so a sample of it would
        # cost differently in each process (and shares, and orders, would follow):
        # sets of flat values are summed whole, at C speed.
        if all(type(item) in _FLAT_TYPES for item in value):
            return sum(map(sys.getsizeof, value))
        return self.items_cost(list(value))

    def runtime_parts(self, value: Any, cls: type) -> int | None:
        """What functions, methods, cells, suspended frames, built-in iterators and the
        built-in holders keep alive besides their header; None for other objects. A
        user's class found to be none of these is remembered as plain."""
        if cls is types.FunctionType:
            return self.function_parts(value)
        if cls is types.MethodType:
            return self.cost(value.__self__) + self.cost(value.__func__)
        if cls is types.CellType:
            return self.cell_contents(value)
        if cls in _SUSPENDABLE:
            return self.suspended_parts(value)
        if cls in _ITERATORS or (cls.__module__ in _REDUCED_MODULES and (
                hasattr(cls, "__next__") or cls.__module__ != "builtins")):
            # built-in iterators, itertools objects, operator.itemgetter & co
            return self.iterator_parts(value)
        if cls in _PLAIN_CLASSES:  # (a user's class: known after its first object)
            return None
        extra = self.held_by_builtin(value, cls)
        if extra is None and not (hasattr(cls, "__dlpack__") or hasattr(cls, "__array__")):
            if len(_PLAIN_CLASSES) >= 4096:  # classes made per element: not kept
                _PLAIN_CLASSES.clear()
            _PLAIN_CLASSES.add(cls)
        return extra

    def object_cost(self, value: Any, cls: type) -> int:
        """Any other object: its exception parts, ``__dict__`` and slots; a class with
        none of these warns once that its size is unknown."""
        total = sys.getsizeof(value)
        known = False
        if isinstance(value, BaseException):
            known = True
            total += self.exception_parts(value)
        attributes = getattr(value, "__dict__", None)
        if isinstance(attributes, dict):
            known = True
            total += self.cost(attributes)
        for klass in cls.__mro__:
            slots = klass.__dict__.get("__slots__")
            if slots is None:
                continue
            known = True
            total += self.slots_cost(value, (slots,) if isinstance(slots, str) else slots)
        if not known and not callable(value):
            _warn_unsized(cls)
        return total

    def slots_cost(self, value: Any, slots: Iterable[str]) -> int:
        return sum(self.cost(getattr(value, slot)) for slot in slots
                   if slot not in ("__dict__", "__weakref__") and hasattr(value, slot))

    def held_by_builtin(self, value: Any, cls: type) -> int | None:
        """What the built-in holders keep alive besides their header, or None for other
        objects: a slice its bounds, a built-in bound method (``a.sum``) its object (not a
        module: ``len``), ``property`` its accessors, ``staticmethod``/``classmethod`` their
        function, ``ndarray.flat`` its array, a code object its constants, a class made
        at run time its own ``__dict__`` (not its bases', not a built-in type's)."""
        if cls is slice:
            return self.cost(value.start) + self.cost(value.stop) + self.cost(value.step)
        if cls in _BOUND_BUILTINS:
            owner = value.__self__
            return 0 if owner is None or type(owner) is types.ModuleType else self.cost(owner)
        if cls in _DESCRIPTORS:
            return 0
        if isinstance(value, property):
            return sum(self.cost(part) for part in (value.fget, value.fset, value.fdel)
                       if part is not None)
        if isinstance(value, (staticmethod, classmethod)):
            return self.cost(value.__func__) + self.cost(value.__dict__)
        if cls is _FLATITER:
            return self.cost(value.base)
        if cls is types.CodeType:
            return self.cost(value.co_consts)
        if isinstance(value, type):
            if not value.__flags__ & _HEAPTYPE or value.__module__ == "builtins":
                return 0
            return self.cost(value.__dict__)
        return None

    def function_parts(self, function: types.FunctionType) -> int:
        """What a function keeps alive of its own: its closure cells' values, its default
        values, its attributes and its code's constants (a big literal in exec'd
        source). Its globals are its module's, shared by every function of it, and not
        counted."""
        total = 0
        for cell in function.__closure__ or ():
            if id(cell) not in self.seen:
                self.seen.add(id(cell))
                total += self.cell_contents(cell)
        if function.__defaults__:
            total += self.cost(function.__defaults__)
        if function.__kwdefaults__:
            total += self.cost(function.__kwdefaults__)
        attributes = function.__dict__
        if attributes:
            total += self.cost(attributes)
        if function.__code__.co_consts:  # a constant built into its code (exec'd source)
            total += self.cost(function.__code__)
        return total

    def cell_contents(self, cell: types.CellType) -> int:
        try:
            contents = cell.cell_contents
        except ValueError:  # an empty cell (a variable not yet bound)
            return 0
        return self.cost(contents)

    def suspended_parts(self, value: Any) -> int:
        """What a generator, coroutine or async generator keeps alive: the objects its
        suspended frame refers to (its locals, the iterators of its loops on the
        stack, its function's closure), found without touching the frame (reading
        ``f_locals`` would store a snapshot of them on it). Its code is not counted;
        a finished one holds nothing."""
        total = 0
        for referent in gc.get_referents(value):
            if type(referent) in _NOT_HELD:
                continue
            total += self.cost(referent)
        return total

    def iterator_parts(self, iterator: Any) -> int:
        """What a built-in iterator keeps alive, as ``__reduce__`` names it: a list or
        tuple iterator its container (all of it, until it is exhausted), a dict or
        set iterator the items it has left (in a new list), ``zip``/``map``/
        ``enumerate`` their iterators and function. The positions are ints."""
        try:
            reduced = iterator.__reduce__()
        except Exception:  # one that cannot say what it holds costs its header
            return 0
        if not isinstance(reduced, tuple) or len(reduced) < 2 or type(reduced[1]) is not tuple:
            return 0
        if self.made is None:
            self.made = []
        self.made.append(reduced)
        total = sum(self.cost(part) for part in reduced[1])
        if len(reduced) > 2 and reduced[2] is not None:  # state: what a cycle has saved
            total += self.cost(reduced[2])
        return total

    def exception_parts(self, error: BaseException) -> int:
        """What an exception keeps alive besides its ``__dict__``: its ``args``, its
        cause and context, and a group's members. A stage that holds an error for its
        turn holds all of these (a user's exception may carry the rows it refused).
        Its traceback is not counted: a held error has its frames dropped first
        (:func:`headrace.core.handoff.unpin`)."""
        total = self.cost(error.args)
        for linked in (error.__cause__, error.__context__):
            if linked is not None:
                total += self.cost(linked)
        members = getattr(error, "exceptions", None)  # an ExceptionGroup's
        if isinstance(members, tuple):
            total += self.cost(members)
        return total


#: What a suspended generator refers to without holding it for its elements: its code
#: (and the frame object, whose contents are visited as the generator's own).
#: ``_Costing.cost_other``'s kinds, in the order they are checked (a subclass may
#: match several: an IntEnum is an int, a namedtuple a tuple): what each keeps alive
#: besides its header.
_BY_KIND: tuple[tuple[type | tuple[type, ...], Callable[[_Costing, Any], int]], ...] = (
    (memoryview, _Costing.memoryview_parts),
    (Mapping, _Costing.mapping_parts),
    ((tuple, list), _Costing.sequence_parts),  # subclasses (namedtuples, ...)
    (collections.deque, _Costing.listed_parts),
    ((KeysView, ValuesView, ItemsView), _Costing.view_parts),
    (functools.partial, _Costing.partial_parts),
    (mmap.mmap, lambda _costing, value: _anonymous_bytes(value)),
    ((ctypes.Array, ctypes.Structure, ctypes.Union), lambda _costing, value: ctypes.sizeof(value)),
    ((set, frozenset), _Costing.set_parts),
    ((str, bytes, int, float), lambda _costing, _value: 0),  # subclasses of the flat types
)

_NOT_HELD = frozenset({types.CodeType, types.FrameType, types.ModuleType})

#: Modules whose C objects say what they hold by ``__reduce__`` (iterators, itertools,
#: ``operator.itemgetter``/``attrgetter``/``methodcaller``).
_REDUCED_MODULES = frozenset({"builtins", "itertools", "operator"})

#: Bound methods of C code (``a.sum``, ``b.decode``, ``a.__add__``): they keep ``__self__``.
_BOUND_BUILTINS = frozenset({types.BuiltinMethodType, types.MethodWrapperType})

#: Descriptors of C types' members: they hold nothing of an element's.
_DESCRIPTORS = frozenset({types.GetSetDescriptorType, types.MemberDescriptorType,
                          types.WrapperDescriptorType, types.MethodDescriptorType,
                          types.ClassMethodDescriptorType})

_FLATITER = type(np.empty(0).flat)

#: Classes of none of the kinds :meth:`_Costing.held_by_builtin` and
#: :func:`_framework_nbytes` cost (decided by the class alone): skipped at once.
_PLAIN_CLASSES: set[type] = set()
_HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class made at run time (not a built-in one)


def _framework_nbytes(value: Any, cls: type) -> int | None:
    """The bytes of another framework's array (a ``jax.Array``, a CuPy or TensorFlow
    array): an object with a whole ``nbytes`` that exports its data (``__dlpack__`` or
    ``__array__``). Found by what it offers, so no framework is imported to check."""
    if not (hasattr(cls, "__dlpack__") or hasattr(cls, "__array__")):
        return None
    try:
        nbytes = value.nbytes
    except Exception:  # a deleted or donated array
        return None
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or nbytes < 0:
        return None
    return int(nbytes)


_SUSPENDABLE = frozenset({types.GeneratorType, types.CoroutineType, types.AsyncGeneratorType})

#: Built-in iterators (one of the ``builtins`` module with ``__next__`` is one as well).
_ITERATOR_SAMPLES: tuple[Any, ...] = (
    iter([]), iter(()), reversed([]), iter({}), iter({}.values()), iter({}.items()),
    reversed({}), iter(set()), iter(range(0)), iter(""), iter(b""), iter(bytearray()),
)
_ITERATORS: frozenset[type] = frozenset(type(each) for each in _ITERATOR_SAMPLES)


def _anonymous_bytes(mapping: mmap.mmap) -> int:
    """The bytes of an anonymous mapping (a file's pages are the page cache's: 0)."""
    try:
        mapping.size()  # a file's size; an anonymous mapping has no file (EBADF)
    except OSError:
        return len(mapping)
    except ValueError:  # closed
        return 0
    return 0


def sizeof(element: Any, preexisting: frozenset[int] | set[int] = frozenset()) -> int:
    """Bytes ``element`` keeps alive, as the budget charges them.

    ``preexisting`` holds the ``id`` of owning buffers that existed before the
    iteration started (registered by the sources); views into them are free.
    """
    fast = _plain_cost(element, preexisting)
    if fast is not None:
        return fast
    return _walk(_Costing(preexisting), element)


def _walk(costing: _Costing, element: Any) -> int:
    """``costing.cost(element)``; an element nested past the interpreter's recursion
    limit is a clear error of that element, not a bare RecursionError from here."""
    try:
        return costing.cost(element)
    except RecursionError:
        raise ElementSpecError(
            f"headrace cannot cost this element of {type(element).__name__}: it is nested "
            f"more than about {sys.getrecursionlimit()} containers deep. Flatten it (an "
            f"array, or a few levels of lists and dicts), or register a sizer for its "
            f"type (headrace.register_sizer)"
        ) from None


def _plain_cost(element: Any, preexisting: frozenset[int] | set[int]) -> int | None:
    """The cost of the commonest elements without the general walk (which is ~0.5 us of
    per-element overhead, and several us for a batch of columns); exactly what the walk
    gives them, or None for anything else: a plain array (:func:`plain_array`) or a
    dict of them under ``str`` keys (a parsed batch), or a number, string or ``bytes``
    (a map's scalar outputs: the walk's own first case, without building a walk)."""
    cls = type(element)
    if cls in _FLAT_TYPES:
        return sys.getsizeof(element)
    if cls is not dict:
        plain = plain_array(element, preexisting)
        return None if plain is None else plain[0]
    # The walk samples larger dicts, and counts an owner met twice once: those go to it.
    if len(element) > SAMPLE_ITEMS:
        return None
    total = sys.getsizeof(element)
    owners = set()
    for key, value in element.items():
        plain = plain_array(value, preexisting) if type(key) is str else None
        if plain is None:
            return None
        cost, owner = plain
        if owner:
            if owner in owners:
                return None
            owners.add(owner)
        total += sys.getsizeof(key) + cost
    return total


def plain_array(element: Any, preexisting: frozenset[int] | set[int]) -> tuple[int, int] | None:
    """``(cost, id of the owner it counts or 0)`` of an array of the commonest kinds, as
    :meth:`_Costing.array_cost` gives it; None for anything else.

    An array owning its data (numeric, or ``bytes`` objects: its bytes and theirs); a
    view of memory that predates the run or is file-backed (a batch or row sliced from
    the user's array: its header only, since the owner costs nothing and such a view
    is never worth compacting); a view of an array or buffer not much larger than
    itself (a parsed column reshapes its array, or views the parser's bytearray; an
    array received from a worker process views its own span of a segment).
    """
    if type(element) is not np.ndarray:
        return None
    base = element.base
    if base is None:
        owned = None if id(element) in preexisting else _owned_array_bytes(element)
        return None if owned is None else (owned, id(element))
    while isinstance(base, np.ndarray) and base.base is not None:  # owner_of, inlined
        base = base.base
    if id(base) in preexisting or is_file_backed(base):
        return ARRAY_HEADER_BYTES, 0
    owner = type(base)
    if owner is np.ndarray:
        owned = _owned_array_bytes(base)
        if owned is None:
            return None
    elif owner is memoryview or owner is bytes or owner is bytearray:
        owned = sys.getsizeof(base) + (base.nbytes if owner is memoryview else 0)
    else:
        return None
    if owned > _COMPACT_RATIO * element.nbytes + _COMPACT_MIN_SAVING:
        return None  # worth compacting: the walk does it
    return ARRAY_HEADER_BYTES + owned, id(base)


def _owned_array_bytes(array: np.ndarray[Any, Any]) -> int | None:
    """What :meth:`_Costing.owner_cost` gives an array that owns its data, when its items
    are numbers or exactly ``bytes`` (a column of ids or records, summed in C); None
    for other objects."""
    if not array.dtype.hasobject:
        return ARRAY_HEADER_BYTES + array.nbytes
    items = array.ravel().tolist()
    total = bytes_total(items)
    if total < 0:
        return None
    return ARRAY_HEADER_BYTES + array.nbytes + total + _BYTES_HEADER * len(items)


def _owner_bytes(owner: object) -> int:
    """The bytes a view's owner holds: an array's data, or a buffer's (a memoryview's
    header alone said ~200 B, so a row viewing a 400 KB segment was never compacted)."""
    if isinstance(owner, np.ndarray):
        return owner.nbytes
    if isinstance(owner, (bytes, bytearray)):
        return sys.getsizeof(owner)
    try:
        with memoryview(owner) as view:  # type: ignore[arg-type]
            return view.nbytes
    except TypeError:
        return sys.getsizeof(owner)


def _compact_array(value: np.ndarray[Any, Any], costing: _Costing) -> np.ndarray[Any, Any]:
    """``value`` copied out if it is a view pinning a much larger owner of ours."""
    if value.base is None:
        return value
    owner = owner_of(value)
    if id(owner) in costing.preexisting or _is_file_backed(owner):
        return value
    if _owner_bytes(owner) <= _COMPACT_RATIO * value.nbytes + _COMPACT_MIN_SAVING:
        return value
    copied = np.array(value, copy=True, subok=True)
    if not value.flags.writeable:
        copied.flags.writeable = False  # a read-only view stays read-only (G5)
    return copied


def _compact(value: Any, costing: _Costing) -> Any:
    """``value`` with its wasteful views copied out (containers rebuilt, others kept)."""
    cls = type(value)
    if isinstance(value, np.ndarray):
        return _compact_array(value, costing)
    if cls is dict:
        return {key: _compact(item, costing) for key, item in value.items()}
    if cls is list:
        return [_compact(item, costing) for item in value]
    if isinstance(value, tuple):
        items = [_compact(item, costing) for item in value]
        if cls is tuple:
            return tuple(items)
        if hasattr(cls, "_fields"):  # a namedtuple
            return cls(*items)
        return value
    return value


def admit(element: Any, preexisting: frozenset[int] | set[int] = frozenset()) -> tuple[Any, int]:
    """The element a buffering stage should keep, and what it costs.

    Views that pin an owner much larger than themselves are copied out first
    (see the module docstring), so a buffer of rows costs the rows. Elements
    without such views are returned as they are, costed in one pass.
    """
    fast = _plain_cost(element, preexisting)
    if fast is not None:
        return element, fast
    costing = _Costing(preexisting)
    cost = _walk(costing, element)
    if not costing.compactable:
        return element, cost
    compacted = _compact(element, costing)
    return compacted, sizeof(compacted, preexisting)

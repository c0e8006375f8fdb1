"""Stable identities of user functions and data, for pipeline fingerprints and stage names.

Two identities, for two uses:

* The *structure* fingerprint (:meth:`Node.fingerprint`) is the one iterator
  states carry. It says what the pipeline computes: arrays by dtype and shape,
  files by name. So a checkpoint restores after the data was copied to another
  disk, or reloaded in a new process.
* The *content* fingerprint (:meth:`Node.data_fingerprint`) keys the files of
  ``cache(filename)``, ``snapshot`` and ``save``. It is the structure plus what
  the data is. Every in-memory array the pipeline reads counts by its digest
  (:func:`array_digest`), and so does one a function captures or reads as a
  module-level global. Every file it reads counts by its identity and contents
  (:func:`file_identity`: path, size, mtime, inode, and a digest of the bytes).
  So a changed input never serves an old cache, as tf.data starts a new
  snapshot.

Digests use XXH3-128 (the ``xxhash`` package, BSD-2-Clause, no dependencies).
It hashes about 12 GB/s on one core of a small VM. So a 1 GB array costs ~0.1 s,
once per pipeline: the node keeps its digest. A memory-mapped array is
identified by its file (:func:`file_identity`) and offset.
"""

from __future__ import annotations

import dis
import functools
import hashlib
import mmap
import os
import types
from collections.abc import Callable
from typing import Any

import numpy as np
import xxhash

from headrace.core.node import Node, content_memo, content_mode, describing_content
from headrace.io.mapped import FileMap

__all__ = [
    "array_digest",
    "describing_content",
    "file_digest",
    "file_identity",
    "function_fingerprint",
    "function_name",
    "object_digest",
    "unmemoized_digest",
]

#: Bytes hashed per call for an array that is not contiguous (one copy of this size).
_CHUNK_BYTES = 16 << 20


#: Files up to this size are hashed whole by :func:`file_identity`; larger ones are
#: sampled. Small on purpose: a cache over thousands of shards is fingerprinted each
#: time its pipeline is built in a new process, and reading the shards whole then
#: would cost what the cache saves.
FULL_HASH_BYTES = 1 << 20
#: A larger file is sampled in this many blocks (first, last, evenly spaced between)...
_SAMPLE_BLOCKS = 8
#: ... of this many bytes each (512 KiB read per large file).
_SAMPLE_BYTES = 64 << 10


def file_identity(path: str | os.PathLike[str]) -> tuple[Any, ...]:
    """What tells one version of a file from another: its absolute path, size,
    modification time (ns), inode and device, and a digest of its bytes.

    The digest is what catches a file rewritten with the same size whose mtime was
    restored (``cp -p``, ``rsync -t``, ``touch -r``; the inode may stay): a file of
    at most :data:`FULL_HASH_BYTES` (1 MiB) is hashed whole (XXH3-128), so any
    changed byte is seen. A larger file is identified by the rest plus a digest of
    8 sampled 64 KiB blocks (the first, the last, evenly spaced between): a
    change there, or any change of size, mtime or inode, is seen; a same-size edit
    of a large file that falls between the sampled blocks *and* keeps the mtime and
    inode is not (change the file's mtime, or its name, to force a rebuild). A file
    that cannot be stat'ed or read counts as missing or unreadable (reading it raises
    later, naming it).
    """
    from headrace.io import objstore

    name = os.fspath(path)
    if objstore.is_remote(name):
        # An object's version is its ETag (what S3, GCS and Azure change on every write)
        # with its size; no bytes are read.
        try:
            remote = objstore.object_info(name)
        except OSError as error:
            return ("missing", name, error.errno)
        return ("object", name, remote.size, remote.etag, remote.last_modified)
    name = os.path.abspath(objstore.local_path(name))
    try:
        info = os.stat(name)
    except OSError as error:
        return ("missing", name, error.errno)
    identity = ("file", name, info.st_size, info.st_mtime_ns, info.st_ino, info.st_dev)
    return (*identity, _file_digest(name, info.st_size))


def file_digest(path: str | os.PathLike[str]) -> str:
    """A digest of a file's bytes, as :func:`file_identity` takes it: whole up to
    :data:`FULL_HASH_BYTES`, sampled blocks beyond, so it costs at most about half a
    MiB of reading whatever the file's size. Raises OSError if it cannot be stat'ed."""
    name = os.fspath(path)
    return _file_digest(name, os.stat(name).st_size)


def _file_digest(name: str, size: int) -> str:
    """XXH3-128 of the whole file (small files) or of sampled blocks (large ones)."""
    hasher = xxhash.xxh3_128()
    try:
        with open(name, "rb", buffering=0) as file:
            if size <= FULL_HASH_BYTES:
                while chunk := file.read(_CHUNK_BYTES):
                    hasher.update(chunk)
                return f"xxh3 {hasher.hexdigest()}"
            last = size - _SAMPLE_BYTES
            for index in range(_SAMPLE_BLOCKS):
                offset = last * index // (_SAMPLE_BLOCKS - 1)
                hasher.update(os.pread(file.fileno(), _SAMPLE_BYTES, offset))
            return f"sampled {hasher.hexdigest()}"
    except OSError as error:  # not readable (or not a regular file): reading it raises
        return f"unreadable {error.errno}"


def object_digest(info: Any) -> str:
    """:func:`file_digest` of an object (an :class:`~headrace.io.objstore.ObjectInfo`),
    the same bytes hashed the same way, read by ranged GETs: a part file's digest is
    the same on disk and after its upload."""
    from headrace.io import objstore

    hasher = xxhash.xxh3_128()
    if info.size <= FULL_HASH_BYTES:
        hasher.update(objstore.read_whole(info))
        return f"xxh3 {hasher.hexdigest()}"
    last = info.size - _SAMPLE_BYTES
    for index in range(_SAMPLE_BLOCKS):
        offset = last * index // (_SAMPLE_BLOCKS - 1)
        hasher.update(objstore.read_whole(info, offset, _SAMPLE_BYTES))
    return f"sampled {hasher.hexdigest()}"


def array_digest(value: Any) -> str:
    """A digest of what an array (or a leaf: bytes, str, a scalar, None) holds.

    In-memory arrays are hashed (XXH3-128 over their bytes, with dtype and shape);
    a view of a memory-mapped file is identified by :func:`file_identity` of the file
    plus its offset, shape and strides (a 100 GB ``.npy`` costs a ``stat`` and 4 MiB
    of sampled reads; a small one is hashed whole).
    Object arrays (bytes and str components) are hashed element by element. Within a
    content fingerprint, each array is hashed once however often it appears.
    """
    memo = content_memo()
    if memo is not None:
        known = memo.get(id(value))
        if known is not None and known[0] is value:
            return known[1]
    digest = _array_digest(value)
    if memo is not None:
        memo[id(value)] = (value, digest)
    return digest


def unmemoized_digest(value: Any) -> str:
    """:func:`array_digest` of a temporary (a row made to be hashed): not kept in the
    content memo, which would keep every such row alive until the fingerprint ends."""
    return _array_digest(value)


def _array_digest(value: Any) -> str:
    if not isinstance(value, np.ndarray):
        if isinstance(value, (bytes, str, type(None), bool, int, float, complex, np.generic)):
            return f"{type(value).__name__}:{xxhash.xxh3_128_hexdigest(repr(value).encode())}"
        return _Describer().describe(value, 0)
    head = f"{value.dtype.str}{value.shape}"
    mapped = _mapped_file(value)
    if mapped is not None:
        path, offset = mapped
        return f"mapped {head}{value.strides}@{offset} {file_identity(path)}"
    hasher = xxhash.xxh3_128(head.encode())
    if value.dtype.hasobject:
        describer = _Describer()
        for item in value.flat:
            if isinstance(item, (bytes, str)):
                data = item.encode() if isinstance(item, str) else item
                hasher.update(f"{type(item).__name__}{len(data)}:".encode())
                hasher.update(data)
            elif isinstance(item, np.ndarray):
                hasher.update(f"array {array_digest(item)};".encode())
            else:
                hasher.update(f"{describer.describe(item, 1)};".encode())
    elif value.flags.c_contiguous:
        hasher.update(_raw(value))
    else:
        rows = max(1, _CHUNK_BYTES // max(1, value[:1].nbytes)) if value.ndim else 1
        for start in range(0, len(value) if value.ndim else 1, rows):
            hasher.update(_raw(np.ascontiguousarray(value[start : start + rows] if value.ndim else value)))
    return f"array {hasher.hexdigest()}"


def _raw(array: np.ndarray[Any, Any]) -> memoryview:
    """The bytes of a C-contiguous array, in place."""
    return array.reshape(-1).view(np.uint8).data if array.size else memoryview(b"")


def _mapped_file(array: np.ndarray[Any, Any]) -> tuple[str, int] | None:
    """The file and byte offset an array views, where it is (a view of) an ``np.memmap``
    or of a :class:`~headrace.io.mapped.FileMap` (``from_npy``'s mapping)."""
    root = None
    base: Any = array
    while isinstance(base, np.ndarray):
        if isinstance(base, np.memmap) and isinstance(base.base, mmap.mmap):
            root = base  # made by np.memmap(): its first byte is the file's ``offset``
        base = base.base
    if isinstance(base, FileMap):
        start = int(array.__array_interface__["data"][0])
        return base.filename, base.offset + start - base.address
    if root is None or not isinstance(getattr(root, "filename", None), str):
        return None
    start = int(array.__array_interface__["data"][0])
    origin = int(root.__array_interface__["data"][0])
    return root.filename, int(root.offset) + start - origin


def function_name(fn: Callable[..., Any]) -> str:
    """A stable name for a user function, for fingerprints and stage names."""
    module = getattr(fn, "__module__", None) or ""
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{module}.{name}" if module else name


def function_fingerprint(fn: Any) -> str:
    """A digest of what a user function computes, the same in every process.

    A state saved from ``map(lambda x: x + 1)`` must not restore into
    ``map(lambda x: x * 1000)``: both are ``<lambda>``, so the name alone
    cannot tell them apart. The digest covers the bytecode (``co_code``, its
    constants recursively, the names it uses), default arguments and the values
    of closure cells; callable objects (``functools.partial``, instances with
    ``__call__``) are described by their function and their attributes. Within a
    content fingerprint (:func:`describing_content`), the module-level globals the
    code reads are described too (see :meth:`_Describer.read_globals`), so a
    changed global lookup table makes a new cache. Simple
    values (numbers, strings, bytes, NumPy scalars and dtypes, and containers of
    them) count by value; others by type (arrays by dtype and shape, datasets by
    their fingerprint). Nothing depends on ``id()``, hash randomization, file
    paths or line numbers, so a checkpoint restores in a new process, and
    after an edit that only moves code around.
    """
    return hashlib.sha256(_Describer().describe(fn, 0).encode()).hexdigest()[:16]


_SIMPLE = (type(None), bool, int, float, complex, str, bytes, type(Ellipsis), np.generic, np.dtype)


class _Describer:
    """Stable text for :func:`function_fingerprint`, bounded in depth and in total work
    (a closure over a large object graph costs a few thousand steps, not a walk of it)."""

    MAX_DEPTH = 6
    MAX_ITEMS = 256  # a longer container counts by type and length only
    MAX_STEPS = 20_000  # past this, values count by type only

    def __init__(self) -> None:
        self.active: set[int] = set()  # ids being described: a cycle counts by type
        self.steps = 0

    def describe(self, value: Any, depth: int) -> str:
        self.steps += 1
        if isinstance(value, _SIMPLE):
            return repr(value)
        kind = f"{type(value).__module__}.{type(value).__qualname__}"
        if depth > self.MAX_DEPTH or self.steps > self.MAX_STEPS or id(value) in self.active:
            return kind
        if isinstance(value, np.ndarray):
            if content_mode():
                return f"{kind}({array_digest(value)})"
            return f"{kind}({value.dtype},{value.shape})"
        if isinstance(value, type):
            return f"class {value.__module__}.{value.__qualname__}"
        if isinstance(value, types.ModuleType):
            return f"module {value.__name__}"
        if isinstance(value, (types.BuiltinFunctionType, types.BuiltinMethodType)):
            owner = getattr(value, "__self__", None)
            bound = owner is not None and not isinstance(owner, types.ModuleType)
            prefix = f"{type(owner).__qualname__}." if bound else ""
            return f"builtin {getattr(value, '__module__', '')}.{prefix}{value.__qualname__}"
        node = value if isinstance(value, Node) else getattr(value, "_node", None)
        if isinstance(node, Node):  # a Dataset captured by a function (zip, interleave)
            content = content_mode()
            return f"dataset {node.data_fingerprint() if content else node.fingerprint()}"
        self.active.add(id(value))
        try:
            return self._compound(value, kind, depth + 1)
        finally:
            self.active.discard(id(value))

    def _compound(self, value: Any, kind: str, depth: int) -> str:
        def each(items: Any) -> str:
            return ",".join(self.describe(item, depth) for item in items)

        if isinstance(value, (tuple, list, set, frozenset, dict)) and len(value) > self.MAX_ITEMS:
            return f"{kind}[{len(value)}]"
        if isinstance(value, (tuple, list)):
            return f"{kind}({each(value)})"
        if isinstance(value, (set, frozenset)):  # sorted: iteration order follows the hash seed
            return f"{kind}({','.join(sorted(self.describe(v, depth) for v in value))})"
        if isinstance(value, dict):
            pairs = (f"{self.describe(k, depth)}:{self.describe(v, depth)}" for k, v in value.items())
            return f"{kind}({','.join(sorted(pairs))})"
        if isinstance(value, types.CodeType):
            return (
                f"code({value.co_name};{value.co_argcount};{value.co_kwonlyargcount};"
                f"{value.co_code.hex()};{each(value.co_consts)};{','.join(value.co_names)};"
                f"{','.join(value.co_varnames)})"
            )
        if isinstance(value, types.FunctionType):
            reads = f";globals({self.read_globals(value, depth)})" if content_mode() else ""
            return (
                f"function {value.__module__}.{value.__qualname__}("
                f"{self.describe(value.__code__, depth)};{each(_cell_values(value))};"
                f"{self.describe(value.__defaults__, depth)};"
                f"{self.describe(value.__kwdefaults__, depth)}{reads})"
            )
        if isinstance(value, types.MethodType):
            return f"method({each((value.__func__, value.__self__))})"
        if isinstance(value, functools.partial):
            return f"partial({each((value.func, value.args, value.keywords))})"
        return self._object(value, kind, depth)

    def _object(self, value: Any, kind: str, depth: int) -> str:
        """Any other object: its class, what calling it runs, and its attributes."""
        call = next(
            (cls.__dict__["__call__"] for cls in type(value).__mro__ if "__call__" in cls.__dict__),
            None,
        )
        fields = dict(getattr(value, "__dict__", None) or {})
        for cls in type(value).__mro__:
            slots = getattr(cls, "__slots__", ())
            for name in [slots] if isinstance(slots, str) else slots:
                if hasattr(value, name):
                    fields[name] = getattr(value, name)
        code = self.describe(call, depth) if isinstance(call, types.FunctionType) else ""
        name = getattr(value, "__qualname__", None) or getattr(value, "__name__", None)
        named = name if isinstance(name, str) else ""  # e.g. NumPy's ufuncs: add, multiply
        return f"object {kind} {named}({code};{self.describe(fields, depth)})"

    def read_globals(self, fn: types.FunctionType, depth: int) -> str:
        """The module-level globals ``fn``'s code (and the code nested in it) reads,
        by name and value, for a content fingerprint.

        Only values that are data count: arrays (by content), simple values, tuples
        and frozensets of them, datasets, and functions (described in turn, with
        *their* globals, so a helper's table counts; the describer's depth, cycle and
        work limits bound the walk). Modules, classes and builtins are code, not data;
        mutable containers and other objects are left out because a function's
        globals often hold state that changes on every run (counters, caches, logs),
        which would rebuild the cache every time; names the function assigns
        (``global n; n += 1``) are left out for the same reason.
        """
        names = _global_reads(fn.__code__)
        scope = fn.__globals__
        parts = []
        for name in sorted(names):
            if name not in scope:
                continue  # a builtin, or a name defined later
            value = scope[name]
            if _is_data(value):
                parts.append(f"{name}={self.describe(value, depth)}")
        # Another module's globals, read as ``module.NAME`` (``module.helper(x)``, whose
        # own globals then count), the module a global or a closure's cell: the module is
        # code, what it holds may be data.
        cells = dict(zip(fn.__code__.co_freevars, _cell_values(fn), strict=False))
        for name, attribute in sorted(_module_attribute_reads(fn.__code__)):
            module = cells[name] if name in cells else scope.get(name)
            if not isinstance(module, types.ModuleType):
                continue
            value = getattr(module, attribute, None)
            if _is_data(value):
                parts.append(f"{name}.{attribute}={self.describe(value, depth)}")
        return ",".join(parts)


def _is_data(value: Any) -> bool:
    """Whether a global counts in a content fingerprint (see ``read_globals``)."""
    node = value if isinstance(value, Node) else getattr(value, "_node", None)
    return isinstance(value, (*_SIMPLE, np.ndarray, tuple, frozenset, types.FunctionType)) or (
        isinstance(node, Node))


@functools.lru_cache(maxsize=1024)
def _module_attribute_reads(code: types.CodeType) -> frozenset[tuple[str, str]]:
    """``(name, attribute)`` for each ``name.attribute`` that ``code`` (or code nested in
    it) loads: a global or a closure's name loaded, then an attribute of it."""
    found: set[tuple[str, str]] = set()
    pending = [code]
    while pending:
        current = pending.pop()
        previous = None
        for instruction in dis.get_instructions(current):
            if previous is not None and previous.opname in (
                    "LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF") and (
                    instruction.opname in ("LOAD_ATTR", "LOAD_METHOD")):
                found.add((previous.argval, instruction.argval))
            previous = instruction
        pending.extend(const for const in current.co_consts if isinstance(const, types.CodeType))
    return frozenset(found)


@functools.lru_cache(maxsize=1024)
def _global_reads(code: types.CodeType) -> frozenset[str]:
    """The global names ``code`` (or code nested in it) loads and never assigns."""
    loads: set[str] = set()
    stores: set[str] = set()
    pending = [code]
    while pending:
        current = pending.pop()
        for instruction in dis.get_instructions(current):
            if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
                loads.add(instruction.argval)
            elif instruction.opname in ("STORE_GLOBAL", "DELETE_GLOBAL"):
                stores.add(instruction.argval)
        pending.extend(const for const in current.co_consts if isinstance(const, types.CodeType))
    return frozenset(loads - stores)


def _cell_values(fn: types.FunctionType) -> list[Any]:
    """The values of ``fn``'s closure cells (a cell not assigned yet counts as a marker)."""
    values: list[Any] = []
    for cell in fn.__closure__ or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:  # the enclosing function has not assigned it yet
            values.append("<unassigned cell>")
    return values

"""Read-only memory maps of files that keep no descriptor open (guarantee G2).

Why: ``np.memmap`` (and ``np.load(mmap_mode="r")``) maps a file through
:class:`mmap.mmap`, which keeps a duplicate of the file's descriptor for as long as
the mapping lives (until Python 3.13's ``trackfd=False``). An interleave over
``from_npy`` files then holds one descriptor per slot, none of them counted by
``max_open_files`` and none suspendable: 100 slots under ``ulimit -n 64`` end in
``EMFILE``. A mapping needs no descriptor once it is made, so :class:`FileMap` maps the
file itself (``mmap(2)`` through libc) and closes the descriptor at once; the mapping
goes when the last array over it goes (every view keeps it alive through ``.base``).

Its pages are file-backed like ``np.memmap``'s: :func:`is_file_backed` tells the memory
accounting (which charges nothing for them) and the fingerprints (which name the file
and offset instead of hashing the bytes) that an array views such a mapping.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from typing import Any

__all__ = ["FileMap", "is_file_backed", "map_file"]

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


class FileMap:
    """The owner of one read-only, shared mapping of a whole file, descriptor closed.

    ``filename`` and ``offset`` (0: the mapping starts at the file's first byte) say
    what it maps, as ``np.memmap``'s attributes do. Use it as an array through
    ``np.asarray`` (its bytes as ``uint8``, read-only); it is unmapped when the last
    array over it is collected.
    """

    __slots__ = ("__array_interface__", "address", "filename", "offset", "size")

    def __init__(self, descriptor: int, size: int, filename: str) -> None:
        address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, descriptor, 0)
        if address is None or address == _MAP_FAILED:
            number = ctypes.get_errno()
            raise OSError(number, f"mmap of {filename}: {os.strerror(number)}", filename)
        self.address, self.size, self.filename, self.offset = address, size, filename, 0
        self.__array_interface__ = {
            "data": (address, True), "shape": (size,), "typestr": "|u1", "version": 3}

    def __del__(self, munmap: Any = _libc.munmap) -> None:  # (bound now: usable at exit)
        if getattr(self, "address", None) is not None:
            munmap(self.address, self.size)


def map_file(path: str) -> FileMap:
    """Map the whole regular file ``path`` read-only; no descriptor stays open.

    The caller opens nothing: the descriptor is opened and closed here, so take a
    file-pool slot around the call (:func:`headrace.io.filepool.borrowed_slot`).
    An empty file cannot be mapped (``mmap(2)`` refuses a length of 0): ValueError.
    """
    descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        size = os.fstat(descriptor).st_size
        if size == 0:
            raise ValueError(f"cannot map {path}: the file is empty")
        return FileMap(descriptor, size, path)
    finally:
        os.close(descriptor)


def is_file_backed(owner: object) -> bool:
    """Whether ``owner`` (an array's last ``.base``) is a file mapping: its pages are the
    page cache's, dropped and re-read by the kernel, never anonymous memory."""
    return isinstance(owner, (mmap.mmap, FileMap))

"""Refusing paths that are not regular files, before opening them.

Why: a reader that must see a whole file, or that writes something next to it (an
``.hrx`` index), has no business with ``/dev/zero`` (endless zeros: with checksums
off, endless empty records), a FIFO (``open`` blocks until a writer comes), a
directory or a socket. Checking ``stat`` first turns each of those into an error
that names the path and what it is, instead of a hang, a bare ``[Errno 21]`` or an
index written into ``/dev``.
"""

from __future__ import annotations

import errno
import os
import stat

from headrace._errors import InvalidArgumentError

__all__ = ["describe_file_type", "require_regular_file"]

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
)


def describe_file_type(mode: int) -> str:
    """``"a directory"``, ``"a character device"``, ... for an ``st_mode``."""
    if stat.S_ISREG(mode):
        return "a regular file"
    return next((kind for test, kind in _KINDS if test(mode)), "not a regular file")


def require_regular_file(
    path: str | os.PathLike[str], what: str, why: str = ""
) -> os.stat_result:
    """``path``'s ``stat`` (symbolic links followed) if it is a regular file.

    Raises :class:`FileNotFoundError` (naming the path, with no traceback chained
    from ``stat``) when it does not exist, and :class:`~headrace._errors.InvalidArgumentError` naming ``what`` (the
    command or function), the path and its type otherwise; ``why`` (", ...") says why a
    regular file is needed. Other ``stat`` failures (permissions) propagate as they are.
    """
    name = os.fspath(path)
    try:
        info = os.stat(name)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), name) from None
    if not stat.S_ISREG(info.st_mode):
        raise InvalidArgumentError(
            f"{what}: {name} is {describe_file_type(info.st_mode)}, not a regular file{why}"
        )
    return info

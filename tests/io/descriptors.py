"""Counting a process's open descriptors in a test that shares its process with others."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def open_descriptors(directory: Path) -> int:
    """Descriptors this process has open on files in ``directory``. Not the whole
    process's count: another test's thread in this worker may open or close a file
    (or a collection close one) meanwhile."""
    prefix = os.path.join(str(directory), "")
    count = 0
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile (the listing's own, say)
            count += os.readlink(f"/proc/self/fd/{name}").startswith(prefix)
    return count

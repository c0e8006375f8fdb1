"""Access to the optional C extension ``headrace.io._hrio``, with a switch to bypass it.

The extension holds the hot loops (CRC32C, TFRecord framing, batched Example parsing).
Every function it provides has a pure-Python twin giving identical results, so the
package works when the extension was not built, and tests can compare the two paths.
Set ``HEADRACE_PURE_PYTHON=1`` in the environment, or call :func:`set_native_enabled`,
to force the pure-Python path.
"""

from __future__ import annotations

import os
from types import ModuleType

__all__ = ["native_module", "set_native_enabled"]

_loaded_extension: ModuleType | None
try:
    import headrace.io._hrio as _loaded_extension
except ImportError:  # not built (e.g. running from a source tree without build_ext)
    _loaded_extension = None

_enabled = os.environ.get("HEADRACE_PURE_PYTHON", "") not in ("1", "true", "yes")


def native_module() -> ModuleType | None:
    """Return the C extension, or None when it is missing or switched off."""
    return _loaded_extension if _enabled else None


def set_native_enabled(enabled: bool) -> bool:
    """Switch the C extension on or off for this process; return the previous setting.

    Switching on has no effect when the extension is not built.
    """
    global _enabled
    previous = _enabled
    _enabled = enabled
    return previous

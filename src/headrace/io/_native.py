"""Access to the optional C extensions, with a switch to bypass them.

``headrace.io._hrio`` holds the hot loops (CRC32C, TFRecord framing, batched Example
parsing); ``headrace.image._jpeg`` the windowed JPEG decode + resample (it links the
system's libjpeg-turbo, so it may be missing where the rest was built). Every function
they provide has a Python twin giving the same results (identical for ``_hrio``,
within a stated tolerance for ``_jpeg``), so the package works when an extension was
not built, and tests can compare the two paths. Set ``HEADRACE_PURE_PYTHON=1`` in the
environment, or call :func:`set_native_enabled`, to force the Python paths.
"""

from __future__ import annotations

import os
from types import ModuleType

__all__ = ["jpeg_module", "native_module", "set_native_enabled"]

_loaded_extension: ModuleType | None
try:
    import headrace.io._hrio as _loaded_extension
except ImportError:  # not built (e.g. running from a source tree without build_ext)
    _loaded_extension = None

_enabled = os.environ.get("HEADRACE_PURE_PYTHON", "") not in ("1", "true", "yes")


def native_module() -> ModuleType | None:
    """Return the C extension, or None when it is missing or switched off."""
    return _loaded_extension if _enabled else None


def jpeg_module() -> ModuleType | None:
    """Return the windowed-JPEG extension, or None when it is missing or switched off.

    Imported on first use, not with this module: importing ``headrace.image._jpeg``
    runs ``headrace.image``'s package, which imports this module."""
    if not _loaded_jpeg:
        try:
            import headrace.image._jpeg as loaded
        except ImportError:  # not built, or built without libjpeg's headers
            _loaded_jpeg.append(None)
        else:
            _loaded_jpeg.append(loaded)
    return _loaded_jpeg[0] if _enabled else None


_loaded_jpeg: list[ModuleType | None] = []  # empty until the first jpeg_module()


def set_native_enabled(enabled: bool) -> bool:
    """Switch the C extension on or off for this process; return the previous setting.

    Switching on has no effect when the extension is not built.
    """
    global _enabled
    previous = _enabled
    _enabled = enabled
    return previous

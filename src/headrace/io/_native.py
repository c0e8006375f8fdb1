"""Access to the optional C extensions, with a switch to bypass them.

``headrace.io._hrio`` holds the hot loops (CRC32C, TFRecord framing, batched Example
parsing); ``headrace.image._jpeg`` the windowed JPEG decode + resample (it links the
system's libjpeg-turbo, so it may be missing where the rest was built; it is loaded by
:mod:`headrace.image._native`, since io sits below image). Every function
they provide has a Python twin giving the same results (identical for ``_hrio``,
within a stated tolerance for ``_jpeg``), so the package works when an extension was
not built, and tests can compare the two paths. Set ``HEADRACE_PURE_PYTHON=1`` in the
environment, or call :func:`set_native_enabled`, to force the Python paths.
"""

from __future__ import annotations

import os
from types import ModuleType

__all__ = ["MISSING_EXTENSION", "native_enabled", "native_module", "set_native_enabled"]

_enabled = os.environ.get("HEADRACE_PURE_PYTHON", "") not in ("1", "true", "yes")

#: What a user is told when the C extension is missing: what is slow, how to get it.
MISSING_EXTENSION = (
    "headrace's C extension (headrace.io._hrio) is not built, so TFRecord framing, CRC32C "
    "checks and tf.train.Example writing run in pure Python, 10 to 50 times slower, and "
    "batched tf.train.Example parsing 5 to 10 times slower in batches of 200 records or "
    "more (as fast as protobuf's own parser), more in smaller ones; results are the "
    "same. Install a wheel (pip install headrace), or "
    "give pip a C compiler and Python's headers (apt-get install build-essential "
    "python3-dev) and reinstall: pip install --force-reinstall --no-deps --no-binary "
    "headrace headrace. HEADRACE_PURE_PYTHON=1 chooses the Python paths and silences this."
)

_loaded_extension: ModuleType | None
try:
    import headrace.io._hrio as _loaded_extension
except ImportError:  # not built: no C compiler where it was installed, or a source tree
    _loaded_extension = None
    if _enabled:
        from headrace._warn import warn_user

        warn_user(MISSING_EXTENSION, RuntimeWarning)


def native_module() -> ModuleType | None:
    """Return the C extension, or None when it is missing or switched off."""
    return _loaded_extension if _enabled else None


def native_enabled() -> bool:
    """Whether the C paths are switched on (:func:`set_native_enabled`,
    ``HEADRACE_PURE_PYTHON``); an extension that is missing stays missing."""
    return _enabled


def set_native_enabled(enabled: bool) -> bool:
    """Switch the C extension on or off for this process; return the previous setting.

    Switching on has no effect when the extension is not built.
    """
    global _enabled
    previous = _enabled
    _enabled = enabled
    return previous

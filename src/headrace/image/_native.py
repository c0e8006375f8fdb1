"""The windowed-JPEG C extension, loaded on first use, or None.

It links the system's libjpeg-turbo, so it may be missing where the rest was built.
The switch that turns every C path off lives in :mod:`headrace.io._native`.
"""

from __future__ import annotations

import logging
from types import ModuleType

from headrace.io._native import native_enabled

__all__ = ["jpeg_module"]

_loaded_jpeg: list[ModuleType | None] = []  # empty until the first jpeg_module()


def jpeg_module() -> ModuleType | None:
    """Return the windowed-JPEG extension, or None when it is missing or switched off.

    Imported on first use, not with this module: importing ``headrace.image._jpeg``
    runs ``headrace.image``'s package, which imports this module."""
    if not _loaded_jpeg:
        try:
            import headrace.image._jpeg as loaded
        except ImportError:  # not built, or built without libjpeg's headers
            _loaded_jpeg.append(None)
            if native_enabled():  # a slower path, not a hazard: logged
                logging.getLogger("headrace.image").info(
                    "headrace.image._jpeg is not built (libjpeg's headers were missing where "
                    "headrace was installed: apt-get install libjpeg-dev, then reinstall "
                    "headrace): JPEG crops and resizes decode whole images through simplejpeg")
        else:
            _loaded_jpeg.append(loaded)
    return _loaded_jpeg[0] if native_enabled() else None

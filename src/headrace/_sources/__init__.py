"""Where elements come from: arrays and memmaps, ranges, generators, files.

Internal to headrace: not part of its API (its names can change in any release).
"""

__all__: list[str] = []

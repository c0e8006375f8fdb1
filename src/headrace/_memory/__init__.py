"""Byte accounting: what an element costs (:mod:`.sizeof`) and who may hold it (:mod:`.budget`).

Internal to headrace: not part of its API (its names can change in any release).
"""

__all__: list[str] = []

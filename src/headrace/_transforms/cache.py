"""Moved to :mod:`headrace._persist.cache`; this name still imports it."""

from headrace._persist.cache import PARTIAL_CACHE_ADVICE, CacheNode
from headrace._persist.memory_store import in_memory_room

__all__ = ["PARTIAL_CACHE_ADVICE", "CacheNode", "in_memory_room"]

"""Byte accounting: what an element costs (:mod:`.sizeof`) and who may hold it (:mod:`.budget`)."""

"""Persistence: a dataset's elements kept past one pass, in memory or on disk.

One subject per module:

* :mod:`~headrace._persist.cache`: ``cache(filename)``, the stage and its iterator;
* :mod:`~headrace._persist.records`: the cache's file format (records, index, CRCs);
* :mod:`~headrace._persist.stores`: what every cache store does;
* :mod:`~headrace._persist.memory_store`: ``cache()`` in memory, spilling to disk;
* :mod:`~headrace._persist.file_store`: ``cache(filename)`` on disk, its lock and manifest;
* :mod:`~headrace._persist.kept`: the process-wide registry of kept in-memory caches;
* :mod:`~headrace._persist.snapshot`: ``snapshot(path)``, a cache keyed by content;
* :mod:`~headrace._persist.saved`: ``Dataset.save`` and ``Dataset.load``;
* :mod:`~headrace._persist.writers`: ``save_tfrecords``, TFRecord files for TensorFlow.

Every buffer here books through :mod:`headrace._memory.buffer`. Importing the
package imports none of its modules.

Internal to headrace: not part of its API (its names can change in any release).
"""

__all__: list[str] = []

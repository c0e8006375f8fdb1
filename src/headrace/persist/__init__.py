"""Persistence: a dataset's elements kept past one pass, in memory or on disk.

One subject per module:

* :mod:`~headrace.persist.cache`: ``cache(filename)``, the stage and its iterator;
* :mod:`~headrace.persist.records`: the cache's file format (records, index, CRCs);
* :mod:`~headrace.persist.stores`: what every cache store does;
* :mod:`~headrace.persist.memory_store`: ``cache()`` in memory, spilling to disk;
* :mod:`~headrace.persist.file_store`: ``cache(filename)`` on disk, its lock and manifest;
* :mod:`~headrace.persist.kept`: the process-wide registry of kept in-memory caches;
* :mod:`~headrace.persist.snapshot`: ``snapshot(path)``, a cache keyed by content;
* :mod:`~headrace.persist.saved`: ``Dataset.save`` and ``Dataset.load``;
* :mod:`~headrace.persist.writers`: ``save_tfrecords``, TFRecord files for TensorFlow.

Every buffer here books through :mod:`headrace.memory.buffer`. Importing the
package imports none of its modules.

Internal to headrace: not part of its API (its names can change in any release).
"""

__all__: list[str] = []

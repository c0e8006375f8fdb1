"""Command-line tools over TFRecord files, kept out of the import path of ``headrace``.

Each module returns plain results and formats text, so ``headrace.cli`` stays a thin
argument parser and the tools can be used (and tested) from Python:

* :mod:`headrace._tools.index` - build or check ``.hrx`` record indexes (``headrace index``);
* :mod:`headrace._tools.inspect` - record count, Example schema, sizes, CRC check and a
  preview of records (``headrace inspect``);
* :mod:`headrace._tools.convert` - CSV files, SQL queries and ``.npy`` arrays to TFRecord
  shards of Examples, and TFRecord back to CSV (``headrace convert``).

Internal to headrace: not part of its API (its names can change in any release).
"""

__all__: list[str] = []

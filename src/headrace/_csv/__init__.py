"""CSV in one package: the format, the streaming source, and the datasets built on them.

- :mod:`headrace._csv.reader`: CSV as TensorFlow parses it (``decode_csv``'s records,
  ``CsvDataset``'s byte stream), with pyarrow's parser where it gives the same values.
  It knows nothing of datasets or budgets.
- :mod:`headrace._csv.source`: CSV files as a pipeline source, read in blocks through
  the file pool, each block booked on the budget before it is read.
- :mod:`headrace._csv.datasets`: the public functions, with tf.data's names
  (``CsvDataset``, ``make_csv_dataset``, ``decode_csv``) and ``read_csv``.
- :mod:`headrace._csv.fusion`: ``map(decode_csv of a line).batch(n)`` decoded a batch
  at a time.

The public names are these, also at the top level (``headrace.read_csv``...).
"""

from headrace._csv import fusion as _fusion  # noqa: F401 (registers the batch fusion)
from headrace._csv.datasets import CsvDataset, decode_csv, make_csv_dataset, read_csv
from headrace._csv.reader import CsvError

__all__ = ["CsvDataset", "CsvError", "decode_csv", "make_csv_dataset", "read_csv"]

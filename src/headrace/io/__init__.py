"""Pure file formats: TFRecord framing, TFRecord index files and tf.train.Example protos.

These modules know nothing about datasets, budgets or file pools: they read and write
bytes, so they can be used (and tested against TensorFlow) on their own. Import the
submodules directly (``headrace.io.tfrecord``, ``headrace.io.example``,
``headrace.io.tfrecord_index``); this package imports nothing heavy on purpose.

The public modules are ``headrace.io.example``, ``headrace.io.tfrecord`` and
``headrace.io.objstore``; the others are internal to headrace.
"""

__all__: list[str] = []

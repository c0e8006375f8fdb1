"""``Dataset.to_tf()``: a ``tf.data.Dataset`` fed by a headrace pipeline.

For code that needs a real ``tf.data.Dataset`` — legacy ``input_fn``\\ s,
``tf.distribute`` strategies, Keras on the TensorFlow backend. The output
signature is built from the element spec (no element is read when the spec
is known statically), every pass over the TensorFlow dataset runs a fresh
headrace iterator under the pipeline's budget, and a known cardinality is
asserted so that Keras and ``tf.distribute`` know the number of steps.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING, Any

from headrace.core.node import INFINITE, UNKNOWN
from headrace.errors import InvalidArgumentError
from headrace.structure import TensorSpec, map_structure

if TYPE_CHECKING:
    from headrace.dataset import Dataset

__all__ = ["tf_signature", "to_tf"]


def _tf_spec(spec: Any, path: str) -> Any:
    import tensorflow as tf

    if not isinstance(spec, TensorSpec):
        raise InvalidArgumentError(f"to_tf: component {path} has no TensorSpec ({spec!r})")
    if spec.kind in ("bytes", "str"):
        dtype = tf.string
    else:
        try:
            dtype = tf.as_dtype(spec.dtype)
        except TypeError:
            raise InvalidArgumentError(
                f"to_tf: component {path} has dtype {spec.dtype}, which TensorFlow has no "
                "type for; cast it first (Dataset.cast or map)"
            ) from None
    return tf.TensorSpec(spec.shape, dtype)


def tf_signature(element_spec: Any) -> Any:
    """The ``tf.TensorSpec`` nest matching a headrace element spec (bytes/str -> tf.string)."""
    counter = iter(range(1 << 30))
    return map_structure(lambda spec: _tf_spec(spec, f"#{next(counter)}"), element_spec)


class _Elements:
    """Callable for ``from_generator``: one fresh headrace iterator per TensorFlow pass."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __call__(self) -> Generator[Any, None, None]:
        # ``with`` closes the run (threads, files, budget) when the pass ends or when
        # TensorFlow drops its iterator early and the generator is collected.
        with iter(self.dataset) as elements:
            yield from elements


def to_tf(dataset: Dataset) -> Any:
    """A ``tf.data.Dataset`` yielding this pipeline's elements as tensors."""
    import tensorflow as tf

    signature = tf_signature(dataset.element_spec)
    result = tf.data.Dataset.from_generator(_Elements(dataset), output_signature=signature)
    cardinality = dataset.cardinality()
    if cardinality == INFINITE:
        result = result.apply(tf.data.experimental.assert_cardinality(tf.data.INFINITE_CARDINALITY))
    elif cardinality != UNKNOWN:
        result = result.apply(tf.data.experimental.assert_cardinality(cardinality))
    return result


"""Errors through headrace's fused ``map(parse).batch(n)`` paths, against tf.data's own.

tf.data fuses a map with the batch after it (map_and_batch_fusion): a bad record fails
its whole batch, the next batch starts after it, and a short last batch under
``drop_remainder`` is dropped only once its records were mapped, so its error is raised
(nothing silently lost, G5). headrace fuses ``map(parse_single_example)`` and
``map(decode_csv of a line)`` with ``batch`` the same way: random streams with bad
records at random places, random batch sizes, both ``drop_remainder``, compared
batch for batch (values, or "error") with TensorFlow running the same code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from headrace import tf_compat

pytestmark = pytest.mark.tf

CASES = settings(max_examples=40, deadline=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture])


def outcomes(dataset: Any) -> list[Any]:
    """Each batch's values, or "error" where one is raised in its place."""
    out: list[Any] = []
    iterator = iter(dataset)
    while True:
        try:
            batch = next(iterator)
        except StopIteration:
            return out
        except Exception:  # (tf: InvalidArgumentError; headrace: its own, named)
            out.append("error")
            continue
        leaves = batch if isinstance(batch, tuple | list) else [batch]
        out.append([np.asarray(getattr(leaf, "numpy", lambda v=leaf: v)()).tolist()
                    for leaf in leaves])


streams = st.tuples(
    st.integers(0, 11),  # records
    st.integers(1, 5),  # batch size
    st.booleans(),  # drop_remainder
    st.data(),
)


@CASES
@given(streams)
def test_decode_csv_errors_fail_their_batch_as_tensorflows(tmp_path: Path, case: Any) -> None:
    count, batch_size, drop, data = case
    bad = data.draw(st.sets(st.integers(0, max(count - 1, 0)), max_size=3)) if count else set()
    lines = ["a,b"] + [(f"{i}" if i in bad else f"{i},{2 * i}") for i in range(count)]
    path = tmp_path / "rows.csv"
    path.write_text("\n".join(lines) + "\n")

    def pipeline(t: Any) -> Any:
        return t.data.TextLineDataset(str(path)).skip(1).map(
            lambda line: t.io.decode_csv(line, record_defaults=[[0], [0]])
        ).batch(batch_size, drop_remainder=drop)

    assert outcomes(pipeline(tf_compat)) == outcomes(pipeline(tf))


@CASES
@given(streams)
def test_parse_single_example_errors_fail_their_batch_as_tensorflows(
    tmp_path: Path, case: Any,
) -> None:
    count, batch_size, drop, data = case
    bad = data.draw(st.sets(st.integers(0, max(count - 1, 0)), max_size=3)) if count else set()
    path = tmp_path / "records.tfrecord"
    with tf.io.TFRecordWriter(str(path)) as writer:
        for i in range(count):
            feature = (tf.train.Feature(float_list=tf.train.FloatList(value=[1.0])) if i in bad
                       else tf.train.Feature(int64_list=tf.train.Int64List(value=[i])))
            writer.write(tf.train.Example(features=tf.train.Features(
                feature={"x": feature})).SerializeToString())

    def pipeline(t: Any) -> Any:
        spec = {"x": t.io.FixedLenFeature([], t.int64)}
        return t.data.TFRecordDataset(str(path)).map(
            lambda record: t.io.parse_single_example(record, spec)["x"]
        ).batch(batch_size, drop_remainder=drop)

    assert outcomes(pipeline(tf_compat)) == outcomes(pipeline(tf))

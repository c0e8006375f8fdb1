"""``headrace doctor`` on existing tf.data pipelines: the seed articles' hazards, scaled down.

Run against TensorFlow itself (installed by the ``tf`` extra).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from headrace.cli import main

tf = pytest.importorskip("tensorflow")  # the tf extra is in the default test install

pytestmark = pytest.mark.tf


def _codes(diagnosis: Any) -> set[str]:
    return {finding.code for finding in diagnosis.findings}


def test_seed_002_from_tensor_slices_constants_are_found() -> None:
    from headrace.profiling.tfgraph import diagnose_tf

    features = np.zeros((2048, 8192), np.float32)  # 64 MiB (the article's is 500 MB - 30 GB)
    ds = tf.data.Dataset.from_tensor_slices(features).batch(32).prefetch(1)
    diagnosis = diagnose_tf(ds, epochs=5, steps=8, budget="256MiB")
    (finding,) = [f for f in diagnosis.findings if f.code == "constant-in-graph"]
    assert "64.0 MiB" in finding.message and "from_npy" in finding.fix
    stages = diagnosis.extra["stages"]
    assert [s.kind for s in stages] == ["from_tensor_slices", "batch", "prefetch"]
    assert [s.op for s in stages] == ["TensorSliceDataset", "BatchDatasetV2", "PrefetchDataset"]
    assert stages[0].constant_bytes == features.nbytes
    assert stages[1].element_bytes == 32 * 8192 * 4
    assert "no-prefetch" not in _codes(diagnosis) and not diagnosis.leak


def test_seed_000_cache_of_a_large_dataset() -> None:
    from headrace.profiling.tfgraph import diagnose_tf

    decoded = tf.data.Dataset.range(1500).map(lambda i: tf.fill([8192], tf.cast(i, tf.float32)))
    ds = decoded.cache().batch(16)
    diagnosis = diagnose_tf(ds, epochs=5, steps=4, budget="64MiB")
    (finding,) = [f for f in diagnosis.findings if f.code == "cache-too-big"]
    assert "1500 elements of ~32.0 KiB" in finding.message and ".cache('" in finding.fix
    assert "no-prefetch" in _codes(diagnosis)
    on_disk = decoded.cache("/tmp/hr-never-written").batch(16).prefetch(2)
    assert "cache-too-big" not in _codes(diagnose_tf(on_disk, epochs=5, steps=2, budget="64MiB"))


def test_seed_shuffle_buffer_of_decoded_images() -> None:
    from headrace.profiling.tfgraph import diagnose_tf

    encoded = tf.data.Dataset.from_tensor_slices(np.arange(3000, dtype=np.int32))

    def decode(i: Any) -> Any:
        return tf.zeros([64, 64, 3], tf.float32) + tf.cast(i, tf.float32)

    bad = encoded.map(decode, num_parallel_calls=16).shuffle(2000).batch(16).prefetch(2)
    diagnosis = diagnose_tf(bad, epochs=5, steps=4, budget="64MiB")
    codes = _codes(diagnosis)
    assert {"shuffle-too-big", "decode-before-shuffle", "parallel-above-cpus"} <= codes
    shuffle = next(s for s in diagnosis.extra["stages"] if s.kind == "shuffle")
    assert shuffle.args["buffer_size"] == 2000
    assert shuffle.holds == pytest.approx(2000 * 64 * 64 * 3 * 4)
    assert "ds.shuffle(n" in shuffle.headrace
    good = encoded.shuffle(2000).map(decode, num_parallel_calls=tf.data.AUTOTUNE).batch(16)
    assert not {"shuffle-too-big", "decode-before-shuffle"} & _codes(
        diagnose_tf(good.prefetch(2), epochs=5, steps=4, budget="64MiB")
    )


def test_cli_doctor_reads_a_tf_dataset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    module = tmp_path / "tf_pipeline.py"
    module.write_text(
        "import tensorflow as tf\n"
        "def make():\n"
        "    return tf.data.Dataset.range(100).shuffle(10).batch(10)\n"
    )
    assert main(["doctor", f"{module}:make", "--epochs", "5"]) == 0
    out = capsys.readouterr().out
    assert "ShuffleDatasetV3" in out and "headrace" in out and "no-prefetch" in out

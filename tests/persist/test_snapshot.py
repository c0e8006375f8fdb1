"""snapshot(path): tf.data's meaning, from cache(filename) keyed by the pipeline's
fingerprint — written by the first complete pass, read by every later one (other
processes included), a new one for an edited pipeline, passthrough beside a writer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from tests.persist.test_cache import Counted, ids

import headrace as hr
from headrace.testing import assert_checkpoint_roundtrip


def snapshot_dirs(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir()) if path.exists() else []


def test_the_first_complete_pass_is_saved_later_passes_read_it(tmp_path: Path) -> None:
    source = Counted(15)
    ds = source.dataset().snapshot(tmp_path / "snap")
    assert ids(ds) == list(range(15)) and source.produced == 15
    (fingerprint,) = snapshot_dirs(tmp_path / "snap")
    assert fingerprint == source.dataset().node.data_fingerprint()
    assert snapshot_dirs(tmp_path / "snap" / fingerprint) == [
        "snapshot.hrcache",
        "snapshot.hrcache.crc",
        "snapshot.hrcache.hrx",
        "snapshot.hrcache.json",
    ]
    again = source.dataset().snapshot(tmp_path / "snap")  # an equal pipeline, a new object
    assert ids(again.repeat(2)) == list(range(15)) * 2 and source.produced == 15


def test_an_edited_pipeline_gets_its_own_snapshot_beside_the_first(tmp_path: Path) -> None:
    hr.Dataset.range(5).snapshot(tmp_path)
    list(hr.Dataset.range(5).snapshot(tmp_path))
    assert [int(x) for x in hr.Dataset.range(7).snapshot(tmp_path)] == list(range(7))
    assert len(snapshot_dirs(tmp_path)) == 2


def test_a_pass_stopped_early_leaves_no_snapshot_the_next_pass_writes(tmp_path: Path) -> None:
    source = Counted(10)
    ds = source.dataset().snapshot(tmp_path)
    with iter(ds) as iterator:
        next(iterator)
    (fingerprint,) = snapshot_dirs(tmp_path)
    assert snapshot_dirs(tmp_path / fingerprint) == []
    assert ids(ds) == list(range(10)) and ids(ds) == list(range(10))
    assert source.produced == 11


def test_an_iterator_beside_a_writer_passes_through(tmp_path: Path) -> None:
    source = Counted(6)
    ds = source.dataset().snapshot(tmp_path)
    writer, reader = iter(ds), iter(ds)
    assert ids(reader) == list(range(6))  # read its input, wrote nothing, no error
    assert ids(writer) == list(range(6))
    assert source.produced == 12
    assert ids(ds) == list(range(6)) and source.produced == 12


def test_snapshot_is_read_by_another_process(tmp_path: Path) -> None:
    # np.negative: a function whose fingerprint is the same in any process (a lambda's
    # names the function it was defined in)
    list(hr.Dataset.range(20).map(np.negative).snapshot(tmp_path))
    (fingerprint,) = snapshot_dirs(tmp_path)
    data = tmp_path / fingerprint / "snapshot.hrcache"
    written = data.stat().st_mtime_ns
    script = textwrap.dedent(
        f"""
        import numpy as np, headrace as hr
        ds = hr.Dataset.range(20).map(np.negative).snapshot({str(tmp_path)!r})
        print([int(x) for x in ds])
        """
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [-i for i in range(20)]
    assert snapshot_dirs(tmp_path) == [fingerprint]  # the same fingerprint over there
    assert data.stat().st_mtime_ns == written  # read, not written again


def test_snapshot_checkpoint_round_trip(tmp_path: Path) -> None:
    ds = hr.Dataset.range(12).snapshot(tmp_path).repeat(2)
    assert_checkpoint_roundtrip(ds)


def test_bad_arguments_are_refused_at_build_time(tmp_path: Path) -> None:
    with pytest.raises(hr.InvalidArgumentError, match="compression 'LZ4' is not supported"):
        hr.Dataset.range(3).snapshot(tmp_path, compression="LZ4")
    with pytest.raises(hr.InvalidArgumentError, match="does not exist"):
        hr.Dataset.range(3).snapshot(tmp_path / "missing" / "snap")


def test_the_same_elements_as_tf_datas_snapshot(tmp_path: Path) -> None:
    ours = [int(x) for x in hr.Dataset.range(30).shuffle(8, seed=2).snapshot(tmp_path / "hr")]
    theirs_ds = tf.data.Dataset.range(30).shuffle(8, seed=2).snapshot(str(tmp_path / "tf"))
    theirs = [int(x) for x in theirs_ds.as_numpy_iterator()]
    assert sorted(ours) == sorted(theirs) == list(range(30))
    # both read the saved pass the second time: the order of the first, not a new shuffle
    assert [int(x) for x in hr.Dataset.range(30).shuffle(8, seed=2).snapshot(tmp_path / "hr")] == ours
    assert [int(x) for x in theirs_ds.as_numpy_iterator()] == theirs

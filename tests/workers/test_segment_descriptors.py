"""Shared-memory segments hold no descriptor once mapped (G2).

A process pool keeps dozens of segments mapped: the workers' pooled output
segments in the consumer, and each worker's inputs. ``mmap.mmap`` keeps a
duplicate of the file's descriptor per mapping, which no ``max_open_files``
counted: 43 descriptors with a cap of 4, and ``EMFILE`` under ``ulimit -n 64``.
A seeded generator of process maps (output sizes that travel through segments,
worker counts, prefetch depths) watches ``/proc/self/fd`` at every element, and
compares the values with the same map run in order on threads (the oracle).
"""

from __future__ import annotations

import functools
import os
import random

import numpy as np
import process_fns
import pytest

import headrace as hr
from headrace._workers import shm


def segment_descriptors() -> int:
    """Descriptors of this process open on a shared-memory segment."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        count += target.startswith(os.path.join(shm.SHM_DIR, "headrace-"))
    return count


@pytest.mark.parametrize("seed", range(3))
def test_mapped_segments_hold_no_descriptor(seed: int) -> None:
    rng = random.Random(seed)
    count = rng.randint(30, 80)
    # above OUT_OF_BAND_BYTES, so every output travels through a segment
    size = rng.randint(shm.OUT_OF_BAND_BYTES + 1, 512 << 10)
    fn = functools.partial(process_fns.record_bytes, nbytes=size)
    calls, depth = rng.randint(1, 3), rng.randint(4, 32)
    options = hr.Options(memory_budget="256MiB")
    expected = [np.asarray(x).tobytes() for x in hr.Dataset.range(count).map(fn)]
    ds = (hr.Dataset.range(count).map(fn, num_parallel_calls=calls, workers="processes")
          .prefetch(depth).with_options(options))
    got, worst = [], 0
    with iter(ds) as iterator:
        for element in iterator:
            got.append(np.asarray(element).tobytes())
            worst = max(worst, segment_descriptors())
    assert got == expected
    # (one may be open for a moment, while the collector maps a new segment: counted by
    # the worker pool's slots, see test_process_fds.py)
    assert worst <= 1, f"{worst} descriptors held open on mapped segments"
    assert segment_descriptors() == 0


@pytest.mark.parametrize("size", [33_000, 40_000, 100_000])
def test_bytes_outputs_copied_out_of_a_segment_are_the_workers(size: int) -> None:
    """Oracle: what the function returns. ``bytes`` outputs are copied out of their
    segment, which is then free for the worker to reuse: reported free before the copies
    were made, 41-83 of 300 outputs held the bytes of a later call."""
    fn = functools.partial(process_fns.record_bytes, nbytes=size)
    ds = hr.Dataset.range(300).map(fn, num_parallel_calls=2, workers="processes").prefetch(16)
    got = list(ds)
    wrong = [i for i, value in enumerate(got) if value != bytes([i % 251]) * size]
    assert not wrong, f"{len(wrong)} outputs hold other bytes, first at {wrong[0]}"


def test_a_segment_outlives_its_name_and_frees_with_its_last_view() -> None:
    """Mapped without a descriptor, a segment's bytes stay readable after its name is
    gone; the mapping goes with the last view (no view reads freed memory)."""
    rng = random.Random(7)
    for _ in range(5):
        size = rng.choice([4096, 65536, 1 << 20])
        name = shm.segment_name(os.getpid(), "t")
        written = shm.create_segment(name, size)
        payload = np.frombuffer(rng.randbytes(size), np.uint8)
        written[:] = payload
        read = shm.open_segment(name, size)  # unlinks the name
        assert not os.path.exists(os.path.join(shm.SHM_DIR, name))
        view = np.frombuffer(memoryview(read)[size // 2:], np.uint8)
        del read, written
        assert segment_descriptors() == 0
        assert view.tobytes() == payload[size // 2:].tobytes()

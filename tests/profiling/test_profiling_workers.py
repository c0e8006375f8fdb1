"""Profiles of maps on worker processes: each worker's memory, shared memory, compute vs transfer."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np
import process_fns

import headrace as hr
from headrace.profiling.process import shared_memory_segments
from headrace.profiling.profiler import profile


def _worker_stage(result: hr.profiling.Profile) -> hr.profiling.StageProfile:
    (stage,) = result.worker_stages
    return stage


def test_profile_reports_each_worker_its_traffic_and_shared_memory(tmp_path: Path) -> None:
    # 40 elements of 400 KB each come back through shared memory from 2 workers
    ds = hr.Dataset.range(40).map(
        functools.partial(process_fns.row_array, size=100_000),
        num_parallel_calls=2, workers="processes",
    ).prefetch(2)
    result = profile(ds, epochs=2, interval=0.01, progress=False)
    stage = _worker_stage(result)
    workers = stage.workers
    assert workers is not None and workers.kind == "processes" and workers.count == 2
    assert workers.elements == 80 == stage.elements_out  # both epochs, every element once
    assert 1 <= workers.chunks <= 80
    assert workers.received_bytes >= 80 * 400_000  # the arrays came back...
    assert workers.sent_bytes < 80 * 1_000  # ...and the inputs were small scalars
    assert workers.compute_seconds > 0 and workers.transfer_seconds > 0
    assert len(workers.processes) == 2
    pids = {worker.pid for worker in workers.processes}
    assert all(worker.rss >= worker.uss > 0 for worker in workers.processes)
    peaks = result.peak_worker_rss()
    assert pids <= set(peaks) and all(peaks[pid] > 0 for pid in pids)
    segments, segment_bytes = result.peak_shm
    assert segments >= 1 and segment_bytes >= 400_000  # a result segment was seen live
    text = result.format()
    assert "worker processes" in text and "compute" in text and "transfer" in text
    for pid in pids:
        assert f"pid {pid}: RSS" in text
    page = result.to_html()
    assert 'id="workers"' in page and str(min(pids)) in page
    # and once the pipeline is closed, none of its segments is left
    assert shared_memory_segments() == (0, 0)


def test_thread_maps_show_no_worker_processes() -> None:
    result = profile(hr.Dataset.range(50).map(np.negative, num_parallel_calls=2),
                     progress=False)
    assert result.worker_stages == ()
    assert "worker processes" not in result.format()
    assert 'id="workers"' not in result.to_html()


def test_shared_memory_segments_counts_this_pipelines_segments_only() -> None:
    from headrace._workers.shm import SHM_DIR, create_segment, segment_name, unlink_segment

    name = segment_name(os.getpid(), "test-")
    mapping = create_segment(name, 3 * 4096)
    other = os.path.join(SHM_DIR, f"headrace-{os.getpid() + 1_000_000}-1-x")
    try:
        with open(other, "wb") as handle:  # another owner's segment: not ours
            handle.write(b"x" * 100)
        assert shared_memory_segments() == (1, 3 * 4096)
    finally:
        del mapping  # (a segment is unmapped with its last reference)
        unlink_segment(name)
        os.unlink(other)
    assert shared_memory_segments() == (0, 0)


def test_every_sample_of_the_memory_line_counts_the_workers() -> None:
    # Workers' memory was read every 5th sample only: the charged memory between dipped
    # by the workers' share, and the growth peak missed theirs
    import time

    from headrace.profiling.process import snapshot

    deadline = time.monotonic() + 10
    while snapshot(detailed=False, workers=True).worker_count and time.monotonic() < deadline:
        time.sleep(0.05)  # an earlier test's workers still exiting would blur the window
    ds = hr.Dataset.range(200).map(process_fns.sleepy, num_parallel_calls=2,
                                  workers="processes")
    result = profile(ds, interval=0.01, progress=False)
    with_workers = [i for i, sample in enumerate(result.samples) if sample.memory.worker_count]
    # (every 5th sample read them: 1 or 2 of 6 before; 200 calls of 2 ms on 2 workers
    # last ~20 samples, so 6 leaves room for a slow start)
    assert len(with_workers) >= 6
    run = result.samples[with_workers[0]:with_workers[-1] + 1]
    assert all(sample.memory.worker_count >= 2 and sample.memory.workers > 0 for sample in run), [
        (s.memory.worker_count, s.memory.workers) for s in result.samples]

"""Every descriptor headrace opens counts against the file cap (G2), its own /proc reads too.

``stats()`` reads /proc/self/status and lists /proc/self/fd; the default budget reads
/proc/meminfo and the cgroup's limit. Those descriptors used to be opened beside the
file pool, so with the pool full of readers the process held one more than the cap.
A seeded generator of pipelines runs under RLIMIT_NOFILE 64 (pool cap 16) in a
subprocess. Every /proc or /sys open (an audit hook sees it before it happens) and a
watcher thread check the process's descriptors against the cap.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_SCRIPT = textwrap.dedent(
    """
    import os, random, resource, sys, threading
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    import headrace as hr
    from headrace.io.filepool import get_default_pool

    directory, seed = sys.argv[1], int(sys.argv[2])
    rng = random.Random(seed)
    cap = get_default_pool().max_open_files
    assert cap == 16, cap
    before = len(os.listdir("/proc/self/fd"))  # (the listing's own descriptor included)
    worst = [0]

    def note(extra):
        worst[0] = max(worst[0], len(os.listdir("/proc/self/fd")) - before + extra)

    def hook(event, args):
        # Before headrace opens a /proc or /sys file: the descriptors it will hold then.
        if event == "open" and isinstance(args[0], str) and args[0].startswith(("/proc", "/sys")):
            note(1)

    sys.addaudithook(hook)
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            try:
                note(0)
            except OSError:
                pass

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    files = hr.Dataset.list_files(directory + "/*.txt", shuffle=False)

    def pipeline(first):
        # The first keeps 16 or more files open between its pulls: the pool is full.
        cycle = rng.choice([16, 24]) if first else rng.choice([4, 8, 16, 24])
        parallel = None if first else rng.choice([None, 2, 4])
        ds = files.interleave(lambda f: hr.TextLineDataset(f, buffer_size=16),
                              cycle_length=cycle, num_parallel_calls=parallel)
        return ds.prefetch(rng.choice([1, 4])) if rng.random() < 0.5 else ds

    iterators = [iter(pipeline(k == 0)) for k in range(rng.randint(2, 4))]
    live = list(range(len(iterators)))
    lines = 0
    while live:
        k = rng.choice(live)
        try:
            next(iterators[k])
            lines += 1
        except StopIteration:
            live.remove(k)
        if rng.random() < 0.05 or lines % 400 == 0:
            iterators[k].stats()  # reads /proc/self/status, lists /proc/self/fd
    stop.set()
    watcher.join()
    for iterator in iterators:
        iterator.close()
    print(worst[0], lines, len(iterators))
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3))
def test_proc_reads_count_against_the_file_cap(tmp_path: Path, seed: int) -> None:
    for i in range(40):
        (tmp_path / f"{i:03d}.txt").write_text("".join(f"{i} {j}\n" for j in range(40)))
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(tmp_path), str(seed)],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    worst, lines, pipelines = (int(word) for word in done.stdout.split())
    assert lines == 40 * 40 * pipelines  # nothing lost to the cap
    assert worst <= 16, f"seed {seed}: {worst} descriptors open, cap 16"

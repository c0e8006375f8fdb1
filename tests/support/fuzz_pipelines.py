"""The budget fuzzer: random pipelines, random element sizes, random budgets (G1).

``random_spec(seed)`` draws a JSON-able description of one pipeline: a source
(a generator, an array, interleaved inner generators), an element-size
distribution (uniform, heavy-tailed, a sudden 100x jump, views of larger
bases), a payload kind (arrays, lists, dicts, sets, objects, bytes,
memoryviews) and a chain of transformations (sequential and parallel map,
filter, shuffle, prefetch, batch, padded_batch, unbatch, rebatch, repeat,
take, skip, zip, cache, and tf.data's wider surface: window, group_by_window,
ragged_batch, unique, scan, take_while, ignore_errors, sample_from_datasets),
under a budget of 16-96 MiB.

Run as a script, it reads a JSON list of specs on stdin and runs each in this
(fresh) process with a slow consumer, printing one JSON result per spec:
whether it finished or raised MemoryBudgetError, the accounted peak against
the budget, every booking that put a stage over its share, and the growth of
RssAnon + RssShmem from the start of the pipeline. ``tests/generators/test_budget_fuzz.py``
runs a small sweep in CI; ``benchmarks/bench_budget_fuzz.py`` a large one.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import json
import random
import sys
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any

MiB = 1 << 20

PAYLOADS = ("array", "array", "array", "list", "dict", "set", "object", "bytes", "memoryview")
DISTRIBUTIONS = ("uniform", "heavy", "jump", "views")


def random_spec(
    seed: int, *, wider: bool = True, processes: bool = False, newer: bool = False,
    augment: bool = True,
) -> dict[str, Any]:
    """One random pipeline, as plain data (reproducible from ``seed``).

    ``wider=False`` leaves out tf.data's wider surface (window, group_by_window, ...):
    the pipeline a seed named by a regression test had when the test was written.
    ``processes=True`` adds maps on worker processes (``xmap``) to the choices; off,
    a seed draws the same pipeline as before they existed.
    ``newer=True`` adds, each from an RNG of its own (the other draws of a seed stay
    what they were): JPEG elements decoded by a parallel map that books the decoded
    size from the header first (``map(..., output_nbytes=decoded_nbytes)``, issue 14)
    and, with ``processes``, interleaves whose inner pipelines run in worker processes
    (``interleave(..., workers="processes")``): as the source (shards read in workers)
    and as a stage (each element expanded in a worker).
    ``augment`` (with ``newer``): the image decode may be an augmentation instead (see
    :data:`AUGMENTATIONS`), from an RNG of its own; ``False`` keeps the plain decodes
    a seed had before augmentations were drawn (the seeds regression tests name).
    """
    rng = random.Random(seed)
    budget_mib = rng.choice((16, 24, 32, 48, 64, 96))
    distribution = rng.choice(DISTRIBUTIONS)
    payload = rng.choice(PAYLOADS)
    # bytes batch into object arrays: the in-place batch keeps the elements' objects
    batchable = payload in ("array", "dict", "bytes")
    # Elements stay under a quarter of the budget even at the heavy tail's 64x (a single
    # element the user's code made larger than the budget cannot be capped by anyone).
    base = rng.choice([b for b in (4 << 10, 16 << 10, 64 << 10, 256 << 10)
                       if b * 64 <= budget_mib * MiB // 4])
    spec: dict[str, Any] = {
        "seed": seed,
        "budget_mib": budget_mib,
        "source": rng.choice(("generator", "generator", "array", "interleave")),
        "count": rng.randint(20, 300),
        "distribution": distribution,
        "base_bytes": base,
        "payload": payload,
        "ops": [],
    }
    if spec["source"] == "array":  # random-access rows: fixed size, views of user memory
        spec["payload"], batchable = "array", True
    ops: list[list[Any]] = []
    batched = False
    rows_fixed = False
    for _ in range(rng.randint(1, 6)):
        choices = ["map", "pmap", "filter", "shuffle", "prefetch", "repeat", "take", "skip"]
        if processes:
            choices += ["xmap", "xmap"]
        if batchable and not batched:
            choices += ["batch", "batch", "padded_batch"]
        if batched:
            choices.append("unbatch")
            if rows_fixed:  # rebatch concatenates rows: padded widths differ between batches
                choices.append("rebatch")
        if not batched and payload == "array":
            choices.append("zip")
        op = rng.choice(choices)
        if op == "map":
            ops.append(["map", rng.choice(("identity", "copy", "grow", "view_of_big"))])
        elif op == "pmap":
            ops.append(["pmap", rng.choice((1, 2, 4, 16)),
                        rng.choice(("identity", "copy", "grow", "view_of_big"))])
        elif op == "xmap":
            ops.append(["xmap", rng.choice((1, 2)),
                        rng.choice(("identity", "copy", "grow", "view_of_big"))])
        elif op == "filter":
            ops.append(["filter"])
        elif op == "shuffle":
            ops.append(["shuffle", rng.choice((2, 16, 1000, 1_000_000))])
        elif op == "prefetch":
            ops.append(["prefetch", rng.choice((1, 4, 64, 10_000, -1))])
        elif op == "repeat":
            ops.append(["repeat", 2])
        elif op == "take":
            ops.append(["take", rng.randint(1, 200)])
        elif op == "skip":
            ops.append(["skip", rng.randint(0, 20)])
        elif op in ("batch", "padded_batch"):
            ops.append([op, rng.choice((2, 4, 8, 32))])
            batched = True
            rows_fixed = op == "batch" and (
                spec["distribution"] == "uniform" or spec["source"] == "array"
            ) and not any(o[0] in ("map", "pmap") and o[-1] == "grow" for o in ops)
        elif op == "unbatch":
            ops.append(["unbatch"])
            batched = False
        elif op == "rebatch":
            ops.append(["rebatch", rng.choice((1, 3, 16))])
        elif op == "zip":
            ops.append(["zip"])
    # cache() (in memory, spilling to disk past its share) at a random place, drawn from
    # an RNG of its own so that the other draws of a seed stay what they were; only for
    # payloads its on-disk format stores (not sets, objects or memoryviews).
    extra = random.Random(seed ^ 0x5EED_CAC4E)
    if spec["payload"] in ("array", "dict", "bytes", "list") and extra.random() < 0.4:
        at = extra.randint(0, len(ops))
        ops[at:at] = [["cache"]] + ([["repeat", 2]] if extra.random() < 0.5 else [])
    # tf.data's wider surface, from an RNG of its own too (earlier seeds keep their
    # pipelines), appended last, where the stream's kind (rows or batches) is known.
    draw = random.Random(seed ^ 0x7F5EED)
    if wider and draw.random() < 0.5:
        kinds = ["scan", "take_while", "ignore_errors", "unique"]
        if not batched and spec["payload"] == "array":
            kinds += ["window", "group_by_window", "ragged_batch", "sample"]
        kind = draw.choice(kinds)
        if kind == "window":
            ops.append(["window", draw.choice((2, 4, 16)), draw.choice((1, 2, 5))])
        elif kind == "group_by_window":
            ops.append(["group_by_window", draw.choice((2, 3)), draw.choice((2, 8))])
        elif kind == "ragged_batch":
            ops.append(["ragged_batch", draw.choice((2, 8, 32))])
        else:
            ops.append([kind])
    spec["ops"] = ops
    if newer:
        _newer_stages(spec, seed, processes=processes)
        if augment:
            _augment(spec, seed)
    return spec


#: The image ops a ``decode`` op may be instead of a plain decode (issue 14), each booked
#: from the JPEG's header before it runs (:class:`AugmentNbytes`): the fused random
#: resized crop, InceptionCrop on (index, bytes) after ``enumerate``, the windowed
#: ``decode_and_crop_jpeg``, a decode then ``resize``, a decode then a random flip.
AUGMENTATIONS = ("rrc", "inception", "window", "resize", "flip")


def _augment(spec: dict[str, Any], seed: int) -> None:
    """Turn about half the drawn image decodes into augmentations (RNG of its own)."""
    draw = random.Random(seed ^ 0xA06_C0DE)
    for op in spec["ops"]:
        if op[0] == "decode" and draw.random() < 0.6:
            op[3] = draw.choice(AUGMENTATIONS)
            op.append(draw.choice((8, 24, 64)))  # the output side of crops and resizes


#: Ops of tf.data's wider surface that need 1-D rows (a decoded image is 3-D).
_ROWS_ONLY = ("window", "group_by_window", "ragged_batch", "sample")


def _newer_stages(spec: dict[str, Any], seed: int, *, processes: bool) -> None:
    """Add the stages of ``random_spec(newer=True)`` to ``spec`` (see there)."""
    ops = spec["ops"]
    images = random.Random(seed ^ 0x1A9E_DEC0)
    if spec["payload"] == "array" and spec["source"] != "array" and images.random() < 0.35:
        # JPEGs whose decoded size follows the spec's distribution (jumps, heavy tails,
        # crops that are views of the decoded image), decoded first thing
        spec["payload"] = "jpeg"
        where = images.choice(("threads", "processes")) if processes else "threads"
        spec["ops"] = ops = [op for op in ops if op[0] not in _ROWS_ONLY]
        ops.insert(0, ["decode", images.choice((1, 2, 4)), where,
                       images.choice(("plain", "plain", "crop"))])
    if not processes:
        return
    workers = random.Random(seed ^ 0x3C_1EAF)
    if spec["source"] in ("generator", "interleave") and workers.random() < 0.4:
        spec["source"] = "xinterleave"  # shards opened and read in worker processes
        cycle = workers.choice((1, 2, 3))  # cycle, block, workers (at most cycle)
        spec["interleave"] = [cycle, workers.choice((1, 2)), min(workers.choice((1, 2)), cycle)]
    if spec["payload"] in ("array", "dict", "bytes", "list") and workers.random() < 0.3:
        # each element expanded (1-2 copies) by an inner pipeline in a worker, at a place
        # where the stream is rows (before any batch)
        batched_at = next((k for k, op in enumerate(ops)
                           if op[0] in ("batch", "padded_batch", "window")), len(ops))
        at = workers.randint(1 if ops and ops[0][0] == "decode" else 0, max(batched_at, 0))
        cycle = workers.choice((1, 2, 4))  # cycle, copies, workers (at most cycle)
        ops.insert(at, ["xinterleave", cycle, workers.choice((1, 2)),
                        min(workers.choice((1, 2)), cycle)])


def cache_spec(seed: int) -> dict[str, Any]:
    """One pipeline of the family of seed 120's breach: heavy elements (lists, arrays,
    dicts, bytes) through shuffle / repeat / map around ``cache()``, large enough that
    the cache spills, so its writer and reader hold elements of up to a quarter of the
    budget (where the spill writer once held two unbooked copies of each element)."""
    rng = random.Random(seed)
    budget_mib = rng.choice((16, 32, 48, 64))
    base = rng.choice([b for b in (64 << 10, 256 << 10, 1 << 20) if b * 64 <= budget_mib * MiB // 4]
                      or [64 << 10])
    ops: list[list[Any]] = []
    if rng.random() < 0.4:  # a large shuffle buffer fragments the heap (seed 171's family)
        ops.append(["shuffle", rng.choice((4, 1000))])
    if rng.random() < 0.5:
        ops.append(["map", rng.choice(("identity", "copy", "grow"))])
    if rng.random() < 0.5:
        ops.append(["repeat", 2])
    ops.append(["cache"])
    if rng.random() < 0.7:
        ops.append(["repeat", rng.choice((2, 3))])
    if rng.random() < 0.3:
        ops.append(["prefetch", rng.choice((1, 4))])
    if rng.random() < 0.3:
        ops.append(["scan"])
    return {
        "seed": seed,
        "budget_mib": budget_mib,
        "source": rng.choice(("generator", "generator", "interleave")),
        "count": rng.randint(60, 240),
        "distribution": rng.choice(("heavy", "heavy", "jump", "uniform", "views")),
        "base_bytes": base,
        "payload": rng.choice(("list", "list", "array", "dict", "bytes")),
        "ops": ops,
    }


def process_spec(seed: int, *, newer: bool = True, augment: bool = True) -> dict[str, Any]:
    """``random_spec(seed, processes=True, newer=...)`` with one process map at least
    (first, if the draw had none): the pipelines of the process-stage sweeps.
    ``newer=False``: the pipeline a seed had before process interleaves and image decodes
    were drawn (the seeds regression tests name)."""
    spec = random_spec(seed, processes=True, newer=newer, augment=augment)
    if not any(op[0] == "xmap" for op in spec["ops"]):
        spec["ops"].insert(1 if spec["ops"] and spec["ops"][0][0] == "decode" else 0,
                           ["xmap", 1 + seed % 2, "copy"])
    return spec


#: Size sequences an adversary picks (issue 23), drawn only by :func:`adversarial_spec`:
#: thousands of tiny outputs, then ~1000x larger ones; giants and dwarfs in turn.
ADVERSARIAL = ("regime", "giant_dwarf")
#: Ops left out of adversarial specs: batches of the giants would be refused, not
#: overdrawn; a shuffle's buffer shrinks to its share, which a sequential map (the
#: oracle of order) changes, since it holds no share.
_ASSEMBLING = ("batch", "padded_batch", "unbatch", "rebatch", "zip", "shuffle", *(
               "window", "group_by_window", "ragged_batch", "sample"))


def adversarial_spec(seed: int, *, processes: bool = False) -> dict[str, Any]:
    """``random_spec(seed)`` whose first stage is a parallel map making outputs of an
    adversarial size sequence from 16-byte inputs (the ``explode`` map): the map cannot
    tell an output's size from its input. The extra draws come from an RNG of their
    own, so ``random_spec(seed)`` itself stays what it was."""
    spec = random_spec(seed, processes=processes)
    rng = random.Random(seed ^ 0xAD5E_0023)
    budget = spec["budget_mib"] * MiB
    spec["source"], spec["payload"] = "generator", "array"
    spec["distribution"] = rng.choice(ADVERSARIAL)
    if spec["distribution"] == "regime":
        spec["count"] = rng.randint(1500, 4000)
        spec["regime_at"] = rng.randint(spec["count"] // 2, spec["count"] - 20)
        spec["small"] = rng.choice((64, 128, 256))
        spec["large"] = budget // rng.choice((24, 48, 96))
    else:
        spec["count"] = rng.randint(40, 300)
        spec["small"], spec["large"] = 64, budget // rng.choice((6, 12, 24))
    ops = [op for op in spec["ops"] if op[0] not in _ASSEMBLING and op[0] != "xmap"]
    kind = rng.choice(("pmap", "xmap") if processes else ("pmap",))
    calls = rng.choice((1, 2)) if kind == "xmap" else rng.choice((2, 4, 16))
    spec["ops"] = [[kind, calls, "explode"], *ops]
    return spec


def newer_spec(seed: int, *, augment: bool = True) -> dict[str, Any]:
    """``process_spec(seed)`` with a process interleave and an image decode at least
    (added where the draw had none): the sweep of the stages ``newer`` adds.
    ``augment=False``: the plain decodes the seed had before augmentations were drawn."""
    spec = process_spec(seed, augment=augment)
    rng = random.Random(seed ^ 0x7E57)
    if spec["source"] == "array":
        spec["source"] = "generator"
    if spec["payload"] not in ("array", "jpeg"):
        spec["payload"] = "array"
    if spec["payload"] == "array":
        spec["payload"] = "jpeg"
        spec["ops"] = [op for op in spec["ops"] if op[0] not in _ROWS_ONLY]
        spec["ops"].insert(0, ["decode", rng.choice((1, 2, 4)),
                               rng.choice(("threads", "processes")), rng.choice(("plain", "crop"))])
        if augment:
            _augment({"ops": spec["ops"][:1]}, seed ^ 0x5A)
    if spec["source"] != "xinterleave" and not any(op[0] == "xinterleave" for op in spec["ops"]):
        spec["source"] = "xinterleave"
        cycle = rng.choice((1, 2, 3))
        spec["interleave"] = [cycle, rng.choice((1, 2)), min(rng.choice((1, 2)), cycle)]
    return spec


#: How a ``slot_spec``'s interleave runs: (num_parallel_calls (-1: AUTOTUNE),
#: deterministic, workers).
SLOT_MODES: dict[str, tuple[int | None, bool | None, str]] = {
    "sequential": (None, None, "threads"),
    "threads": (2, True, "threads"),
    "first_ready": (2, False, "threads"),
    "autotune": (-1, True, "threads"),
    "processes": (2, True, "processes"),
}


def slot_spec(seed: int, *, processes: bool = False) -> dict[str, Any]:
    """``random_spec(seed)`` whose source is an interleave of inner pipelines of an
    adversarial size sequence (issue 23): in every shard thousands of tiny elements,
    then ~1000x larger ones (``regime``), or giants and dwarfs in turn
    (``giant_dwarf``). The interleave's run mode, cycle and block are drawn too, all
    from an RNG of their own, so ``random_spec(seed)`` itself stays what it was.
    ``first_ready`` runs are out of order: compare them as multisets, not in order."""
    spec = random_spec(seed, processes=processes)
    rng = random.Random(seed ^ 0x5107_0023)
    budget = spec["budget_mib"] * MiB
    modes = [mode for mode in SLOT_MODES if processes or mode != "processes"]
    spec["source"] = "slots"
    spec["slots"] = [rng.choice((1, 2, 3, 4)), rng.choice((1, 2, 3)), rng.choice(modes)]
    spec["shards"] = rng.randint(2, 6)
    spec["slot_sizes"] = rng.choice(("regime", "giant_dwarf"))
    if spec["payload"] in ("dict", "jpeg"):  # (the shards make plain arrays)
        spec["payload"] = "array"
    if spec["slot_sizes"] == "regime":
        spec["count"] = rng.randint(1500, 4000)
        per = spec["count"] // spec["shards"]
        spec["regime_at"] = rng.randint(per // 2, max(per - 20, per // 2))
        spec["small"] = rng.choice((64, 128, 256))
        spec["large"] = min(spec["small"] * 1000, budget // 24)
    else:
        spec["count"] = rng.randint(40, 300)
        spec["small"], spec["large"] = 64, budget // rng.choice((24, 48, 96))
    return spec


def _slot_size(spec: dict[str, Any], index: int) -> int:
    """The size of element ``index`` of a ``slot_spec`` shard."""
    if spec["slot_sizes"] == "regime":
        return int(spec["small"] if index < spec["regime_at"] else spec["large"])
    return int(spec["large"] if index % 2 else spec["small"])


def error_spec(seed: int) -> dict[str, Any]:
    """One pipeline whose errors a read-ahead stage holds before handing them out: the
    family of ``newer_spec(2147483646)``'s growth.

    An error keeps the frames it passed through, with their locals: the input of a map
    function that raised and its temporaries (``fail``: a map, on threads or processes,
    that makes a temporary of ``factor`` times its input and raises on every
    ``period``-th element), or the rows a ``padded_batch`` had pulled when the budget
    refused its batch. Read-ahead stages above (parallel maps on threads or processes,
    prefetch, process interleaves) keep such errors while more calls run; ignore_errors
    at the end drops the functions' errors, so the run goes on past them.
    """
    rng = random.Random(seed)
    budget_mib = rng.choice((16, 24, 32, 48))
    base = rng.choice((64 << 10, 128 << 10, 256 << 10))
    ops: list[list[Any]] = []
    kind = rng.choice(("fail", "refuse", "both"))
    if kind in ("fail", "both"):
        where = rng.choice(("pmap", "pmap", "xmap", "map"))  # (each worker process starts
        calls = rng.choice((1, 2) if where == "xmap" else (2, 4, 8))  # an interpreter)
        # the temporary stays under a quarter of the budget (one the user's function makes
        # larger is the function's own peak, which no stage can cap)
        ops.append(["fail", where, calls, rng.choice((2, 3)), rng.choice((8, 16)),
                    budget_mib * MiB // 4])
    if kind in ("refuse", "both"):  # batches of 16-64 rows: some cannot fit the budget
        ops.append(["padded_batch", rng.choice((16, 32, 64))])
    processes = sum(op[0] == "fail" and op[1] == "xmap" for op in ops)
    for _ in range(rng.randint(1, 3)):  # read-ahead stages above, that hold the errors
        stage = rng.choice(("pmap", "pmap", "pmap", "xmap", "prefetch", "xinterleave"))
        if stage in ("xmap", "xinterleave") and processes >= 2:
            stage = "pmap"  # (at most two process stages: each starts interpreters)
        if stage == "pmap":
            ops.append(["pmap", rng.choice((2, 4, 8)), "identity"])
        elif stage == "xmap":
            ops.append(["xmap", rng.choice((1, 2)), "identity"])
        elif stage == "prefetch":
            ops.append(["prefetch", rng.choice((1, 4, 64, -1))])
        elif not any(op[0] == "padded_batch" for op in ops):  # (rows only)
            ops.append(["xinterleave", rng.choice((1, 2)), 1, 1])
        processes += stage in ("xmap", "xinterleave")
    ops.append(["ignore_errors"])
    return {
        "seed": seed,
        "budget_mib": budget_mib,
        "source": rng.choice(("generator", "generator", "interleave")),
        "count": rng.randint(100, 300),
        "distribution": rng.choice(("uniform", "heavy", "views")),
        "base_bytes": base,
        "payload": "array",
        "ops": ops,
    }


# -- running one spec (in the child) --------------------------------------------------------


def _size(spec: dict[str, Any], index: int) -> int:
    base = spec["base_bytes"]
    distribution = spec["distribution"]
    if distribution == "uniform":
        return base
    if distribution == "heavy":  # Pareto tail, bounded at 64x
        rng = random.Random(spec["seed"] * 1_000_003 + index)
        return int(min(base * rng.paretovariate(1.2), base * 64))
    if distribution == "jump":
        return base // 16 if index < spec["count"] // 3 else base * 100 // 16
    if distribution == "regime":  # tiny, then ~1000x: the estimate is far behind
        return int(spec["small"] if index < spec["regime_at"] else spec["large"])
    if distribution == "giant_dwarf":
        return int(spec["large"] if index % 2 else spec["small"])
    return base  # views: the size of the view; its base is 4x larger


class Holder:
    """An object whose payload is in its ``__dict__`` (sys.getsizeof sees ~56 B)."""

    def __init__(self, payload: Any) -> None:
        self.payload = payload


def _element(spec: dict[str, Any], index: int, np: Any) -> Any:
    nbytes = max(_size(spec, index), 1)
    if spec["distribution"] in ADVERSARIAL:  # 16 bytes: bytes 8-15 say the output's size
        header = np.full(16, index % 251, np.uint8)
        header[8:] = np.array([nbytes], np.int64).view(np.uint8)
        return header
    if spec["distribution"] == "views":
        big = np.full(nbytes * 4, index % 251, np.uint8)
        array = big[nbytes : 2 * nbytes]
    else:
        array = np.full(nbytes, index % 251, np.uint8)
    if spec["payload"] == "dict":
        return {"x": array, "i": np.int64(index)}
    return array


def _payload(spec: dict[str, Any], array: Any) -> Any:
    """The element in the spec's payload kind (applied by a map: generators need a spec)."""
    nbytes = len(array)
    payload = spec["payload"]
    if payload == "list":
        return [array[: nbytes // 2].copy(), array[nbytes // 2 :].copy()]
    if payload == "set":
        return {bytes(array[: nbytes // 2]), nbytes}
    if payload == "object":
        return Holder(array)
    if payload == "bytes":
        return array.tobytes()
    if payload == "jpeg":
        return _jpeg(nbytes, int(array[0]) if nbytes else 0)
    return memoryview(array.tobytes())


def _image_shape(nbytes: int) -> tuple[int, int]:
    """A near-square RGB image of about ``nbytes`` decoded (at least 8x8 pixels)."""
    width = max(8, int((nbytes / 3) ** 0.5))
    return max(8, nbytes // (3 * width)), width


def _jpeg(nbytes: int, value: int) -> bytes:
    """A JPEG decoding to about ``nbytes``: a colour ramp from ``value`` (cached by size)."""
    return _jpeg_of(*_image_shape(nbytes), value)


@functools.lru_cache(maxsize=64)
def _jpeg_of(height: int, width: int, value: int) -> bytes:
    import numpy as np
    import simplejpeg

    ramp = (np.arange(width, dtype=np.uint16) * 7 + value) % 256
    image = np.empty((height, width, 3), np.uint8)
    image[...] = ramp.astype(np.uint8)[None, :, None]
    return bytes(simplejpeg.encode_jpeg(image, quality=80))


class Decode:
    """The decode of a ``decode`` op: ``headrace.image.decode_jpeg`` to RGB; ``crop``: then
    the centre half, a view pinning the whole decoded image (as a crop of a decode is)."""

    def __init__(self, crop: bool) -> None:
        self.crop = crop

    def __call__(self, contents: Any) -> Any:
        import headrace.image as hi

        image = hi.decode_jpeg(contents, channels=3)
        return image[image.shape[0] // 4 :][: max(image.shape[0] // 2, 1)] if self.crop else image


class Augment:
    """An augmentation of a ``decode`` op (see :data:`AUGMENTATIONS`) to ``side`` x
    ``side``: each element's random draws are seeded from its bytes (the same output in
    every run, whatever the workers), InceptionCrop's from its index."""

    def __init__(self, kind: str, side: int) -> None:
        import headrace.image as hi

        self.kind, self.side = kind, side
        self.inception = hi.InceptionCrop((side, side), seed=7) if kind == "inception" else None

    def __call__(self, *element: Any) -> Any:
        import headrace.image as hi

        if self.inception is not None:
            return self.inception(*element)
        (contents,) = element
        seed = (3, len(contents))
        if self.kind == "rrc":
            return hi.random_resized_crop(contents, (self.side, self.side), seed=seed)
        if self.kind == "window":
            header = hi.read_header(contents)
            window = [header.height // 4, header.width // 4,
                      max(header.height // 2, 1), max(header.width // 2, 1)]
            return hi.decode_and_crop_jpeg(contents, window, channels=3)
        image = hi.decode_jpeg(contents, channels=3)
        if self.kind == "resize":
            return hi.resize(image, (self.side, self.side))
        return hi.random_flip_left_right(image, seed=seed)  # "flip": a view, or the image

    def float_output(self) -> bool:
        return self.kind in ("rrc", "inception", "resize")


class AugmentNbytes:
    """``output_nbytes`` of an :class:`Augment`: what its call may hold at most, from the
    JPEG's header before decoding — the decoded image (the Python paths decode it whole;
    the C path only a window of it) and a float32 output of ``side`` x ``side``."""

    def __init__(self, augment: Augment) -> None:
        self.extra = augment.side * augment.side * 3 * 4 if augment.float_output() else 0

    def __call__(self, element: Any) -> int:  # (index, bytes) for InceptionCrop
        contents = element[-1] if isinstance(element, tuple) else element
        return decoded_rgb_nbytes(contents) + self.extra


def decoded_rgb_nbytes(contents: Any) -> int:
    """The decoded size from the JPEG's header (before decoding): ``output_nbytes``."""
    import headrace.image as hi

    return hi.decoded_nbytes(contents, channels=3)


class Shard:
    """The inner pipeline of shard ``i`` of the ``xinterleave`` source: elements
    ``i*per .. (i+1)*per`` of the spec, generated in the worker process reading it."""

    def __init__(self, spec: dict[str, Any], per: int) -> None:
        self.spec, self.per = spec, per

    def __call__(self, i: Any) -> Any:
        import numpy as np

        import headrace as hr

        spec, start = self.spec, int(i) * self.per

        def generate() -> Any:
            for index in range(start, start + self.per):
                yield _element(spec, index, np)

        return hr.Dataset.from_generator(generate, output_signature=_element_spec(spec))


class SlotShard:
    """The inner pipeline of shard ``i`` of a ``slot_spec``: its size sequence, each
    element made as it is yielded (the generator keeps no reference to it)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec

    def __call__(self, i: Any) -> Any:
        import numpy as np

        import headrace as hr

        spec, shard = self.spec, int(i)

        def generate() -> Any:
            for index in range(spec["count"] // spec["shards"]):
                yield np.full(_slot_size(spec, index), (shard * 31 + index) % 251, np.uint8)

        return hr.Dataset.from_generator(generate, output_signature=_element_spec(spec))


class Copies:
    """The inner pipeline of an ``xinterleave`` op: the element, ``copies`` times."""

    def __init__(self, copies: int) -> None:
        self.copies = copies

    def __call__(self, *element: Any) -> Any:
        import headrace as hr

        value = element[0] if len(element) == 1 else element
        return hr.Dataset.from_tensors(value).repeat(self.copies)


def _element_spec(spec: dict[str, Any]) -> Any:
    import numpy as np

    import headrace as hr

    if spec["payload"] == "dict":
        return {"x": hr.TensorSpec((None,), np.uint8), "i": hr.TensorSpec((), np.int64)}
    return hr.TensorSpec((None,), np.uint8)


def _map_fn(kind: str, np: Any) -> Any:
    def identity(x: Any) -> Any:
        return x

    def copy(x: Any) -> Any:
        return x.copy() if isinstance(x, np.ndarray) else x

    def grow(x: Any) -> Any:  # outputs 4x the input: the in-flight estimate must catch up
        if isinstance(x, np.ndarray) and x.ndim == 1 and x.dtype == np.uint8 and len(x) < 2 * MiB:
            return np.concatenate([x, x, x, x])
        return x

    def view_of_big(x: Any) -> Any:  # a small view pinning a 4x temporary
        if isinstance(x, np.ndarray) and x.ndim == 1 and x.dtype == np.uint8:
            big = np.concatenate([x, x, x, x])
            return big[: len(x)]
        return x

    def explode(x: Any) -> Any:  # an adversarial spec's input says its output's size
        if isinstance(x, np.ndarray) and x.dtype == np.uint8 and len(x) == 16:
            return np.full(int(x[8:].view(np.int64)[0]), x[0], np.uint8)
        return x

    fn = {"identity": identity, "copy": copy, "grow": grow, "view_of_big": view_of_big,
          "explode": explode}[kind]

    def on_first(*components: Any) -> Any:  # zip's tuples arrive as arguments
        if len(components) == 1:
            return fn(components[0])
        return (fn(components[0]), *components[1:])

    return on_first


def _fixed_rows(spec: dict[str, Any]) -> bool:
    return bool(spec["distribution"] == "uniform" or spec["source"] == "array")


def _window(ds: Any, op: list[Any], spec: dict[str, Any]) -> Any:
    size, shift, fixed = op[1], op[2], _fixed_rows(spec)

    def batched(*windows: Any) -> Any:  # a zipped stream's windows come as a tuple
        import headrace as hr

        window = windows[0] if len(windows) == 1 else hr.Dataset.zip(windows)
        return window.batch(size) if fixed else window.padded_batch(size)

    return ds.window(size, shift=shift).flat_map(batched)


def _group_by_window(ds: Any, op: list[Any], spec: dict[str, Any]) -> Any:
    import headrace as hr

    groups, size, fixed = op[1], op[2], _fixed_rows(spec)

    def batched(key: Any, window: Any) -> Any:
        rows = window.map(lambda x, i: x)
        return rows.batch(size) if fixed else rows.padded_batch(size)

    return hr.Dataset.zip((ds, hr.Dataset.range(10**9))).group_by_window(
        lambda x, i: i % groups, batched, window_size=size
    )


def _sample(ds: Any, op: list[Any], spec: dict[str, Any]) -> Any:
    import numpy as np

    import headrace as hr

    # a second input of its own (two iterators of one recipe node would share its account),
    # of the stream's structure: rows, or (row, index) pairs after a ``zip`` (seed 110015)
    other = hr.Dataset.from_tensor_slices(np.zeros((50, max(spec["base_bytes"] // 64, 1)), np.uint8))
    if any(op[0] == "zip" for op in spec["ops"]):
        other = hr.Dataset.zip((other, hr.Dataset.range(10**9)))
    return hr.Dataset.sample_from_datasets([ds, other], seed=spec["seed"])


def _unique(ds: Any, op: list[Any], spec: dict[str, Any]) -> Any:
    import headrace as hr

    # distinct indices: the set of values seen grows all along
    return hr.Dataset.zip((ds, hr.Dataset.range(10**9).unique())).map(lambda x, i: x)


_WIDER: dict[str, Any] = {
    "window": _window,
    "group_by_window": _group_by_window,
    "ragged_batch": lambda ds, op, spec: ds.ragged_batch(op[1]),
    "sample": _sample,
    "scan": lambda ds, op, spec: ds.scan(0, lambda state, x: (state + 1, x)),
    "take_while": lambda ds, op, spec: ds.take_while(lambda *x: True),
    "ignore_errors": lambda ds, op, spec: ds.ignore_errors(),
    "unique": _unique,
}


class Fail:
    """The function of a ``fail`` op: a temporary of ``factor`` times the input (at most
    ``cap`` bytes, unless the input alone is larger), then a
    ValueError on every ``period``-th element (by its first byte, ``index % 251``), else
    a copy of the input. The error's frame holds the input and the temporary."""

    def __init__(self, period: int, factor: int, cap: int) -> None:
        self.period, self.factor, self.cap = period, factor, cap

    def __call__(self, x: Any) -> Any:
        import numpy as np

        scratch = np.concatenate([x] * max(1, min(self.factor, self.cap // max(len(x), 1))))
        if int(scratch[0]) % self.period == 0:
            raise ValueError(f"element starting with {int(scratch[0])} is refused")
        return x.copy()


class MapFn:
    """:func:`_map_fn` as a picklable object, for maps on worker processes."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __call__(self, *components: Any) -> Any:
        import numpy as np

        return _map_fn(self.kind, np)(*components)


def build(spec: dict[str, Any], custom: dict[str, Any] | None = None) -> Any:
    """The pipeline ``spec`` describes; ``custom`` maps further op names to
    ``(dataset, op, spec) -> dataset`` (the doctor's sweep injects leaks with it)."""
    import numpy as np

    import headrace as hr

    count = spec["count"]
    payload = spec["payload"]
    element_spec = _element_spec(spec)

    def generate(start: int = 0, stop: int = count) -> Any:
        for index in range(int(start), int(stop)):
            yield _element(spec, index, np)

    if spec["source"] == "array":
        rows = np.zeros((count, max(spec["base_bytes"] // 64, 1)), np.uint8)
        ds = hr.Dataset.from_tensor_slices(rows)
    elif spec["source"] == "interleave":
        shards = 4
        per = max(count // shards, 1)

        def shard(i: Any) -> Any:
            return hr.Dataset.from_generator(
                generate, output_signature=element_spec, args=(int(i) * per, (int(i) + 1) * per)
            )

        ds = hr.Dataset.range(shards).interleave(
            shard, cycle_length=2, num_parallel_calls=spec["seed"] % 2 or None
        )
    elif spec["source"] == "xinterleave":
        cycle, block, workers = spec["interleave"]
        shards = 4
        ds = hr.Dataset.range(shards).interleave(
            Shard(spec, max(count // shards, 1)), cycle_length=cycle, block_length=block,
            num_parallel_calls=workers, workers="processes",
        )
    elif spec["source"] == "slots":
        cycle, block, mode = spec["slots"]
        parallel, deterministic, workers = SLOT_MODES[mode]
        ds = hr.Dataset.range(spec["shards"]).interleave(
            SlotShard(spec), cycle_length=cycle, block_length=block,
            num_parallel_calls=hr.AUTOTUNE if parallel == -1 else parallel and min(parallel, cycle),
            deterministic=deterministic, workers=workers,
        )
    else:
        ds = hr.Dataset.from_generator(generate, output_signature=element_spec)
    if payload not in ("array", "dict"):
        ds = ds.map(lambda array: _payload(spec, array))
    for op in spec["ops"]:
        name = op[0]
        if name == "map":
            ds = ds.map(_map_fn(op[1], np))
        elif name == "pmap":
            ds = ds.map(_map_fn(op[2], np), num_parallel_calls=op[1])
        elif name == "xmap":
            ds = ds.map(MapFn(op[2]), num_parallel_calls=op[1], workers="processes")
        elif name == "decode" and op[3] in AUGMENTATIONS:
            augment = Augment(op[3], op[4])
            if op[3] == "inception":
                ds = ds.enumerate()
            ds = ds.map(augment, num_parallel_calls=op[1], workers=op[2],
                        output_nbytes=AugmentNbytes(augment),
                        output_signature=hr.TensorSpec(
                            (None, None, 3), np.float32 if augment.float_output() else np.uint8))
        elif name == "fail":
            where, calls = op[1], op[2]
            ds = ds.map(Fail(*op[3:6]), num_parallel_calls=None if where == "map" else calls,
                        workers="processes" if where == "xmap" else None,
                        output_signature=element_spec)  # (not learned: element 0 raises)
        elif name == "decode":
            ds = ds.map(Decode(op[3] == "crop"), num_parallel_calls=op[1], workers=op[2],
                        output_nbytes=decoded_rgb_nbytes,  # (a spec learned from one image
                        output_signature=hr.TensorSpec((None, None, 3), np.uint8))  # is fixed)
        elif name == "xinterleave":
            ds = ds.interleave(Copies(op[2]), cycle_length=op[1], num_parallel_calls=op[3],
                               workers="processes")
        elif name == "filter":
            ds = ds.filter(lambda *x: True)
        elif name == "shuffle":
            ds = ds.shuffle(op[1], seed=spec["seed"])
        elif name == "prefetch":
            ds = ds.prefetch(hr.AUTOTUNE if op[1] == -1 else op[1])
        elif name == "repeat":
            ds = ds.repeat(op[1])
        elif name == "take":
            ds = ds.take(op[1])
        elif name == "skip":
            ds = ds.skip(op[1])
        elif name == "batch":
            fixed = spec["distribution"] == "uniform" or spec["source"] == "array"
            ds = ds.batch(op[1]) if fixed else ds.padded_batch(op[1])
        elif name == "padded_batch":
            ds = ds.padded_batch(op[1])
        elif name == "unbatch":
            ds = ds.unbatch()
        elif name == "rebatch":
            ds = ds.rebatch(op[1])
        elif name == "zip":
            ds = hr.Dataset.zip((ds, hr.Dataset.range(10**9)))
        elif name == "cache":
            ds = ds.cache()
        elif name in _WIDER:
            ds = _WIDER[name](ds, op, spec)
        elif custom is not None and name in custom:
            ds = custom[name](ds, op, spec)
    return ds.with_options(hr.Options(memory_budget=int(spec["budget_mib"] * MiB)))


def _fingerprint(element: Any) -> Any:
    """A small summary of an element that tells elements (and their order) apart."""
    import numpy as np

    if isinstance(element, np.ndarray):
        flat = element.reshape(-1)
        if element.dtype.hasobject:
            return ("o", element.shape, tuple(_fingerprint(item) for item in flat[:4]))
        return ("a", element.shape, int(flat[0]) if flat.size else None)
    if isinstance(element, dict):
        return tuple((key, _fingerprint(element[key])) for key in sorted(element))
    if isinstance(element, (tuple, list)):
        return tuple(_fingerprint(item) for item in element)
    if isinstance(element, (set, frozenset)):
        return tuple(sorted(repr(_fingerprint(item)) for item in element))
    if isinstance(element, (bytes, memoryview)):
        data = bytes(element)
        return ("b", len(data), data[:1])
    if isinstance(element, Holder):
        return ("h", _fingerprint(element.payload))
    return repr(element)


def _self_charged() -> int:
    fields = {"RssAnon:": 0, "RssShmem:": 0}
    with open("/proc/self/status") as status:
        for line in status:
            key = line.split(":", 1)[0] + ":"
            if key in fields:
                fields[key] = int(line.split()[1]) * 1024
    return sum(fields.values())


#: The least anonymous memory each worker process was seen to hold: its interpreter and
#: imports, which are its start, not the pipeline's growth.
_worker_floor: dict[int, int] = {}


def _charged() -> int:
    """This process's RssAnon + RssShmem plus each worker process's growth: its Pss_Anon
    above the least it was seen to hold (its shared memory is mapped here too, and
    counted here whole)."""
    import os

    from headrace._workers.memory import _descendants, worker_memory

    total = _self_charged()
    for pid in _descendants(os.getpid()):
        memory = worker_memory(pid)
        if memory is None:
            continue
        floor = min(_worker_floor.get(pid, memory.pss_anon), memory.pss_anon)
        _worker_floor[pid] = floor
        total += memory.pss_anon - floor
    return total


class PeakGrowth:
    """The peak growth of ``measure`` (:func:`_charged` by default) over a ``with`` block,
    sampled by a thread every 2 ms, or less often where a sample itself is slow (each
    worker process's smaps read costs ~1 ms: at most a third of a core on it); after a
    collection and a ``malloc_trim``, so the start is what is held. :meth:`sample`
    takes one more now (the consumer holding a large element)."""

    def __init__(self, trim: bool = True, measure: Callable[[], int] | None = None) -> None:
        self.trim = trim
        self.measure = _charged if measure is None else measure
        self.start = self.peak = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def sample(self) -> None:
        self.peak = max(self.peak, self.measure())

    def _sample(self) -> None:
        while not self._done.is_set():
            began = time.perf_counter()
            self.sample()
            time.sleep(max(0.002, 2 * (time.perf_counter() - began)))

    def __enter__(self) -> PeakGrowth:
        if self.trim:
            gc.collect()
            with contextlib.suppress(OSError):
                ctypes.CDLL("libc.so.6").malloc_trim(0)
        self.start = self.peak = self.measure()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    @property
    def growth(self) -> int:
        """Bytes the peak passed the start by."""
        return self.peak - self.start


def run(spec: dict[str, Any], *, consumer_delay: float = 0.0002) -> dict[str, Any]:
    """Run one spec with a slow consumer; what it did to the budget and to RSS."""
    import headrace as hr
    from headrace._memory import budget as budget_module
    from headrace._memory import inflight as inflight_module

    violations: list[str] = []
    overdrawn = [0]
    pipeline_budget: list[Any] = [None]  # the run's own budget, once it is made
    original = budget_module.Buffer._book

    def checked(self: Any, nbytes: int, elements: int = 1, **overdraft: int) -> None:
        breaches = self.breaches
        original(self, nbytes, elements, **overdraft)
        # Bytes past a share that the budget knows about: overdrafts, and a lender's holding
        # above the share a re-split just lowered (it admits nothing until it drains).
        # Checked on the pipeline's budget also where a nested one (an interleave slot's)
        # booked: its bytes count there too, through the interleave's account.
        budget = pipeline_budget[0] or self.budget
        if budget.used > budget.total:
            excess = sum(max(a.overdrawn, a.held - a.limit) for a in budget.accounts)
            if budget.used - budget.total > excess:
                violations.append(f"budget used {budget.used} > total {budget.total} + {excess}")
            overdrawn[0] = max(overdrawn[0], budget.used - budget.total)
        if self.breaches > breaches:  # overdrafts (outputs that outgrew their estimate)
            # are not breaches: they are reported apart (see Buffer.admit_existing)
            violations.append(
                f"{self.name}: held {self.held} > share {self.limit} after booking {nbytes}"
            )

    budget_module.Buffer._book = checked  # type: ignore[method-assign]
    # G1's bound on work in flight, per call: a call stops after the output that takes
    # it past what was booked for it, so all its outputs but the last fit the booking
    # (bytes past it, by stage; with worker processes, the sizes also carry the unused
    # part of the result segment they came in, which was booked while it sat idle).
    past_booking: dict[str, tuple[int, bool]] = {}
    settle = inflight_module.InFlight.settle

    def settled(self: Any, ticket: Any, sizes: list[int], inputs: list[int], **how: Any) -> Any:
        if sizes and len(sizes) == len(ticket.expected):  # (no error took a place)
            over = sum(sizes[:-1]) - ticket.booked
            name = self.buffer.name
            past_booking[name] = (max(past_booking.get(name, (over,))[0], over), self.packs)
        return settle(self, ticket, sizes, inputs, **how)

    inflight_module.InFlight.settle = settled  # type: ignore[method-assign]
    memory = PeakGrowth()
    outcome, elements, accounted, total = "ok", 0, 0, spec["budget_mib"] * MiB
    order = zlib.crc32(b"")  # of every element's summary, in order: G3 across runs
    started = time.perf_counter()
    iterator: Any = None
    memory.__enter__()  # (left in the finally below, with the patches)
    try:
        iterator = iter(build(spec))
        pipeline_budget[0] = iterator.context.budget
        with iterator:
            for element in iterator:
                order = zlib.crc32(repr(_fingerprint(element)).encode(), order)
                elements += 1
                if elements < 300:
                    time.sleep(consumer_delay)
                if elements % 8 == 0 or not _worker_floor:  # (with workers, the sampler
                    memory.sample()  # thread does most of it)
            accounted = iterator.context.budget.peak
    except hr.MemoryBudgetError as error:
        outcome = f"MemoryBudgetError: {error}"
    except Exception as error:  # reported, so one bad pipeline does not end the sweep
        outcome = f"error: {type(error).__name__}: {error}"
    finally:
        memory.__exit__()
        budget_module.Buffer._book = original  # type: ignore[method-assign]
        inflight_module.InFlight.settle = settle  # type: ignore[method-assign]
    # overdrafts by stage: a map told each output's size (output_nbytes) should need none
    by_stage = {} if iterator is None else {
        account.name: account.overdrawn_peak
        for account in iterator.context.budget.accounts if account.overdrawn_peak
    }
    # ... and in elements: the overdraft is one element per call that may run
    overdraft_elements = {} if iterator is None else {
        account.name: account.overdrawn_peak / max(account.max_element, 1)
        for account in iterator.context.budget.accounts if account.overdrawn_peak
    }
    return {
        "seed": spec["seed"],
        "outcome": outcome,
        "elements": elements,
        "order": order,
        "budget": total,
        "accounted_peak": accounted,
        "violations": violations[:5],
        "overdrawn_peak": overdrawn[0],
        "overdrawn_by_stage": by_stage,
        "overdraft_elements": overdraft_elements,
        "past_booking": past_booking,
        "growth": memory.growth,
        "bound": int(total * 1.1) + 64 * MiB,
        "seconds": round(time.perf_counter() - started, 3),
    }


def main() -> None:
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    specs = json.load(sys.stdin)
    for spec in specs:
        print(json.dumps(run(spec)), flush=True)


if __name__ == "__main__":
    main()

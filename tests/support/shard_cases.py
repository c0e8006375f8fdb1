"""Random pipelines for the sharding tests, and how to compare their outputs.

Module level so that DataLoader workers (forkserver) can unpickle the pipelines
(importable as ``shard_cases`` once ``tests`` is on ``sys.path``).

The pipelines pair elements by position (zip of TFRecord files with an array, a
generator, another file reader, nested zips, a sub-pipeline zipped with itself), filter, map, shuffle, repeat,
concatenate, interleave over files, take/skip/enumerate, and end with a batch
(with or without ``drop_remainder``) or not. Every element is a nest of int64
scalars, so a row is a tuple of ints: a tuple whose parts were paired from
different positions is a different row, which the multiset comparison sees.
"""

from __future__ import annotations

import collections
import os
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import headrace as hr
from headrace._structure import flatten, map_structure
from headrace.core.node import Node
from headrace.io.tfrecord import write_tfrecord

INT = hr.TensorSpec((), np.int64)


def to_int(record: bytes) -> np.int64:
    return np.int64(int(record))


def plus_one(*values: Any) -> Any:
    return map_structure(lambda leaf: leaf + 1, values[0] if len(values) == 1 else values)


def keep(*values: Any) -> bool:
    return int(sum(int(leaf) for leaf in flatten(values))) % 3 != 1


def count_up(start: int, stop: int) -> Iterable[np.int64]:
    return (np.int64(i) for i in range(start, stop))


def read_ints(path: Any) -> hr.Dataset:
    return hr.TFRecordDataset(path).map(to_int, output_signature=INT)


def write_files(directory: str, count: int, rng: random.Random, first: int = 0) -> list[str]:
    """``count`` TFRecord files of 0-9 records each, holding consecutive ints from ``first``."""
    paths, value = [], first
    for i in range(count):
        path = os.path.join(directory, f"part-{i:03d}.tfrecord")
        records = rng.randint(0, 9) if i else rng.randint(1, 9)
        write_tfrecord(path, [str(value + j).encode() for j in range(records)])
        value += records
        paths.append(path)
    return paths


@dataclass
class Env:
    """The files one test draws its pipelines over (written once per directory)."""

    files: list[str]
    pattern: str
    total: int = field(default=0)


def make_env(directory: str, seed: int) -> Env:
    rng = random.Random(seed)
    files = write_files(directory, rng.randint(4, 6), rng)
    hr.TFRecordDataset(files, indexed=True)  # writes the .hrx indexes once, here
    total = sum(1 for _ in hr.TFRecordDataset(files))
    return Env(files, os.path.join(directory, "*.tfrecord"), total)


def _source(rng: random.Random, env: Env) -> hr.Dataset:
    kind = rng.choice(["records", "records", "indexed", "interleave", "array", "generator"])
    if kind == "records":
        return hr.TFRecordDataset(env.files).map(to_int, output_signature=INT)
    if kind == "indexed":
        return hr.TFRecordDataset(env.files, indexed=True).map(to_int, output_signature=INT)
    if kind == "interleave":
        names = hr.Dataset.list_files(env.pattern, shuffle=False)
        if rng.random() < 0.5:  # (list_files' own shuffle reshuffles every epoch)
            names = names.shuffle(8, seed=rng.randint(0, 9), reshuffle_each_iteration=False)
        return names.interleave(read_ints, cycle_length=rng.randint(1, 3))
    size = rng.randint(0, env.total + 5)
    start = rng.choice([0, 100, 1000])
    if kind == "array":
        return hr.Dataset.from_tensor_slices(np.arange(start, start + size, dtype=np.int64))
    return hr.Dataset.from_generator(count_up, args=(start, start + size), output_signature=INT)


#: Unary steps, weighted: a positional one (take, skip, enumerate) turns worker sharding
#: into "output" sharding, so those come less often than the ones sharding passes.
STEPS = ["map"] * 3 + ["filter"] * 3 + ["shuffle"] * 2 + [
    "prefetch", "repeat", "take", "skip", "enumerate"
]


def _rows_dataset(rng: random.Random, env: Env, depth: int) -> hr.Dataset:
    """Unbatched elements: a nest of int64 scalars."""
    roll = rng.random()
    if depth < 2 and roll < 0.45:
        branches = [_rows_dataset(rng, env, depth + 1) for _ in range(rng.randint(2, 3))]
        ds = hr.Dataset.zip(tuple(branches))
    elif depth < 2 and roll < 0.65:  # one stream read twice, zipped with itself
        shared = _rows_dataset(rng, env, depth + 1)
        ds = hr.Dataset.zip(shared, shared.map(plus_one, output_signature=shared.element_spec))
    elif depth < 2 and roll < 0.75:
        ds = _rows_dataset(rng, env, depth + 1)
        other = (ds.map(plus_one, output_signature=ds.element_spec) if rng.random() < 0.5
                 else ds.take(rng.randint(0, 6)))
        ds = ds.concatenate(other)
    else:
        ds = _source(rng, env)
    for _ in range(rng.randint(0, 2)):
        step = rng.choice(STEPS)
        if step == "map":
            ds = ds.map(plus_one, output_signature=ds.element_spec)
        elif step == "filter":
            ds = ds.filter(keep)
        elif step == "shuffle":
            ds = ds.shuffle(rng.randint(1, 20), seed=rng.randint(0, 9),
                            reshuffle_each_iteration=False)
        elif step == "prefetch":
            ds = ds.prefetch(2)
        elif step == "take":
            ds = ds.take(rng.randint(0, 30))
        elif step == "skip":
            ds = ds.skip(rng.randint(0, 5))
        elif step == "repeat":
            ds = ds.repeat(2)
        else:
            ds = ds.enumerate()
    return ds


@dataclass
class Case:
    dataset: hr.Dataset
    batched: bool


def random_case(rng: random.Random, env: Env) -> Case:
    ds = _rows_dataset(rng, env, 0)
    if rng.random() < 0.5:
        return Case(ds, False)
    ds = ds.batch(rng.randint(1, 8), drop_remainder=rng.random() < 0.5)
    if rng.random() < 0.25:
        return Case(ds.unbatch(), False)
    return Case(ds, True)


def rows(elements: Iterable[Any], batched: bool) -> list[tuple[int, ...]]:
    """Each element's rows as tuples of ints (a batch: one tuple per row)."""
    out: list[tuple[int, ...]] = []
    for element in elements:
        leaves = [np.asarray(leaf) for leaf in flatten(element)]
        if batched:
            out.extend(tuple(int(leaf[i]) for leaf in leaves) for i in range(len(leaves[0])))
        else:
            out.append(tuple(int(leaf) for leaf in leaves))
    return out


def multiset(values: Iterable[tuple[int, ...]]) -> collections.Counter[tuple[int, ...]]:
    return collections.Counter(values)


def stages(node: Node) -> set[str]:
    """Every stage name in the pipeline below ``node`` (to check what an error names)."""
    names = {node.stage}
    for child in node.inputs:
        names |= stages(child)
    return names


def describe(node: Node) -> str:
    """The pipeline as ``stage(params)[inputs]``, for failure messages."""
    params = ", ".join(repr(p)[:40] for p in node.params())
    inner = ", ".join(describe(child) for child in node.inputs)
    return f"{node.stage}({params})" + (f"[{inner}]" if inner else "")

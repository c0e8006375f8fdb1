"""The no-compiler Example parser against the C extension and protobuf's own parser.

    python benchmarks/bench_example_fallback.py [--records 20000] [--repeats 5] [--batch N] [--tf]

``--records`` serialized tf.train.Examples, in one batch or in batches of ``--batch``
(``a``, ``b`` int64 scalars, ``x``, ``y`` float scalars, ``emb`` 32 float32, ``img``
100 bytes, ``tags`` 0-7 int64 as a VarLenFeature, ``scores`` 0-5 float32 as a
RaggedFeature), parsed by:

* ``native``: ``parse_example`` with the C extension (the anchor);
* ``pure``: ``parse_example`` without it (``set_native_enabled(False)``): what a user
  without a compiler gets;
* ``pure general``: the same with only the field-by-field decoder
  (``_example_wire.scan_columns_exact``, the pure path before the fast one);
* ``protobuf parse``: ``Example.FromString`` per record, with classes built at run
  time from example.proto's descriptor (protobuf's upb backend; no TensorFlow), values
  left in the messages;
* ``protobuf + columns``: the same, then the spec's values gathered into NumPy arrays
  (the work ``parse_example`` does);
* ``tf.io.parse_example`` (``--tf``; TensorFlow's C++ parser).

Sides run interleaved, ``--repeats`` rounds, in one process; medians are reported, as
records/s and as ratios to ``pure``. Prints a Markdown table (and ``--out`` writes it).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np


def make_records(count: int) -> list[bytes]:
    from headrace.io.example import serialize_example

    rng = np.random.default_rng(0)
    records = []
    for _ in range(count):
        records.append(
            serialize_example(
                {
                    "a": ("int64_list", [int(rng.integers(0, 1000))]),
                    "b": ("int64_list", [int(rng.integers(-(2**40), 2**40))]),
                    "x": ("float_list", [float(rng.random())]),
                    "y": ("float_list", [float(rng.random())]),
                    "emb": rng.random(32, dtype=np.float32),
                    "img": ("bytes_list", [rng.bytes(100)]),
                    "tags": rng.integers(0, 100_000, int(rng.integers(0, 8))),
                    "scores": rng.random(int(rng.integers(0, 6)), dtype=np.float32),
                }
            )
        )
    return records


def headrace_spec() -> dict[str, Any]:
    from headrace.io import example as hx

    return {
        "a": hx.FixedLenFeature([], np.int64),
        "b": hx.FixedLenFeature([], np.int64),
        "x": hx.FixedLenFeature([], np.float32),
        "y": hx.FixedLenFeature([], np.float32),
        "emb": hx.FixedLenFeature([32], np.float32),
        "img": hx.FixedLenFeature([], bytes),
        "tags": hx.VarLenFeature(np.int64),
        "scores": hx.RaggedFeature(np.float32),
    }


def example_class() -> Any:
    """tf.train.Example's message class, built from example.proto / feature.proto's
    definitions at run time (no TensorFlow import)."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    field = descriptor_pb2.FieldDescriptorProto
    proto = descriptor_pb2.FileDescriptorProto(
        name="bench_example.proto", package="bench", syntax="proto3"
    )

    def message(name: str, fields: list[tuple[str, int, int, int, str]]) -> Any:
        described = proto.message_type.add(name=name)
        for field_name, number, kind, label, type_name in fields:
            added = described.field.add(name=field_name, number=number, type=kind, label=label)
            if type_name:
                added.type_name = type_name
        return described

    repeated, optional = field.LABEL_REPEATED, field.LABEL_OPTIONAL
    message("BytesList", [("value", 1, field.TYPE_BYTES, repeated, "")])
    message("FloatList", [("value", 1, field.TYPE_FLOAT, repeated, "")])
    message("Int64List", [("value", 1, field.TYPE_INT64, repeated, "")])
    feature = message(
        "Feature",
        [
            ("bytes_list", 1, field.TYPE_MESSAGE, optional, ".bench.BytesList"),
            ("float_list", 2, field.TYPE_MESSAGE, optional, ".bench.FloatList"),
            ("int64_list", 3, field.TYPE_MESSAGE, optional, ".bench.Int64List"),
        ],
    )
    feature.oneof_decl.add(name="kind")
    for member in feature.field:
        member.oneof_index = 0
    features = message(
        "Features", [("feature", 1, field.TYPE_MESSAGE, repeated, ".bench.Features.FeatureEntry")]
    )
    entry = features.nested_type.add(name="FeatureEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, type=field.TYPE_STRING, label=optional)
    entry.field.add(
        name="value", number=2, type=field.TYPE_MESSAGE, label=optional, type_name=".bench.Feature"
    )
    message("Example", [("features", 1, field.TYPE_MESSAGE, optional, ".bench.Features")])
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("bench.Example"))


LISTS = {"a": "int64_list", "b": "int64_list", "x": "float_list", "y": "float_list",
         "emb": "float_list", "img": "bytes_list", "tags": "int64_list",
         "scores": "float_list"}  # fmt: skip


def protobuf_columns(example: Any, records: list[bytes]) -> dict[str, Any]:
    """What parse_example returns, gathered from protobuf messages (values + row
    lengths for the variable-length features)."""
    values: dict[str, list[Any]] = {name: [] for name in LISTS}
    lengths: dict[str, list[int]] = {"tags": [], "scores": []}
    for record in records:
        feature = example.FromString(record).features.feature
        for name, kind in LISTS.items():
            listed = getattr(feature[name], kind).value
            values[name].extend(listed)
            if name in lengths:
                lengths[name].append(len(listed))
    out: dict[str, Any] = {}
    for name, kind in LISTS.items():
        dtype = {"int64_list": np.int64, "float_list": np.float32, "bytes_list": object}[kind]
        out[name] = np.array(values[name], dtype=dtype)
    out["emb"] = out["emb"].reshape(-1, 32)
    for name, counts in lengths.items():
        out[name] = (out[name], np.cumsum([0, *counts]))
    return out


def sides(batches: list[list[bytes]], with_tf: bool) -> dict[str, Callable[[], Any]]:
    """Each parser over every batch of ``batches``."""
    from headrace.io import _example_wire as wire
    from headrace.io import _native
    from headrace.io.example import parse_example

    spec = headrace_spec()

    def native() -> Any:
        previous = _native.set_native_enabled(True)
        try:
            return [parse_example(records, spec) for records in batches]
        finally:
            _native.set_native_enabled(previous)

    def pure() -> Any:
        previous = _native.set_native_enabled(False)
        try:
            return [parse_example(records, spec) for records in batches]
        finally:
            _native.set_native_enabled(previous)

    def pure_general() -> Any:
        fast, wire.scan_columns = wire.scan_columns, wire.scan_columns_exact  # type: ignore[misc]
        try:
            return pure()
        finally:
            wire.scan_columns = fast  # type: ignore[misc]

    run: dict[str, Callable[[], Any]] = {"native": native, "pure": pure}
    run["pure general"] = pure_general
    try:
        from google.protobuf.internal import api_implementation
    except ImportError:
        print("google.protobuf is not installed: no protobuf sides")
    else:
        example = example_class()
        run[f"protobuf parse ({api_implementation.Type()})"] = lambda: [
            example.FromString(record) for records in batches for record in records
        ]
        run[f"protobuf + columns ({api_implementation.Type()})"] = lambda: [
            protobuf_columns(example, records) for records in batches
        ]
    if with_tf:
        import tensorflow as tf

        tf_spec = {
            "a": tf.io.FixedLenFeature([], tf.int64), "b": tf.io.FixedLenFeature([], tf.int64),
            "x": tf.io.FixedLenFeature([], tf.float32), "y": tf.io.FixedLenFeature([], tf.float32),
            "emb": tf.io.FixedLenFeature([32], tf.float32),
            "img": tf.io.FixedLenFeature([], tf.string), "tags": tf.io.VarLenFeature(tf.int64),
            "scores": tf.io.RaggedFeature(tf.float32),
        }  # fmt: skip
        tensors = [tf.constant(records) for records in batches]
        run["tf.io.parse_example"] = lambda: [
            tf.io.parse_example(batch, tf_spec) for batch in tensors
        ]
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--general-records", type=int, default=2000,
                        help="the general decoder's batch (it is slow): records/s scale")
    parser.add_argument("--batch", type=int, default=0,
                        help="records per parse call (default: all in one call)")
    parser.add_argument("--tf", action="store_true", help="also time tf.io.parse_example")
    parser.add_argument("--out", help="write the Markdown table here")
    args = parser.parse_args()
    records = make_records(args.records)
    size = args.batch or len(records)
    run = sides([records[i : i + size] for i in range(0, len(records), size)], args.tf)
    general = records[: args.general_records]
    small = sides([general[i : i + size] for i in range(0, len(general), size)], False)[
        "pure general"
    ]
    times: dict[str, list[float]] = {name: [] for name in run}
    for _ in range(args.repeats):
        for name, side in run.items():
            side = small if name == "pure general" else side
            start = time.perf_counter()
            side()
            times[name].append(time.perf_counter() - start)
    rates = {
        name: (args.general_records if name == "pure general" else args.records)
        / statistics.median(spent)
        for name, spent in times.items()
    }
    lines = [
        f"{args.records} records ({args.general_records} for pure general) in batches of "
        f"{size}, median of "
        f"{args.repeats}; {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}",
        "",
        "| parser | records/s | vs pure |",
        "|---|---:|---:|",
    ]
    for name, rate in rates.items():
        lines.append(f"| {name} | {rate:,.0f} | {rate / rates['pure']:.2f} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as out:
            out.write(table + "\n")


if __name__ == "__main__":
    main()

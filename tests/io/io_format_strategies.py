"""Hypothesis strategies shared by the Example tests: random features and specs."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import strategies as st

from headrace.io import example as hx

NAMES = ["a", "b", "c", "é"]
KINDS = ["float_list", "int64_list", "bytes_list"]
DTYPE_OF_KIND: dict[str, Any] = {
    "float_list": np.float32,
    "int64_list": np.int64,
    "bytes_list": bytes,
}

float32s = st.floats(width=32, allow_nan=False)
int64s = st.integers(-(2**63), 2**63 - 1)
small_bytes = st.binary(max_size=6)
VALUE_STRATEGY = {"float_list": float32s, "int64_list": int64s, "bytes_list": small_bytes}


@st.composite
def feature_values(draw: st.DrawFn, max_size: int = 4) -> tuple[str, list[Any]]:
    kind = draw(st.sampled_from(KINDS))
    return kind, draw(st.lists(VALUE_STRATEGY[kind], max_size=max_size))


examples = st.dictionaries(st.sampled_from(NAMES), feature_values(), max_size=len(NAMES))


def _default_for(kind: str, size: int) -> st.SearchStrategy[Any]:
    return st.lists(VALUE_STRATEGY[kind], min_size=size, max_size=size)


@st.composite
def specs(draw: st.DrawFn) -> dict[str, Any]:
    """Specs over a subset of NAMES, each as ``(spec_type, kind, shape, default)``."""
    chosen = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=3, unique=True))
    out = {}
    for name in chosen:
        kind = draw(st.sampled_from(KINDS))
        spec_type = draw(st.sampled_from(["fixed", "varlen", "sequence", "ragged"]))
        shape: tuple[int, ...] = draw(st.sampled_from([(), (1,), (2,), (1, 2)]))
        default = None
        if spec_type == "fixed" and draw(st.booleans()):
            default = draw(_default_for(kind, int(np.prod(shape))))
        elif spec_type == "sequence":
            shape = draw(st.sampled_from([(), (2,)]))
            if draw(st.booleans()):
                default = draw(VALUE_STRATEGY[kind])
        out[name] = (spec_type, kind, shape, default)
    return out


def headrace_spec(spec_type: str, kind: str, shape: tuple[int, ...], default: Any) -> Any:
    dtype = DTYPE_OF_KIND[kind]
    if spec_type == "fixed":
        return hx.FixedLenFeature(shape, dtype, default_value=default)
    if spec_type == "varlen":
        return hx.VarLenFeature(dtype)
    if spec_type == "sequence":
        return hx.FixedLenSequenceFeature(shape, dtype, allow_missing=True, default_value=default)
    return hx.RaggedFeature(dtype)


@st.composite
def conforming_example(draw: st.DrawFn, spec_args: dict[str, Any]) -> dict[str, Any]:
    """An Example that mostly fits ``spec_args`` (right kind and count), sometimes not,
    so that both successful parses and errors are exercised."""
    features = draw(examples)
    for name, (spec_type, kind, shape, _default) in spec_args.items():
        roll = draw(st.integers(0, 9))
        if roll >= 8:
            continue  # keep whatever random value (or absence) the name has
        if roll == 7:
            features.pop(name, None)
            continue
        size = int(np.prod(shape))
        if spec_type == "sequence":
            size *= draw(st.integers(0, 3))
        elif spec_type != "fixed":
            size = draw(st.integers(0, 4))
        features[name] = (kind, draw(st.lists(VALUE_STRATEGY[kind], min_size=size, max_size=size)))
    return features


@st.composite
def batches_and_specs(draw: st.DrawFn) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    spec_args = draw(specs())
    batch = draw(st.lists(conforming_example(spec_args), min_size=1, max_size=4))
    return batch, spec_args

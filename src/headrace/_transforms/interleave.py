"""``interleave`` and ``flat_map``, in tf.data's exact order.

The node is here; the run modes have their own modules over one cycle:

- :mod:`headrace._transforms._interleave_cycle`: tf.data's sequential order, the
  state, the slots (every mode shares it).
- :mod:`headrace._transforms._interleave_threads`: slots read in turn, or ahead
  on threads (``num_parallel_calls``; AUTOTUNE switches to threads once its
  pulls mostly wait). ``deterministic=False`` lets the first ready slot win.
- :mod:`headrace._transforms.process_interleave`: slots in worker processes.

Memory. The stage's share of the budget is split among the ``cycle_length``
slots (:mod:`headrace._memory.nested`). Each inner pipeline runs inside its
slot's part: its own prefetches, shuffles and read-ahead queues included. So
a cycle of 1,000 inner pipelines cannot hold more than the stage's share. Arrays
the function makes (an inner ``from_tensor_slices`` over a new array) are booked
for as long as their slot lives. Nothing of an inner pipeline outlives its slot,
so memory does not grow with the number of inner datasets or epochs. Files
opened by inner datasets go through the process-wide file pool, so the
descriptor cap holds too.

Errors. An error from an inner pipeline is raised at its element's place in
the order. As in tf.data's sequential interleave, it does not count as an
element of the block. (tf.data's *parallel* interleave counts it; headrace keeps
one order for both, so that AUTOTUNE's switch to threads changes no order
around errors either.) The next call continues with the same slot. An error
from the input or from ``map_func`` drops that input element; the next call
pulls the next one.

Origins. Once a stage above asks for them (a map), each element's origin is
its slot's. It is asked of the inner pipeline where slots are read in turn, and
of the slot's read-ahead where a thread reads it (that one takes the inner
pipeline's token right after each pull). So a failing element names its file
and record in either mode, across AUTOTUNE's switch, in any order. Slots in
worker processes name none yet.

Resuming. The state keeps, per open slot, the input's state just before that
slot's input element, plus the inner iterator's state. Restoring re-reads the
input element (a filename, typically) and resumes the inner iterator.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from headrace._errors import EmptyInputError, HeadraceWarning, InvalidArgumentError
from headrace._options import AUTOTUNE
from headrace._structure import TensorSpec, flatten, map_structure
from headrace._transforms._interleave_threads import (
    FirstReadyInterleaveIterator,
    InterleaveIterator,
)
from headrace._transforms.map import apply_fn
from headrace._warn import warn_user
from headrace.core.fingerprint import function_fingerprint, function_name
from headrace.core.indexing import RandomAccess, Reach, Refusal
from headrace.core.iterator import Context, Iterator
from headrace.core.node import (
    INFINITE,
    UNKNOWN,
    Node,
    ShardRole,
    Traits,
    check_positive,
    probe_elements,
)

__all__ = ["InterleaveNode"]


def _machine_cycle_length(num_parallel_calls: int | None) -> int:
    """tf.data's default cycle_length, which depends on the machine's CPU count."""
    cpus = os.cpu_count() or 1
    if num_parallel_calls is None:
        return cpus
    if num_parallel_calls == AUTOTUNE:
        return -(-cpus // 3)
    return min(num_parallel_calls, cpus)


class InterleaveNode(Node):
    stage = "interleave"
    budget_weight = 2

    def element_access(self, reach: Reach) -> RandomAccess | Refusal:
        return Refusal(self)  # its elements come from datasets made as it runs

    def traits(self) -> Traits:
        return Traits(parallel_calls=self.num_parallel_calls, opens_named_files=True)

    def __init__(
        self,
        source: Node,
        map_func: Callable[..., Any],
        cycle_length: int | None,
        block_length: int | None,
        num_parallel_calls: int | None,
        deterministic: bool | None,
        workers: str = "threads",
    ) -> None:
        super().__init__(source)
        if not callable(map_func):
            raise InvalidArgumentError(f"interleave: map_func must be callable, got {map_func!r}")
        if workers != "threads":  # (imported here: multiprocessing costs import time)
            from headrace._workers.processes import check_workers

            if workers == "auto":
                raise InvalidArgumentError(
                    "interleave: workers must be 'threads' or 'processes' (an interleave "
                    "cannot measure its inner pipelines before it opens them), got 'auto'"
                )
            check_workers(workers, num_parallel_calls, map_func, "interleave")
        self.workers = workers
        if num_parallel_calls is not None and num_parallel_calls != AUTOTUNE:
            check_positive("interleave: num_parallel_calls", num_parallel_calls)
        if deterministic is not None and num_parallel_calls is None:
            warn_user(
                "interleave: `deterministic` has no effect without `num_parallel_calls` "
                "(a sequential interleave always keeps its order); drop it or pass "
                "num_parallel_calls",
                HeadraceWarning,
            )
        if cycle_length == AUTOTUNE:  # asked for explicitly: the user chose the machine's
            cycle_length = _machine_cycle_length(num_parallel_calls)
        elif cycle_length is None:
            cycle_length = _machine_cycle_length(num_parallel_calls)
            warn_user(
                f"interleave: cycle_length defaults to {cycle_length} on this machine (it "
                "depends on the CPU count, as in tf.data), so the order differs between "
                "machines; pass cycle_length explicitly for a reproducible order",
                HeadraceWarning,
            )
        self.cycle_length = check_positive("interleave: cycle_length", cycle_length)
        self.block_length = check_positive(
            "interleave: block_length", 1 if block_length is None else block_length
        )
        if (
            num_parallel_calls is not None
            and num_parallel_calls != AUTOTUNE
            and num_parallel_calls > self.cycle_length
        ):
            raise InvalidArgumentError(
                f"interleave: num_parallel_calls ({num_parallel_calls}) must be <= "
                f"cycle_length ({self.cycle_length})"
            )
        self.map_func = map_func
        self.num_parallel_calls = num_parallel_calls
        self.deterministic = deterministic
        self._spec: Any = None  # learnt from the first input element, when asked for

    def shard_role(self) -> ShardRole:
        # each input element's inner dataset is read whole, wherever the element sits
        return ShardRole.BY_CONTENT

    def params(self) -> tuple[Any, ...]:
        return (
            function_fingerprint(self.map_func),
            self.cycle_length,
            self.block_length,
            self.num_parallel_calls,
            self.deterministic,
            # a slot's state differs in a worker (a chunk's start and a count): no
            # checkpoint moves between the two
            *(("processes",) if self.workers == "processes" else ()),
        )

    @property
    def element_spec(self) -> Any:
        """The spec of the dataset ``map_func`` makes of the first input element whose
        dataset's spec can be known. An inner dataset that learns its spec from its own
        first element (a ``map`` without ``output_signature``) and is empty is passed
        over for the next one: tf.data traces ``map_func`` and never sees that it is
        empty, so a first empty inner dataset must not stop the pipeline."""
        if self._spec is None:
            empty = 0
            with probe_elements(self.inputs[0], "interleave") as elements:
                for element in elements:
                    try:
                        spec = self.inner_node(element).element_spec
                    except EmptyInputError:
                        empty += 1
                        continue
                    self._spec = _open_sizes_stay_open(
                        spec, element, self.inputs[0].element_spec
                    )
                    break
            if self._spec is None:
                if not empty:
                    raise EmptyInputError(
                        "interleave: its element_spec is that of the dataset map_func makes "
                        "of an input element, but the input is empty"
                    )
                raise EmptyInputError(
                    f"interleave: its element_spec is that of the datasets map_func makes, "
                    f"but all {empty} it made of the input's elements are empty and know "
                    "their spec only from an element"
                )
        return self._spec

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_spec"] = None
        return state

    def cardinality(self) -> int:
        inner = self.inputs[0].cardinality()
        if inner == 0:
            return 0
        # tf.data's rule: a parallel interleave of an infinite input is infinite; a
        # sequential one (and any other) is unknown
        if inner == INFINITE and self.num_parallel_calls is not None:
            return INFINITE
        return UNKNOWN

    def inner_node(self, element: Any) -> Node:
        result = apply_fn(self.map_func, element)
        # A Dataset is the facade over its recipe node; the facade sits above this layer.
        node = getattr(result, "_node", None)
        if not isinstance(node, Node):
            raise InvalidArgumentError(
                f"interleave: {function_name(self.map_func)} must return a Dataset, "
                f"got {type(result).__name__}"
            )
        return node

    def make_iterator(self, ctx: Context) -> Iterator:
        """The run mode's iterator; each shares the cycle of ``_interleave_cycle``."""
        account = ctx.account(self)
        inner = self.inputs[0].make_iterator(ctx)
        if self.workers == "processes":  # (imported here: multiprocessing costs import time)
            from headrace._transforms.process_interleave import ProcessInterleaveIterator

            return ProcessInterleaveIterator(self, inner, ctx, account)
        deterministic = ctx.deterministic if self.deterministic is None else self.deterministic
        if self.num_parallel_calls is not None and not deterministic:
            return FirstReadyInterleaveIterator(self, inner, ctx, account)
        return InterleaveIterator(self, inner, ctx, account)


def _open_sizes_stay_open(spec: Any, first: Any, input_spec: Any) -> Any:
    """The inner dataset's spec of the first input element, with None where a size came
    from that element: tf.data traces ``map_func`` over the input's spec, so
    ``from_tensors`` of a (None, None, 3) image is (None, None, 3), not the first
    image's (74, 74, 3) (fixed, it made ``padded_batch`` pad later images to it). A
    size is taken to come from the element where the element has it, at that position
    in a leaf of that rank, and the input's spec leaves it open (None); declared and
    constant sizes stay.
    """
    opened: set[tuple[int, int, int]] = set()
    for leaf_spec, leaf in zip(flatten(input_spec), flatten(first), strict=False):
        shape = getattr(leaf, "shape", None)
        if not isinstance(leaf_spec, TensorSpec) or leaf_spec.shape is None or shape is None:
            continue
        if len(shape) != len(leaf_spec.shape):
            continue
        for position, (declared, size) in enumerate(zip(leaf_spec.shape, shape, strict=True)):
            if declared is None:
                opened.add((len(shape), position, int(size)))
    if not opened:
        return spec

    def reopen(leaf: TensorSpec) -> TensorSpec:
        if leaf.shape is None:
            return leaf
        rank = len(leaf.shape)
        dims = tuple(None if (rank, i, size) in opened else size
                     for i, size in enumerate(leaf.shape))
        return TensorSpec(dims, leaf.dtype, leaf.kind)

    return map_structure(reopen, spec)

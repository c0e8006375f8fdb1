"""``choose_from_datasets`` and ``sample_from_datasets``: elements picked from several inputs.

``choose_from_datasets(datasets, choice_dataset)``: each choice (an integer
scalar) says which input gives the next element, as tf.data's directed
interleave. An exhausted input ends the stream when ``stop_on_empty_dataset``
(the default there); otherwise its choices are skipped until every input is
exhausted. A choice out of range is an error naming it.

``sample_from_datasets(datasets, weights, seed)``: the same, with the choices
drawn at random in proportion to ``weights`` (uniform by default) from a
seeded, resumable stream (NumPy's Philox: tf.data's distribution, not its
sequence). Both hold nothing; the state is every input's state plus the
choices' position.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from headrace._errors import InvalidArgumentError
from headrace._memory.buffer import Reservation
from headrace._structure import flatten, integer_scalar
from headrace._transforms._random import RandomStream, SeededNode
from headrace.core.indexing import RandomAccess, Reach, Refusal
from headrace.core.iterator import Context, Iterator
from headrace.core.node import INFINITE, UNKNOWN, Node, ShardRole, Traits
from headrace.core.state import INPUTS, StateReader

__all__ = ["ChooseNode", "SampleNode"]


def _check_inputs(datasets: Sequence[Node], stage: str) -> None:
    if not datasets:
        raise InvalidArgumentError(f"{stage}: needs at least one dataset")
    from headrace.core.node import known_spec

    specs = [known_spec(node) for node in datasets]
    known = [spec for spec in specs if spec is not None]
    for spec in known[1:]:
        first = known[0]
        if len(flatten(spec)) != len(flatten(first)) or any(
            a.dtype != b.dtype or a.kind != b.kind
            for a, b in zip(flatten(spec), flatten(first), strict=True)
        ):
            raise InvalidArgumentError(
                f"{stage}: the datasets must have the same structure and dtypes, got "
                f"{first} and {spec}"
            )


class _PickNode(Node):
    """The common part: inputs 0..n-1 are the datasets; picks come from ``_next_choice``."""

    stage = "choose_from_datasets"
    shared_capabilities = ("shard_role", "element_access", "traits")

    def shard_role(self) -> ShardRole:
        return ShardRole.POSITIONAL  # picks by a sequence of choices, position by position

    def element_access(self, reach: Reach) -> RandomAccess | Refusal:
        return Refusal(self)  # element i depends on the choices before it

    def traits(self) -> Traits:
        return Traits()

    def __init__(self, datasets: Sequence[Node], extra: Sequence[Node], stop_on_empty: bool):
        super().__init__(*datasets, *extra)
        self.count = len(datasets)
        self.stop_on_empty = bool(stop_on_empty)

    @property
    def element_spec(self) -> Any:
        specs = [node.element_spec for node in self.inputs[: self.count]]
        leaves = [flatten(spec) for spec in specs]
        from headrace._structure import pack_as

        merged = [
            _common([row[k] for row in leaves]) for k in range(len(leaves[0]))
        ]
        return pack_as(specs[0], merged)

    def cardinality(self) -> int:
        return UNKNOWN


def _common(specs: list[Any]) -> Any:
    out = specs[0]
    for spec in specs[1:]:
        out = out.most_specific_common(spec)
    return out


class ChooseNode(_PickNode):
    stage = "choose_from_datasets"

    def __init__(self, datasets: Sequence[Node], choices: Node, stop_on_empty: bool) -> None:
        _check_inputs(datasets, self.stage)
        super().__init__(datasets, [choices], stop_on_empty)

    def params(self) -> tuple[Any, ...]:
        return (self.count, self.stop_on_empty)

    def cardinality(self) -> int:
        choices = self.inputs[-1].cardinality()
        return 0 if choices == 0 else UNKNOWN

    def make_iterator(self, ctx: Context) -> Iterator:
        inputs = [node.make_iterator(ctx) for node in self.inputs]
        return _PickIterator(self, inputs[: self.count], _Choices(inputs[-1], self.count))


class SampleNode(_PickNode, SeededNode):
    stage = "sample_from_datasets"

    def traits(self) -> Traits:
        return Traits(unseeded=self.seed is None)

    def __init__(
        self,
        datasets: Sequence[Node],
        weights: Sequence[float] | None,
        seed: int | None,
        stop_on_empty: bool,
        rerandomize_each_iteration: bool | None,
    ) -> None:
        _check_inputs(datasets, self.stage)
        super().__init__(datasets, [], stop_on_empty)
        if weights is None:
            weights = [1.0] * len(datasets)
        values = np.asarray(weights, dtype=np.float64).reshape(-1)
        if len(values) != len(datasets) or not np.all(np.isfinite(values)) or np.any(values < 0):
            raise InvalidArgumentError(
                f"sample_from_datasets: weights must be {len(datasets)} finite numbers >= 0, "
                f"got {weights!r}"
            )
        if values.sum() <= 0:
            raise InvalidArgumentError("sample_from_datasets: the weights sum to zero")
        self.weights = [float(w) for w in values]
        self.init_seed(seed, rerandomize_each_iteration, self.stage)

    def params(self) -> tuple[Any, ...]:
        return (self.count, self.stop_on_empty, tuple(self.weights), self.seed, self.rerandomize)

    def cardinality(self) -> int:
        sizes = [node.cardinality() for node in self.inputs]
        if self.stop_on_empty:
            return UNKNOWN if any(size != INFINITE for size in sizes) else INFINITE
        if any(size == INFINITE for size in sizes) and all(
            size == INFINITE for size, w in zip(sizes, self.weights, strict=True) if w > 0
        ):
            return INFINITE
        return UNKNOWN

    def make_iterator(self, ctx: Context) -> Iterator:
        inputs = [node.make_iterator(ctx) for node in self.inputs]
        return _PickIterator(self, inputs, _Draws(self, ctx))


class _Choices:
    """Choices read from a dataset of integer scalars."""

    def __init__(self, inner: Iterator, count: int) -> None:
        self.inner, self.count = inner, count
        self.position = 0

    def next(self) -> int:
        element, reservation = self.inner.pull()
        reservation.release()
        self.position += 1
        element = integer_scalar(element, f"choose_from_datasets: choice {self.position - 1}")
        if not 0 <= element < self.count:
            raise InvalidArgumentError(
                f"choose_from_datasets: choice {self.position - 1} = {int(element)} is out of "
                f"range: there are {self.count} datasets"
            )
        return int(element)

    def as_state(self) -> dict[str, Any]:
        return self.inner.get_state()

    def restore(self, state: dict[str, Any]) -> None:
        self.inner.set_state(state)

    def close(self) -> None:
        self.inner.close()


class _Draws:
    """Choices drawn in proportion to the weights, from a resumable random stream."""

    def __init__(self, node: SampleNode, ctx: Context) -> None:
        self.stream = RandomStream(node, ctx, node.stage)
        cumulative = np.cumsum(node.weights)
        self.bounds = (cumulative / cumulative[-1]).tolist()

    def next(self) -> int:
        u = self.stream.uniform()
        for index, bound in enumerate(self.bounds):
            if u < bound:
                return index
        return len(self.bounds) - 1

    def as_state(self) -> dict[str, Any]:
        return self.stream.as_dict()

    def restore(self, state: dict[str, Any]) -> None:
        self.stream.restore(StateReader(state, "sample_from_datasets"))

    def close(self) -> None:
        pass


class _PickIterator(Iterator):
    def __init__(self, node: _PickNode, inputs: list[Iterator], choices: _Choices | _Draws):
        super().__init__(*inputs)
        self.stage = node.stage
        self.node, self.datasets, self.choices = node, inputs, choices
        # An input of weight 0 is never drawn: it counts as exhausted from the start, so
        # the stream ends with the others (tf.data leaves such inputs out; waiting for
        # them drew forever).
        weights = getattr(node, "weights", None) or [1.0] * len(inputs)
        self.exhausted = [weight == 0 for weight in weights]
        self.done = False

    def pull(self) -> tuple[Any, Reservation]:
        while not self.done:
            if all(self.exhausted):
                self.done = True
                break
            try:
                index = self.choices.next()
            except StopIteration:
                self.done = True
                break
            if self.exhausted[index]:
                continue
            try:
                return self.datasets[index].pull()
            except StopIteration:
                self.exhausted[index] = True
                if self.node.stop_on_empty:
                    self.done = True
        raise StopIteration

    def get_state(self) -> dict[str, Any]:
        return {
            INPUTS: [iterator.get_state() for iterator in self.datasets],
            "choices": self.choices.as_state(),
            "exhausted": list(self.exhausted),
            "done": self.done,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        reader = StateReader(state, self.stage)
        for iterator, child in zip(
            self.datasets, reader.entries(INPUTS, len(self.datasets)), strict=True
        ):
            iterator.set_state(child)
        self.choices.restore(reader.child("choices"))
        exhausted = reader.entries("exhausted", len(self.datasets))
        if not all(isinstance(flag, bool) for flag in exhausted):
            raise reader.error("exhausted", f"must be a list of booleans, got {exhausted!r:.60}")
        self.exhausted, self.done = list(exhausted), reader.flag("done")

    def close(self) -> None:
        for iterator in self.datasets:
            iterator.close()
        self.choices.close()

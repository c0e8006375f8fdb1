"""``zip`` and ``concatenate``, with tf.data's orders.

``zip`` ends with its shortest input; its element has the nesting of the
datasets it was given. ``concatenate`` needs inputs of the same structure and
dtypes (sizes may differ: they become unknown in the spec).
"""

from __future__ import annotations

from typing import Any

from headrace._errors import ElementSpecError, EmptyInputError
from headrace._memory.buffer import NO_RESERVATION, Reservation
from headrace._structure import flatten, map_structure, pack_as
from headrace.core.handoff import holds_a_place
from headrace.core.indexing import RandomAccess, Reach, Refusal, reached
from headrace.core.iterator import Context, Iterator
from headrace.core.node import INFINITE, UNKNOWN, Node, ShardRole, Traits, known_spec
from headrace.core.state import StateReader

__all__ = ["ConcatenateNode", "ZipNode"]


class ZipNode(Node):
    stage = "zip"

    def element_access(self, reach: Reach) -> RandomAccess | Refusal:
        parts = reached(reach, self.inputs)
        return parts if isinstance(parts, Refusal) else _ZipAccess(self.structure, parts)

    def traits(self) -> Traits:
        return Traits()

    def with_inputs(self, inputs: tuple[Node, ...]) -> ZipNode:
        clone = super().with_inputs(inputs)
        clone.structure = pack_as(clone.structure, list(inputs))  # the user's nesting too
        return clone

    def __init__(self, structure: Any, nodes: list[Node]) -> None:
        super().__init__(*nodes)
        self.structure = structure  # the user's nesting, with nodes as leaves

    def shard_role(self) -> ShardRole:
        return ShardRole.PAIRS

    def params(self) -> tuple[Any, ...]:
        return (repr(map_structure(lambda _: 0, self.structure)),)

    @property
    def element_spec(self) -> Any:
        return pack_as(self.structure, [node.element_spec for node in self.inputs])

    def cardinality(self) -> int:
        sizes = [node.cardinality() for node in self.inputs]
        if UNKNOWN in sizes:  # tf.data's rule: the unknown one may be the shortest
            return UNKNOWN
        finite = [size for size in sizes if size >= 0]
        return min(finite) if finite else INFINITE

    def random_access(self) -> RandomAccess | None:
        parts = [node.random_access() for node in self.inputs]
        if any(part is None for part in parts):
            return None
        return _ZipAccess(self.structure, [part for part in parts if part is not None])

    def make_iterator(self, ctx: Context) -> Iterator:
        if self.index_plan() is not None:
            return super().make_iterator(ctx)
        return _ZipIterator(self.structure, [node.make_iterator(ctx) for node in self.inputs])


class _ZipAccess(RandomAccess):
    def __init__(self, structure: Any, parts: list[RandomAccess]) -> None:
        self.structure, self.parts = structure, parts
        self.length = min(len(part) for part in parts)

    def __len__(self) -> int:
        return self.length

    def get(self, index: int) -> Any:
        return pack_as(self.structure, [part.get(index) for part in self.parts])

    def get_many(self, indices: range | Any) -> Any:
        return pack_as(self.structure, [part.get_many(indices) for part in self.parts])

    def gathers_batches(self) -> bool:
        return all(part.gathers_batches() for part in self.parts)

    def prepare(self, ctx: Context) -> None:
        for part in self.parts:
            part.prepare(ctx)


class _ZipIterator(Iterator):
    stage = "zip"

    def __init__(self, structure: Any, inners: list[Iterator]) -> None:
        super().__init__(*inners)
        self.structure = structure

    def pull(self) -> tuple[Any, Reservation]:
        """One element of every input; an input's error is raised in the pair's place
        after the others moved past it too, as tf.data does (else they fell one behind
        for each error, and every later pair was mismatched). The first input that
        ends ends the zip, before the inputs after it are asked (one raising at every
        pull, such as a refusal over an endless input, kept it from ending)."""
        elements: list[Any] = []
        failure: Exception | None = None
        for inner in self.inputs:
            try:
                elements.append(next(inner))
            except StopIteration:
                raise
            except Exception as error:
                if not holds_a_place(error):
                    raise
                failure = failure or error
        if failure is not None:
            raise failure
        return pack_as(self.structure, elements), NO_RESERVATION


def _check_compatible(first: Any, second: Any) -> Any:
    left, right = flatten(first), flatten(second)
    if len(left) != len(right) or repr(map_structure(lambda _: 0, first)) != repr(
        map_structure(lambda _: 0, second)
    ):
        raise ElementSpecError(
            f"concatenate: the datasets have different structures: {first} vs {second}"
        )
    merged = []
    for a, b in zip(left, right, strict=True):
        if a.dtype != b.dtype or a.kind != b.kind:
            raise ElementSpecError(
                f"concatenate: component dtypes differ: {a} vs {b}; cast one of them first"
            )
        merged.append(a.most_specific_common(b))
    return pack_as(first, merged)


class ConcatenateNode(Node):
    stage = "concatenate"

    def element_access(self, reach: Reach) -> RandomAccess | Refusal:
        if self.spec is None:  # (read by index: make_iterator is not run)
            self._check_learnt_specs()
        parts = reached(reach, self.inputs)
        return parts if isinstance(parts, Refusal) else _ConcatAccess(*parts)

    def traits(self) -> Traits:
        return Traits()

    def __init__(self, first: Node, second: Node) -> None:
        super().__init__(first, second)
        # Checked now when both specs are known without reading data (building a
        # pipeline never runs user code); otherwise when the spec is first asked for.
        self.spec: Any = None
        specs = known_spec(first), known_spec(second)
        if specs[0] is not None and specs[1] is not None:
            self.spec = _check_compatible(*specs)

    def shard_role(self) -> ShardRole:
        return ShardRole.BY_CONTENT

    @property
    def element_spec(self) -> Any:
        if self.spec is None:
            self.spec = _check_compatible(*(node.element_spec for node in self.inputs))
        return self.spec

    def cardinality(self) -> int:
        a, b = (node.cardinality() for node in self.inputs)
        if INFINITE in (a, b):
            return INFINITE
        if UNKNOWN in (a, b):
            return UNKNOWN
        return a + b

    def random_access(self) -> RandomAccess | None:
        if self.spec is None:  # (read by index: make_iterator is not run)
            self._check_learnt_specs()
        first, second = (node.random_access() for node in self.inputs)
        if first is None or second is None:
            return None
        return _ConcatAccess(first, second)

    def make_iterator(self, ctx: Context) -> Iterator:
        if self.spec is None:
            self._check_learnt_specs()
        if self.index_plan() is not None:
            return super().make_iterator(ctx)
        return _ConcatenateIterator([node.make_iterator(ctx) for node in self.inputs])

    def _check_learnt_specs(self) -> None:
        """Before the first run, check specs that had to be learnt from elements (a map
        without ``output_signature``): tf.data refuses such a pipeline when it is built,
        and a run that did not look yielded one structure, then another. A spec that
        cannot be learnt (an empty input, a first element that fails) is left to the run."""
        try:
            specs = [node.element_spec for node in self.inputs]
        except ElementSpecError as error:
            if isinstance(error, EmptyInputError):
                return
            raise
        except Exception:  # (the element's own error: raised in its place by the run)
            return
        self.spec = _check_compatible(*specs)


class _ConcatAccess(RandomAccess):
    def __init__(self, first: RandomAccess, second: RandomAccess) -> None:
        self.first, self.second = first, second
        self.split = len(first)

    def __len__(self) -> int:
        return self.split + len(self.second)

    def get(self, index: int) -> Any:
        if index < self.split:
            return self.first.get(index)
        return self.second.get(index - self.split)

    def prepare(self, ctx: Context) -> None:
        self.first.prepare(ctx)
        self.second.prepare(ctx)


class _ConcatenateIterator(Iterator):
    stage = "concatenate"

    def __init__(self, inners: list[Iterator]) -> None:
        super().__init__(*inners)
        self.current = 0

    def pull(self) -> tuple[Any, Reservation]:
        while self.current < len(self.inputs):
            try:
                return self.inputs[self.current].pull()
            except StopIteration:
                self.current += 1
        raise StopIteration

    def get_state(self) -> dict[str, Any]:
        return {**super().get_state(), "current": self.current}

    def set_state(self, state: dict[str, Any]) -> None:
        self.current = StateReader(state, "concatenate").integer("current", high=len(self.inputs))
        super().set_state(state)

"""``Dataset.from_generator``: elements from a Python generator, checked against a signature.

The generator function is called again for every epoch (every new iterator),
as in tf.data. Each element is checked against ``output_signature`` and
converted to its dtypes; a mismatch is an error naming the component, what was
expected and what came.

Errors. An exception raised by the generator reaches the consumer with its
type and traceback and a note naming the element, in that element's place. A
Python generator cannot resume after raising, so the dataset ends there (as in
tf.data), and a state saved after it restores that end; any other iterator is
asked for its next element, as tf.data does. An element that does not match
the signature raises :class:`ElementSpecError` and the next element follows.

Resuming. A generator cannot seek: the state counts the elements produced,
and restoring calls the function again and skips that many — exact when the
generator yields the same sequence every time.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterator as PyIterator
from types import GeneratorType
from typing import Any

import numpy as np

from headrace._errors import ElementSpecError, InvalidArgumentError, note_element_error
from headrace._memory.buffer import NO_RESERVATION, Reservation
from headrace._structure import (
    TensorSpec,
    encode_str,
    flatten,
    pack_as,
    shape_allows,
    structure_paths,
)
from headrace.core.fingerprint import function_fingerprint, function_name
from headrace.core.iterator import Context, Iterator
from headrace.core.node import UNKNOWN, SourceNode, check_signature
from headrace.core.state import PRODUCED, StateReader, replay

__all__ = ["GeneratorNode"]


def _convert(value: Any, spec: TensorSpec, path: str, index: int) -> Any:
    where = f"from_generator: element {index}, component {path}"
    if spec.kind in ("bytes", "str"):
        wanted = bytes if spec.kind == "bytes" else str
        if spec.kind == "bytes":  # tf.data encodes str components as UTF-8 bytes
            value = encode_str(value)
        if spec.shape is not None and not spec.shape:
            if not isinstance(value, wanted):
                raise ElementSpecError(
                    f"{where}: expected {spec.kind}, got {type(value).__name__} {value!r:.60}"
                )
            return value
        array = np.asarray(value, dtype=object)
        if any(not isinstance(item, wanted) for item in array.flat):
            raise ElementSpecError(f"{where}: expected an array of {spec.kind}, got {value!r:.60}")
    else:
        if isinstance(value, (bytes, str)):
            raise ElementSpecError(
                f"{where}: expected {spec.dtype}, got {type(value).__name__} {value!r:.60}"
            )
        array = np.asarray(value)
        if array.dtype != spec.dtype:
            if not np.can_cast(array.dtype, spec.dtype, casting="same_kind") or (
                array.dtype.kind == "f" and spec.dtype.kind in "iu"
            ):
                raise ElementSpecError(
                    f"{where}: expected dtype {spec.dtype}, got {array.dtype} (value {value!r:.60})"
                )
            array = array.astype(spec.dtype)
    if not shape_allows(spec.shape, tuple(array.shape)):
        raise ElementSpecError(f"{where}: expected shape {spec.shape}, got {array.shape}")
    return array if array.ndim else array[()]


def _flatten_up_to(signature: Any, value: Any) -> list[Any] | None:
    """The parts of ``value`` that the signature's components stand for, in
    :func:`flatten` order, or None where their structures differ. A component is
    taken whole, whatever it holds (tf.data's ``flatten_up_to``): a generator may
    yield ``([1.0, 2.0], (1, 2))`` for two vector specs, each converted to one array.
    Above the components, a tuple must be a tuple (tf.data refuses a list there)
    and a dict a dict with the same keys."""
    if isinstance(signature, dict):
        if not isinstance(value, dict) or set(value) != set(signature):
            return None
        out: list[Any] = []
        for key in sorted(signature):
            part = _flatten_up_to(signature[key], value[key])
            if part is None:
                return None
            out.extend(part)
        return out
    if isinstance(signature, tuple):
        if not isinstance(value, tuple) or len(value) != len(signature):
            return None
        out = []
        for spec, item in zip(signature, value, strict=True):
            part = _flatten_up_to(spec, item)
            if part is None:
                return None
            out.extend(part)
        return out
    return [value]


class GeneratorNode(SourceNode):
    stage = "from_generator"

    def __init__(
        self,
        generator: Callable[..., Any],
        output_signature: Any,
        args: tuple[Any, ...] | None,
    ) -> None:
        super().__init__()
        if not callable(generator):
            raise InvalidArgumentError(
                f"from_generator: generator must be a callable returning an iterator, "
                f"got {generator!r}"
            )
        if output_signature is None:
            raise InvalidArgumentError(
                "from_generator: output_signature is required (a TensorSpec or a "
                "nested structure of them)"
            )
        check_signature(output_signature, "from_generator")
        self.generator, self.signature, self.args = generator, output_signature, tuple(args or ())

    def params(self) -> tuple[Any, ...]:
        return (
            function_fingerprint(self.generator),
            repr(self.signature),
            function_fingerprint(self.args),
        )

    @property
    def element_spec(self) -> Any:
        return self.signature

    def cardinality(self) -> int:
        return UNKNOWN

    def make_iterator(self, ctx: Context) -> Iterator:
        return _GeneratorIterator(self)


class _GeneratorIterator(Iterator):
    stage = "from_generator"

    def __init__(self, node: GeneratorNode) -> None:
        super().__init__()
        self.node = node
        self.specs = flatten(node.signature)
        self.paths = structure_paths(node.signature)
        self.single = not isinstance(node.signature, (dict, tuple))
        self.source: PyIterator[Any] | None = None
        self.produced = 0
        self.failed = False  # the Python generator raised: it cannot go on
        self.stage_name = f"from_generator({function_name(node.generator)})"

    def _start(self) -> PyIterator[Any]:
        result = self.node.generator(*self.node.args)
        try:
            return iter(result)
        except TypeError:
            raise ElementSpecError(
                f"from_generator: {function_name(self.node.generator)} returned "
                f"{type(result).__name__}, not an iterable"
            ) from None

    def pull(self) -> tuple[Any, Reservation]:
        return self._next_value(), NO_RESERVATION

    def _next_value(self) -> Any:
        if self.failed:
            raise StopIteration
        if self.source is None:
            self.source = self._start()
        try:
            value = next(self.source)
        except StopIteration:
            raise
        except Exception as error:
            index = self.produced
            self.produced += 1  # the error holds this position (a replay skips it)
            if isinstance(self.source, GeneratorType):  # finished by raising
                self.failed = True
                self.close()
            raise note_element_error(error, self.stage_name, index)  # noqa: B904
        index = self.produced
        self.produced += 1
        if self.single:
            return _convert(value, self.specs[0], "element", index)
        leaves = _flatten_up_to(self.node.signature, value)
        if leaves is None:
            raise ElementSpecError(
                f"from_generator: element {index} has the wrong structure: expected "
                f"{self.node.signature}, got {value!r:.100}"
            )
        return pack_as(
            self.node.signature,
            [
                _convert(leaf, spec, path, index)
                for leaf, spec, path in zip(leaves, self.specs, self.paths, strict=True)
            ],
        )

    def get_state(self) -> dict[str, Any]:
        if self.failed:
            return {PRODUCED: self.produced, "failed": True}
        return {PRODUCED: self.produced}

    def set_state(self, state: dict[str, Any]) -> None:
        target = StateReader(state, "from_generator").integer(PRODUCED)
        self.close()
        self.failed = bool(state.get("failed", False))
        if self.failed:  # ended by its error: nothing to replay
            self.produced = target
            return
        source = self.source = self._start()
        self.produced = 0

        def pull() -> None:
            try:
                next(source)
            except StopIteration:
                raise
            except Exception:  # delivered at this position before: it counts, once
                return

        # a generator ending before ``target`` means the state is not of this data
        replay(pull, target, "from_generator", PRODUCED)
        self.produced = target

    def close(self) -> None:
        if self.source is not None:
            close = getattr(self.source, "close", None)
            if close is not None:
                close()
            self.source = None

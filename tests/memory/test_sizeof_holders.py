"""The cost model sees through the standard objects that keep arrays alive: functions
(closure cells, defaults, attributes), bound methods, generators and coroutines (their
suspended frames), built-in iterators (what ``__reduce__`` names) — nested in each other
and in plain containers, drawn at random. The oracle is the bytes the element holds:
the distinct arrays put into it. Booked at ~0 bytes before, a shuffle of such 1 MiB
elements under a 16 MiB budget held all 300 of them."""

from __future__ import annotations

import collections
import functools
import itertools
import operator
import random
import sys
import types
import warnings
from typing import Any

import numpy as np
import pytest

from headrace._memory.sizeof import sizeof

#: What headers, cells and frames may add on top of the arrays' bytes.
_SLACK = 64 << 10


def _closure(value: Any) -> Any:
    return lambda: value


def _defaults(value: Any) -> Any:
    def function(x: Any = value) -> Any:
        return x
    return function


def _kwdefaults(value: Any) -> Any:
    def function(*, x: Any = value) -> Any:
        return x
    return function


def _attribute(value: Any) -> Any:
    def function() -> None:
        return None
    function.payload = value  # type: ignore[attr-defined]
    return function


class _Holder:
    def __init__(self, value: Any) -> None:
        self.value = value

    def method(self) -> Any:
        return self.value


def _generator(value: Any) -> Any:
    def produce(item: Any) -> Any:
        local = [item]
        for part in local:  # noqa: UP028 - the loop keeps its iterator on the stack
            yield part
    generator = produce(value)
    return generator


def _started_generator(value: Any) -> Any:
    def produce(item: Any) -> Any:
        kept = item
        yield 0
        yield kept
    generator = produce(value)
    next(generator)
    return generator


def _genexpr(value: Any) -> Any:
    return (x for x in [value])


def _coroutine(value: Any) -> Any:
    async def wait(item: Any) -> Any:
        return item
    coroutine = wait(value)
    _coroutines.append(coroutine)
    return coroutine


_coroutines: list[Any] = []


def _code_constant(value: Any) -> Any:
    """A function whose code object holds ``value`` as a constant (as exec'd source
    holding a big literal does)."""
    def function() -> int:
        return 1
    code = function.__code__
    return types.FunctionType(code.replace(co_consts=(*code.co_consts, value)), {})


def _made_class(value: Any) -> Any:
    return type("Made", (), {"payload": value})

#: Wrappers that keep all of their argument alive.
WRAPPERS: dict[str, Any] = {
    "list": lambda v: [v],
    "tuple": lambda v: (v, 1),
    "dict": lambda v: {"k": v},
    "deque": lambda v: collections.deque([v]),
    "closure": _closure,
    "defaults": _defaults,
    "kwdefaults": _kwdefaults,
    "function_attribute": _attribute,
    "bound_method": lambda v: _Holder(v).method,
    "partial": lambda v: functools.partial(print, v),
    "generator": _generator,
    "started_generator": _started_generator,
    "genexpr": _genexpr,
    "coroutine": _coroutine,
    "list_iterator": lambda v: iter([v, 0]),
    "consumed_list_iterator": lambda v: _advanced(iter([0, v])),
    "tuple_iterator": lambda v: iter((v,)),
    "reversed": lambda v: reversed([v]),
    "dict_key_iterator": lambda v: iter({v.tobytes() if isinstance(v, np.ndarray) else id(v): 0}),
    "dict_value_iterator": lambda v: iter({"k": v}.values()),
    "dict_item_iterator": lambda v: iter({"k": v}.items()),
    "zip": lambda v: zip([v], [1], strict=True),
    "map": lambda v: map(str, [v]),
    "enumerate": lambda v: enumerate([v]),
    "dict_values": lambda v: {"k": v}.values(),
    "repeat": lambda v: itertools.repeat(v),
    "cycle": lambda v: itertools.cycle([v]),
    "chain": lambda v: itertools.chain([v]),
    "islice": lambda v: itertools.islice([v], 1),
    "accumulate": lambda v: itertools.accumulate([v]),
    "slice": lambda v: slice(v),
    "itemgetter": lambda v: operator.itemgetter(v),
    # bound to v itself (``v.__sizeof__`` of a class would be its type's, unbound)
    "builtin_method": lambda v: object.__sizeof__.__get__(v),  # __self__ is v
    "method_wrapper": lambda v: object.__eq__.__get__(v),
    "property": lambda v: property(_closure(v)),
    "staticmethod": lambda v: staticmethod(_closure(v)),
    "classmethod": lambda v: classmethod(_closure(v)),
    "class": _made_class,
    "code_constant": _code_constant,
}

#: Wrappers of an ndarray only.
ARRAY_WRAPPERS = {"dict_key_iterator", "flat", "ndenumerate"}
WRAPPERS["flat"] = lambda v: v.flat
WRAPPERS["ndenumerate"] = lambda v: np.ndenumerate(v)

try:
    import jax.numpy as _jnp  # another framework's arrays: costed by their nbytes
except ImportError:  # pragma: no cover - jax is an optional test dependency
    _jnp = None


def _advanced(iterator: Any) -> Any:
    next(iterator)
    return iterator


def _case(rng: random.Random) -> tuple[list[str], Any, int]:
    """A random nest of wrappers around 1-3 arrays; the bytes its arrays hold."""
    arrays: list[Any] = [np.full(rng.randrange(1, 5) << 18, rng.randrange(100), np.uint8)
                         for _ in range(rng.randrange(1, 4))]
    held = sum(array.nbytes for array in arrays)
    kinds = []
    if _jnp is not None and rng.random() < 0.25:
        arrays = [_jnp.array(array) for array in arrays]  # (a copy: the numpy one is freed)
        kinds.append("jax")
    value: Any = arrays[0] if len(arrays) == 1 else list(arrays)
    for _ in range(rng.randrange(1, 4)):
        kind = rng.choice(sorted(WRAPPERS))
        if isinstance(value, np.ndarray) and rng.random() < 0.3:
            kind = rng.choice(sorted(ARRAY_WRAPPERS))  # (drawn often enough to matter)
        if kind in ARRAY_WRAPPERS and not isinstance(value, np.ndarray):
            continue
        if kind == "dict_key_iterator":
            # the key is a bytes copy of the array: it holds that, not the array
            held = held - value.nbytes + len(value.tobytes())
        kinds.append(kind)
        value = WRAPPERS[kind](value)
    return kinds, value, held


@pytest.mark.parametrize("seed", range(40))
def test_standard_holders_cost_the_arrays_they_keep_alive(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(10):
        kinds, value, held = _case(rng)
        cost = sizeof(value)
        assert held <= cost <= held + _SLACK, (kinds, cost, held)
    for coroutine in _coroutines:
        coroutine.close()
    _coroutines.clear()


def test_a_cycle_through_a_closure_and_a_generator_is_costed_once() -> None:
    array = np.zeros(1 << 20, np.uint8)

    def recursive() -> Any:
        return recursive, array

    def produce() -> Any:
        yield me  # the generator refers to itself through its frame's cell
    me = produce()
    assert array.nbytes <= sizeof(recursive) <= array.nbytes + _SLACK
    assert sizeof(me) < _SLACK
    assert array.nbytes <= sizeof([recursive, recursive, me]) <= array.nbytes + _SLACK


def test_a_function_does_not_cost_its_globals_or_code() -> None:
    """Module-level functions hold their module's globals, shared by everything (a
    built-in function's ``__self__`` is its module: not costed either)."""
    assert sizeof(np.asarray) < 4096
    assert sizeof(_case) < 4096
    assert sizeof(len) < 4096 and sizeof(sys.getsizeof) < 4096


def test_a_class_costs_its_own_attributes_not_its_bases_or_builtins() -> None:
    array = np.zeros(1 << 20, np.uint8)
    base = type("Base", (), {"payload": array})
    derived = type("Derived", (base,), {"small": 1})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # descriptors and code objects are known kinds
        assert array.nbytes <= sizeof(base) <= array.nbytes + _SLACK
        assert sizeof(derived) < _SLACK
        assert sizeof(int) < _SLACK and sizeof(np.ndarray) < _SLACK and sizeof(_Holder) < _SLACK


def test_finished_generators_and_exhausted_iterators_hold_nothing() -> None:
    array = np.zeros(1 << 20, np.uint8)
    generator = (x for x in [array])
    iterator = iter([array])
    list(generator), list(iterator)
    assert sizeof(generator) < 4096
    assert sizeof(iterator) < 4096


def test_arrays_and_dicts_of_arrays_keep_the_fast_path() -> None:
    """The new kinds are costed past arrays, dicts and scalars: a dict of arrays (a
    parsed batch) is still costed by the fast path, not the general walk."""
    from headrace._memory.sizeof import _plain_cost

    element = {f"c{i}": np.zeros(16) for i in range(8)}
    assert _plain_cost(element, frozenset()) == sizeof(element)
    assert _plain_cost(np.zeros(16), frozenset()) is not None


@pytest.mark.parametrize("seed", range(3))
def test_an_element_nested_past_the_recursion_limit_is_its_own_clear_error(seed: int) -> None:
    """Elements nested thousands of lists deep, through a shuffle, a thread map and a
    process map: each is an ElementSpecError in its place that says it is nested too
    deep (a bare RecursionError before, and two dead workers on processes), and the
    other elements come out as the plain map gives them (the oracle)."""
    from process_fns import nested_every

    import headrace as hr
    from headrace._errors import ElementSpecError

    rng = random.Random(seed)
    every, count = rng.randint(2, 5), rng.randint(8, 16)
    depth = sys.getrecursionlimit() * rng.randint(2, 5)
    fn = functools.partial(nested_every, every, depth)
    oracle = [i for i in range(count) if i % every]
    pipelines = {
        # (from a generator: over a range the shuffle draws by index and holds nothing)
        "shuffle": hr.Dataset.from_generator(
            lambda: iter(range(count)), output_signature=hr.TensorSpec((), np.int64)
        ).map(fn).shuffle(4, seed=seed),
        "threads": hr.Dataset.range(count).map(fn, num_parallel_calls=2),
        "processes": hr.Dataset.range(count).map(fn, num_parallel_calls=2, workers="processes"),
    }
    for name, ds in pipelines.items():
        seen, errors = [], 0
        with iter(ds) as it:
            while True:
                try:
                    element = next(it)
                except StopIteration:
                    break
                except ElementSpecError as error:
                    assert "nested more than" in str(error), (name, str(error))
                    errors += 1
                    continue
                seen.append(int(element[0]))
        assert sorted(seen) == oracle and errors == count - len(oracle), (name, seed)
        if name != "shuffle":
            assert seen == oracle, name  # in order

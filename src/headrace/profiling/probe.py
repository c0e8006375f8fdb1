"""Per-stage counters for a profiled run, installed from outside the transforms.

Instrumentation stays outside the transforms (docs/design.md): for the length of a
profile, every node of the recipe gets an instance-level ``make_iterator``
that builds the stage's iterator as usual and then replaces that iterator's
``pull`` with a counting, timing one. Stats are kept per *recipe node*, so a
stage re-created every epoch (under ``repeat``, or a new iterator per epoch as
Keras makes) adds to one record, and the counts are exact: every pull of every
iterator a node made while profiled is counted, from its first.

Only iterators of the profiled runs are instrumented (their ``Context.run`` is
checked): a probe that reads one element to learn a spec, or another iterator
over the same recipe running meanwhile, is not counted. Stages a node fused
into one iterator (a map read by index inside a batch's gather) are reported
as part of the stage that runs them.

Inside interleave (and flat_map): the datasets its function makes are new
recipes each time; while profiled, each is instrumented as it is made, and
every stage at one place of the inner recipe (position and name) counts into
one record, ``"<stage> [inner]"``, a child of the interleave's; its bytes are
the sum over the slots' own accounts (each inner dataset books under its
slot's budget). They are detached with the rest.

Cost: one extra Python call and two clock reads per pull per stage (about
0.3 µs), and a payload size of 1 element in 64 — nothing at all outside a
profile. ``benchmarks/bench_overhead.py --stats`` measures it.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from headrace.core.iterator import PROFILE_RECORD

if TYPE_CHECKING:
    from headrace.core.iterator import Context, Iterator, RunFacts
    from headrace.core.node import Node

__all__ = ["Instrumenter", "StageRecord", "payload_bytes", "recipe_nodes"]

_RECORD = PROFILE_RECORD  # attribute of an instrumented iterator: its stage's record


def payload_bytes(element: Any) -> int:
    """The bytes an element carries (arrays' ``nbytes``, strings' lengths), recursively.

    Unlike the budget's ``sizeof`` this counts views at their full size: it is
    what a stage hands on, for the inflation factor (bytes out / bytes in).
    """
    if isinstance(element, np.ndarray):
        if element.dtype == object:
            return sum(payload_bytes(item) for item in element.ravel().tolist())
        return int(element.nbytes)
    if isinstance(element, (bytes, bytearray, str, memoryview)):
        return len(element)
    if isinstance(element, (int, float, bool, np.generic)):
        return 8
    if isinstance(element, dict):
        return sum(payload_bytes(value) for value in element.values())
    if isinstance(element, (list, tuple)):
        return sum(payload_bytes(value) for value in element)
    nbytes = getattr(element, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    return sys.getsizeof(element)


def recipe_nodes(root: Node) -> list[Node]:
    """Every node of a recipe, root first, each once."""
    seen: set[int] = set()
    out: list[Node] = []
    pending = [root]
    while pending:
        node = pending.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        out.append(node)
        pending.extend(reversed(node.inputs))
    return out


class StageRecord:
    """Counters of one recipe stage over every iterator it made while profiled.

    ``seconds`` is the time its consumer spent inside its pulls; the stage's
    inputs' records (``children``) say how much of that was spent pulling
    them. ``threads`` holds the threads its pulls were seen on (sampled): a
    stage whose input is pulled on other threads (prefetch, a parallel map)
    works asynchronously.
    """

    __slots__ = (
        "accounts",
        "children",
        "count",
        "errors",
        "index",
        "inner_of",
        "iterators",
        "name",
        "node",
        "sampled",
        "sampled_bytes",
        "seconds",
        "threads",
    )

    def __init__(self, node: Node, index: int) -> None:
        self.node = node
        self.index = index
        self.name: str = str(getattr(node, "stage", type(node).__name__))
        self.children: list[StageRecord] = []
        self.count = 0
        self.errors = 0
        self.seconds = 0.0
        self.sampled = 0
        self.sampled_bytes = 0
        self.threads: set[int] = set()
        self.iterators = 0
        #: For a stage of the pipelines an interleave makes per element: that interleave's
        #: record. Every inner dataset's stage at the same place adds to one record.
        self.inner_of: StageRecord | None = None
        #: The accounts of its inner iterators still holding bytes (each inner dataset
        #: books under its slot's budget), and what closed ones held at most.
        self.accounts: list[Any] = []

    @property
    def inner_held(self) -> tuple[int, int, int]:
        """(held now, shares now, largest peak) over its inner iterators' accounts (with
        none open, the largest share one had)."""
        stats = [(a, a.stats()) for a in self.accounts]
        live = [(a, now) for a, now in stats if now.held > 0 or now.peak == 0]
        held = sum(now.held for _, now in live)
        share = sum(now.limit for _, now in live) or max((now.limit for _, now in stats), default=0)
        peak = max((now.peak for _, now in stats), default=0)
        if len(self.accounts) > 64:  # keep the largest closed one for its peak
            kept = {id(a) for a, _ in live}
            closed = [(a, now) for a, now in stats if id(a) not in kept]
            keep = max(closed, key=lambda pair: pair[1].peak)[0] if closed else None
            live_accounts = [a for a, _ in live]
            self.accounts = live_accounts + ([keep] if keep is not None else [])
        return held, share, peak

    @property
    def mean_bytes(self) -> float:
        """Mean payload of the elements sampled (1 in 64 after the first 8)."""
        return self.sampled_bytes / self.sampled if self.sampled else 0.0

    @property
    def input_seconds(self) -> float:
        return sum(child.seconds for child in self.children)

    @property
    def elements_in(self) -> int:
        return sum(child.count for child in self.children)

    @property
    def asynchronous(self) -> bool:
        """Whether its inputs are pulled on threads other than the ones pulling it."""
        mine = self.threads
        return any(child.threads and not child.threads <= mine for child in self.children)


def _instrument(iterator: Iterator, record: StageRecord) -> None:
    """Replace ``iterator.pull`` by a counting, timing one (an instance attribute)."""
    pull: Callable[[], tuple[Any, Any]] = iterator.pull
    clock = time.perf_counter
    get_ident = threading.get_ident

    def counted_pull() -> tuple[Any, Any]:
        started = clock()
        try:
            pair = pull()
        except StopIteration:
            record.seconds += clock() - started
            raise
        except Exception:
            record.seconds += clock() - started
            record.errors += 1
            raise
        record.seconds += clock() - started
        count = record.count = record.count + 1
        if count <= 8 or not count & 63:  # a sample: the payload and the thread
            record.sampled += 1
            record.sampled_bytes += payload_bytes(pair[0])
            record.threads.add(get_ident())
        return pair

    iterator.__dict__["pull"] = counted_pull
    iterator.__dict__[_RECORD] = record
    record.iterators += 1


def record_of(iterator: Iterator) -> StageRecord | None:
    """The record an instrumented iterator counts into."""
    found = iterator.__dict__.get(_RECORD)
    return found if isinstance(found, StageRecord) else None


def _child_records(iterator: Iterator, own: StageRecord) -> list[StageRecord]:
    """The records of the nearest instrumented iterators below ``iterator``."""
    out: list[StageRecord] = []
    pending = list(iterator.inputs)
    while pending:
        child = pending.pop()
        record = record_of(child)
        if record is not None and record is not own:
            if record not in out:
                out.append(record)
            continue
        pending.extend(child.inputs)
    return out


class Instrumenter:
    """Counts every pull of every stage of the runs of one recipe (see the module doc).

    Use :meth:`attach` before building iterators, :meth:`expect_run` right
    before each ``iter(dataset)`` that should be counted, and :meth:`detach`
    at the end (it leaves the recipe as it was: picklable, uninstrumented).
    """

    def __init__(self, root: Node) -> None:
        self.root = root
        self.nodes = recipe_nodes(root)
        self.records: list[StageRecord] = []
        self._by_node: dict[int, StageRecord] = {}
        self._runs: list[RunFacts] = []
        self._expect_root = False
        self._lock = threading.Lock()
        #: Inner recipes' nodes instrumented while running (detached at the end), and the
        #: record of each place in an interleave's inner recipe.
        self._inner_nodes: list[Node] = []
        self._inner_records: dict[tuple[int, int, str], StageRecord] = {}

    def attach(self) -> None:
        for node in self.nodes:
            if "make_iterator" in node.__dict__:
                raise RuntimeError(
                    f"stage {node.stage!r} is already being profiled: one profile of a "
                    "recipe at a time"
                )
        for node in self.nodes:
            node.__dict__["make_iterator"] = self._wrap(node)
            if callable(getattr(type(node), "inner_node", None)):
                node.__dict__["inner_node"] = self._wrap_inner(node)

    def detach(self) -> None:
        for node in self.nodes:
            node.__dict__.pop("make_iterator", None)
            node.__dict__.pop("inner_node", None)
        with self._lock:
            inner, self._inner_nodes = self._inner_nodes, []
        for node in inner:
            node.__dict__.pop("make_iterator", None)

    def _wrap_inner(self, owner: Node) -> Callable[[Any], Node]:
        """``owner.inner_node`` that also instruments the inner recipe it returns: each
        stage of it counts into the record of its place (position and name) under ``owner``."""
        original: Callable[[Any], Node] = type(owner).inner_node.__get__(owner)  # type: ignore[attr-defined]

        def inner_node(element: Any) -> Node:
            root = original(element)
            mine = {id(node) for node in self.nodes}
            for position, node in enumerate(recipe_nodes(root)):
                if id(node) in mine or "make_iterator" in node.__dict__:
                    continue  # the outer recipe's own, or an inner node already counted
                record = self._inner_record(owner, position, node)
                node.__dict__["make_iterator"] = self._wrap(node, record)
                with self._lock:
                    self._inner_nodes.append(node)
            return root

        return inner_node

    def _inner_record(self, owner: Node, position: int, node: Node) -> StageRecord:
        name = str(getattr(node, "stage", type(node).__name__))
        key = (id(owner), position, name)
        with self._lock:
            record = self._inner_records.get(key)
            if record is not None:
                return record
            record = StageRecord(node, len(self.records))
            record.name = f"{name} [inner]"
            record.inner_of = self._by_node.get(id(owner))
            self.records.append(record)
            self._inner_records[key] = record
        if position == 0:  # the inner root: what the interleave pulls from
            parent = self.record(owner)
            if record not in parent.children:
                parent.children.append(record)
        return record

    def expect_run(self) -> None:
        """The next iterator built over the root is one of the profiled runs."""
        self._expect_root = True

    def record(self, node: Node) -> StageRecord:
        with self._lock:
            record = self._by_node.get(id(node))
            if record is None:
                record = StageRecord(node, len(self.records))
                self.records.append(record)
                self._by_node[id(node)] = record
            return record

    def _profiled(self, ctx: Context) -> bool:
        run = ctx.run
        return any(run is mine for mine in self._runs)

    def _wrap(self, node: Node, inner: StageRecord | None = None) -> Callable[[Context], Iterator]:
        original: Callable[[Context], Iterator] = type(node).make_iterator.__get__(node)

        def make_iterator(ctx: Context) -> Iterator:
            if node is self.root and self._expect_root:
                self._expect_root = False
                self._runs.append(ctx.run)
            iterator = original(ctx)
            if self._profiled(ctx) and record_of(iterator) is None:
                record = self.record(node) if inner is None else inner
                if inner is not None:
                    account = getattr(ctx, "_accounts", {}).get(id(node))
                    if account is not None and account not in inner.accounts:
                        inner.accounts.append(account)
                for child in _child_records(iterator, record):
                    if child not in record.children:
                        record.children.append(child)
                _instrument(iterator, record)
            return iterator

        return make_iterator

    def fused_into(self, record: StageRecord) -> list[str]:
        """Names of recipe nodes run inside ``record``'s iterators (no record of their own)."""
        recorded = {id(r.node) for r in self.records}
        out: list[str] = []
        pending = list(record.node.inputs)
        while pending:
            node = pending.pop()
            if id(node) in recorded:
                continue
            out.append(str(getattr(node, "stage", type(node).__name__)))
            pending.extend(node.inputs)
        return out

    def depth_order(self) -> list[tuple[int, StageRecord]]:
        """Records from the root down (consumer first), with their depth in the tree."""
        out: list[tuple[int, StageRecord]] = []
        seen: set[int] = set()
        roots = [r for r in self.records if r.node is self.root] or self.records[:1]

        def visit(record: StageRecord, depth: int) -> None:
            if record.index in seen:
                return
            seen.add(record.index)
            out.append((depth, record))
            for child in record.children:
                visit(child, depth + 1)

        for root in roots:
            visit(root, 0)
        for record in self.records:  # anything not reached (should not happen)
            if record.index not in seen:
                visit(record, 0)
        return out

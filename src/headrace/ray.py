"""A streaming data service on Ray: N actors run the pipeline, trainers on any node read.

Why: one machine's CPUs may not keep up with the trainers, and ``serve``/``connect``
stay on one host. :class:`DataService` cuts the pipeline into *splits* — its files
(a ``TFRecordDataset``/``TextLineDataset`` or ``list_files(...).interleave(...)``
pipeline, one split per file, cut as :func:`~headrace.auto_shard` cuts by FILE) or
ranges of its output positions (a pipeline of known length, e.g. over arrays) — and
runs each split on one of ``num_workers`` Ray actors spread over the cluster's nodes.
Each actor holds its own memory budget and asks Ray for that much memory plus its
interpreter's baseline (:func:`headrace.adapters.ray.task_memory`), so Ray's scheduler
sees the real footprint.

Consumers. ``service.consumer(index, count)`` is an iterable for trainer ``index`` of
``count``, usable from any node (it holds only actor handles). A *coordinator* actor
hands splits out: ``sharding="dynamic"`` gives the next split to whichever consumer
asks first and runs it on the least busy worker, so fast consumers and fast workers do
more; ``sharding="static"`` gives consumer ``i`` the splits ``i, i + count, ...`` in
that order, each on worker ``split % num_workers``, so what a consumer receives, and in
which order, never depends on timing.

Exactly once per epoch. A split is streamed to one consumer at a time, in chunks of
``chunk_size`` elements numbered in order; a chunk counts as delivered once its consumer
has received it, and each chunk carries the pipeline's iterator state after it. When a
worker actor dies mid-split (killed, or its node lost), the consumer asks the
coordinator for another worker and re-opens the split from the state after its last
received chunk, numbering on from there, and drops any chunk it already has: nothing is
lost and nothing is delivered twice. (tf.data service's dynamic sharding promises at
most once under failures.) A re-run split must give the same elements: random stages
in a split cut by position need a seed; splits cut by file resume from their own state.

Consumers that leave. A consumer holds a *lease* on each split it reads. ``close()``
(or leaving ``with consumer:``, or the consumer being collected mid-epoch) hands its
splits back with the exact point it yielded up to: with dynamic sharding the next
consumer to ask resumes each there; with static sharding a split belongs to its
consumer index and waits for a replacement consumer of that index. A consumer reports
each chunk it begins yielding to the coordinator (from a thread of its own, at once or
with the others begun within 0.05 s in one call; the chunk is then delivered to it), and
the thread renews its leases during long trainer steps; one silent for the service's ``lease_timeout_s`` (its process died or hangs)
loses its splits, resumed after its last reported chunk, so only the rest of a chunk it
had begun (under ``chunk_size`` elements per split) reaches no other consumer (one that
dies within moments (~0.05 s) of beginning a chunk, before its report left, has the
chunks not yet reported given again). A consumer with no split left waits for
a silent holder's (one not heard from for half the timeout) rather than end its epoch;
one whose leases expired and which comes back gets :class:`ServiceError`, never
elements another consumer now has. The coordinator itself is not replicated: if it
dies the service is gone.

Backpressure. Each split's elements wait in its worker's queue, booked by size
(:func:`~headrace._memory.sizeof.sizeof`) on a quarter of the actor's budget (the
pipeline gets the rest), and a consumer keeps at most ``prefetch`` chunk requests in
flight per split: objects in Ray's object store are bounded by both.

Checkpoints. ``consumer.get_state()`` (or ``state_dict()``) records the consumer's
epoch, the splits it finished and, for each split it is reading, the iterator state
after its last fully yielded chunk and how far into the next it got. A job restarted
from its consumers' states (a new service over the same pipeline, every consumer's
``set_state`` called before any of them reads) delivers exactly what they had not yet
yielded.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import ray

from headrace._dataset import Dataset
from headrace._distribute import ShardInfo, refuse_unseeded, shard_files
from headrace._errors import CheckpointError, InvalidArgumentError, WorkerError
from headrace._memory.sizeof import sizeof
from headrace._memory.units import parse_bytes
from headrace._options import Options
from headrace.adapters.ray import WORKER_BASELINE, task_memory
from headrace.core.node import Node

__all__ = ["DataService", "ServiceConsumer", "ServiceError", "from_ray", "to_ray"]

_STATE_FORMAT = "headrace.ray.consumer/1"
#: How long a worker's ``take`` waits for a chunk before answering "nothing yet".
_TAKE_WAIT_S = 1.0
#: How often, at most, a consumer's thread reports the chunks it began.
_REPORT_EVERY_S = 0.05


class ServiceError(WorkerError):
    """The data service cannot go on: no worker is left, or it was shut down."""


# -- splits ---------------------------------------------------------------------------


def _file_count(node: Node) -> int:
    """How many files the pipeline's first file list holds (0: it reads none)."""
    pending = [node]
    while pending:
        current = pending.pop()
        files = current.read_files()
        if files is not None:
            return len(files)
        if not current.inputs and current.names_files():
            return int(current.cardinality())
        pending.extend(reversed(current.inputs))
    return 0


@dataclass(frozen=True)
class _Plan:
    """How the pipeline is cut: ``kind`` "files" (split i reads file i), "ranges"
    (split i is output positions ``bounds[i]:bounds[i+1]``) or "fn" (``fn(i, n)``)."""

    kind: str
    count: int
    dataset: Dataset | None = None
    bounds: tuple[int, ...] = ()
    fn: Callable[[int, int], Dataset] | None = None

    def split(self, index: int, budget: int) -> Dataset:
        if self.kind == "fn":
            assert self.fn is not None
            made = self.fn(index, self.count)
            if not isinstance(made, Dataset):
                raise InvalidArgumentError(
                    f"DataService: dataset_fn({index}, {self.count}) returned "
                    f"{type(made).__name__}, not a headrace Dataset")
            dataset = made
        elif self.kind == "files":
            assert self.dataset is not None
            node = shard_files(self.dataset._node, ShardInfo(self.count, index, "service"))
            dataset = Dataset(node, self.dataset.options)
        else:
            assert self.dataset is not None
            start, stop = self.bounds[index], self.bounds[index + 1]
            dataset = self.dataset.skip(start).take(stop - start)
        return dataset.with_options(Options(memory_budget=budget))


def _plan(source: Dataset | Callable[[int, int], Dataset], num_splits: int | None,
          num_workers: int) -> _Plan:
    if not isinstance(source, Dataset):
        if not callable(source):
            raise InvalidArgumentError(
                f"DataService: expected a Dataset or a dataset_fn(split, num_splits), got "
                f"{type(source).__name__}")
        if num_splits is None:
            raise InvalidArgumentError(
                "DataService: a dataset_fn needs num_splits= (how many splits it makes)")
        return _Plan("fn", num_splits, fn=source)
    files = _file_count(source._node)
    if files >= 1:  # one split per file (one file: one split)
        with contextlib.suppress(InvalidArgumentError):  # not cut by file: by position
            shard_files(source._node, ShardInfo(files, 0, "service"))
            return _Plan("files", files, dataset=source)
    length = int(source.cardinality())
    if length < 0:
        raise InvalidArgumentError(
            "DataService: the pipeline reads no list of files that can be split by file, "
            "and its length is unknown or infinite, so it cannot be cut into splits; read "
            "files (TFRecordDataset, list_files(...).interleave(...)), or pass a "
            "dataset_fn(split, num_splits) and num_splits=")
    refuse_unseeded(source._node)
    count = max(1, min(length, num_splits or 4 * num_workers))
    bounds = tuple(length * i // count for i in range(count + 1))
    return _Plan("ranges", count, dataset=source, bounds=bounds)


# -- the worker actor -----------------------------------------------------------------


class _Lease:
    """One split being produced into a bounded queue by a thread of its own."""

    def __init__(self, plan: _Plan, split: int, state: dict[str, Any] | None, skip: int,
                 first_seq: int, chunk_size: int, budget: int, queue_bytes: int) -> None:
        self.queue: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self.cond = threading.Condition()
        self.held, self.queue_bytes = 0, queue_bytes
        self.stopped = False
        self.ended: tuple[Any, ...] | None = None
        self.thread = threading.Thread(
            target=self._run, args=(plan, split, state, skip, first_seq, chunk_size, budget),
            daemon=True, name=f"headrace-split-{split}")
        self.thread.start()

    def _put(self, item: tuple[Any, ...], nbytes: int) -> bool:
        with self.cond:
            # at least one chunk is always admitted, so a chunk larger than the share flows
            while self.held and self.held + nbytes > self.queue_bytes and not self.stopped:
                self.cond.wait(0.5)
            if self.stopped:
                return False
            self.held += nbytes
        self.queue.put((*item, nbytes))
        return True

    def _run(self, plan: _Plan, split: int, state: dict[str, Any] | None, skip: int,
             seq: int, chunk_size: int, budget: int) -> None:
        try:
            iterator = iter(plan.split(split, budget))
            try:
                if state is not None:
                    iterator.set_state(state)
                for _ in range(skip):
                    next(iterator)
                while not self.stopped:
                    chunk = []
                    for element in iterator:
                        chunk.append(element)
                        if len(chunk) == chunk_size:
                            break
                    if not chunk:
                        break
                    after = iterator.get_state()
                    if not self._put(("chunk", seq, chunk, after), sizeof(chunk)):
                        return
                    seq += 1
            finally:
                iterator.close()
            self.queue.put(("end", seq, 0))
        except BaseException as error:  # the consumer raises it
            self.queue.put(("error", error, 0))

    def take(self) -> tuple[Any, ...]:
        if self.ended is not None:
            return self.ended
        try:
            item = self.queue.get(timeout=_TAKE_WAIT_S)
        except queue.Empty:
            return ("wait",)
        *message, nbytes = item
        with self.cond:
            self.held -= nbytes
            self.cond.notify_all()
        if message[0] == "end":
            self.ended = tuple(message)
        elif message[0] == "error":
            raise message[1]
        return tuple(message)

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()


class _Worker:
    """A Ray actor producing the splits leased to it (see the module doc)."""

    def __init__(self, plan: _Plan, budget: int, chunk_size: int) -> None:
        self.plan, self.chunk_size = plan, chunk_size
        self.budget = budget - budget // 4
        self.queue_bytes = budget // 4
        self.leases: dict[str, _Lease] = {}
        self.lock = threading.Lock()

    def open(self, key: str, split: int, state: dict[str, Any] | None, skip: int,
             first_seq: int) -> None:
        lease = _Lease(self.plan, split, state, skip, first_seq, self.chunk_size,
                       self.budget, self.queue_bytes)
        with self.lock:
            old = self.leases.pop(key, None)
            self.leases[key] = lease
        if old is not None:
            old.stop()

    def take(self, key: str) -> tuple[Any, ...]:
        with self.lock:
            lease = self.leases.get(key)
        if lease is None:  # this actor was restarted: the lease died with it
            return ("lost",)
        return lease.take()

    def close(self, key: str) -> None:
        with self.lock:
            lease = self.leases.pop(key, None)
        if lease is not None:
            lease.stop()

    def drop(self, token: str) -> None:
        """Stop every split produced for consumer ``token`` (its leases expired)."""
        with self.lock:
            keys = [key for key in self.leases if key.startswith(f"{token}/")]
            gone = [self.leases.pop(key) for key in keys]
        for lease in gone:
            lease.stop()

    def ping(self) -> int:
        import os

        return os.getpid()


# -- the coordinator actor ------------------------------------------------------------


class _Coordinator:
    """Hands splits to consumers and workers; one call at a time (no locks needed).

    Leases: each split being read is held by one consumer *token* (one per consumer
    object), with the point to resume it from (its chunk number and the iterator state
    before it, plus how many elements of that chunk to skip). A consumer reports each
    chunk before it yields from it, and a thread of its own renews its leases while it
    reads; a token silent for ``lease_timeout`` loses its splits to the others (dynamic)
    or to a replacement consumer of its index (static), and any later call of its
    raises :class:`ServiceError`."""

    def __init__(self, num_splits: int, num_workers: int, sharding: str,
                 lease_timeout: float = 60.0, workers: list[Any] | None = None) -> None:
        self.num_splits, self.num_workers, self.sharding = num_splits, num_workers, sharding
        self.lease_timeout, self.workers = lease_timeout, workers or []
        self.count: int | None = None
        self.epochs: dict[int, dict[str, Any]] = {}
        self.load = [0] * num_workers
        self.failures = [0] * num_workers
        self.seen: dict[str, float] = {}  # token -> when it last spoke
        self.expired: dict[str, str] = {}  # token -> why its calls are refused
        self.reassigned = 0

    def _epoch(self, epoch: int) -> dict[str, Any]:
        if epoch not in self.epochs:
            # holder: split -> token; resume: split -> (state, seq, offset) for a held or
            # returned split; pool: returned splits any consumer may take (dynamic)
            self.epochs[epoch] = {"leased": {}, "done": set(), "reserved": {},
                                  "started": False, "holder": {}, "resume": {}, "pool": []}
        return self.epochs[epoch]

    def _check_count(self, count: int) -> None:
        if self.count is None:
            self.count = count
        elif count != self.count:
            raise InvalidArgumentError(
                f"DataService: consumers were made with count={self.count}; this one "
                f"says count={count}")

    def _pick_worker(self, split: int, avoid: int | None) -> int:
        if self.sharding == "static" and avoid is None:
            return split % self.num_workers
        order = sorted(range(self.num_workers),
                       key=lambda w: (w == avoid, self.load[w], self.failures[w], w))
        return order[0]

    # -- leases -----------------------------------------------------------------------

    def _hello(self, token: str) -> None:
        """``token`` spoke now; refuse it if its leases expired."""
        self._expire()
        if token in self.expired:
            raise ServiceError(self.expired[token])
        self.seen[token] = time.monotonic()

    def _give_back(self, state: dict[str, Any], split: int, consumer: int,
                   resume: tuple[Any, ...] | None) -> None:
        """``split`` leaves its holder: to the pool (dynamic) or kept for a replacement
        consumer of index ``consumer`` (static: the split belongs to that index)."""
        worker = state["leased"].pop(split, None)
        if worker is not None:
            self.load[worker] = max(0, self.load[worker] - 1)
        state["holder"].pop(split, None)
        if resume is not None:
            state["resume"][split] = tuple(resume)
        if self.sharding == "static":
            mine = state["reserved"].setdefault(consumer, [])
            mine.append(split)
            mine.sort()
        else:
            state["pool"].append(split)

    def _expire(self) -> None:
        now = time.monotonic()
        for token, seen in list(self.seen.items()):
            if now - seen <= self.lease_timeout:
                continue
            del self.seen[token]
            moved = []
            for epoch, state in self.epochs.items():
                for split, (holder, consumer) in list(state["holder"].items()):
                    if holder == token:
                        self._give_back(state, split, consumer, None)
                        moved.append((epoch, split))
            if moved:
                self.reassigned += len(moved)
                self.expired[token] = (
                    f"DataService: this consumer's leases expired (no word from it for "
                    f"over lease_timeout_s={self.lease_timeout:g} s) and its splits "
                    f"{sorted(s for _, s in moved)} were re-assigned to other consumers "
                    "from the last chunk it reported; reading on would repeat elements. "
                    "Restart its trainer from a checkpointed state (set_state), or read "
                    "with a new consumer (service.consumer(...)), which gets what is left")
                for worker in self.workers:  # stop producing for it
                    with contextlib.suppress(Exception):
                        worker.drop.remote(token)

    def _suspect(self, state: dict[str, Any]) -> float | None:
        """Seconds to wait when a split still held may come back: its holder has been
        silent for over half the lease timeout (a live consumer renews 4 times in it)."""
        now = time.monotonic()
        waits = [self.lease_timeout - (now - self.seen[token])
                 for token, _ in state["holder"].values()
                 if token in self.seen and now - self.seen[token] > self.lease_timeout / 2]
        return max(0.05, min(waits)) if waits else None

    def renew(self, token: str) -> None:
        self._hello(token)

    def progress(self, token: str, reports: list[list[Any]]) -> None:
        """``token`` began yielding chunk ``seq - 1`` of ``split`` in ``epoch``, for each
        ``[epoch, split, seq, state_after]``: it is delivered to it, and the split
        resumes at chunk ``seq`` from ``state_after``."""
        self._hello(token)
        for epoch, split, seq, state_after in reports:
            state = self._epoch(epoch)
            if state["holder"].get(split, (None,))[0] == token:
                state["resume"][split] = (state_after, seq, 0)

    def release(self, token: str, epoch: int, returned: list[list[Any]]) -> None:
        """A consumer leaves: each ``[split, state, seq, offset]`` it holds goes back,
        resuming exactly after what it yielded."""
        self._hello(token)
        state = self._epoch(epoch)
        for split, st, seq, offset in returned:
            held = state["holder"].get(split)
            if held is not None and held[0] == token:
                self._give_back(state, split, held[1], (st, seq, offset))
        self.seen.pop(token, None)

    def lease(self, token: str, consumer: int, count: int,
              epoch: int) -> tuple[Any, ...] | None:
        """The next split for ``consumer``: ``(split, worker, resume)`` (``resume``:
        ``(state, seq, offset)`` for a split someone left, else None), ``("wait",
        seconds)`` when none is free but a silent consumer's may come back, or None:
        nothing left for it."""
        self._check_count(count)
        self._hello(token)
        state = self._epoch(epoch)
        state["started"] = True
        reserved = state["reserved"].get(consumer, [])
        split: int | None = None
        if reserved:
            split = reserved.pop(0)
        elif state["pool"]:
            split = state["pool"].pop(0)
        else:
            taken = state["leased"].keys() | state["done"]
            for held in state["reserved"].values():
                taken |= set(held)
            mine = (range(consumer, self.num_splits, count) if self.sharding == "static"
                    else range(self.num_splits))
            split = next((s for s in mine if s not in taken), None)
        if split is None:
            wait = self._suspect(state) if self.sharding == "dynamic" else None
            return None if wait is None else ("wait", wait)
        worker = self._pick_worker(split, None)
        state["leased"][split] = worker
        state["holder"][split] = (token, consumer)
        self.load[worker] += 1
        return split, worker, state["resume"].pop(split, None)

    def replace(self, token: str, epoch: int, split: int, failed: int) -> int:
        """Another worker for ``split``, whose worker ``failed``."""
        self._hello(token)
        self.failures[failed] += 1
        state = self._epoch(epoch)
        old = state["leased"].get(split, failed)
        self.load[old] = max(0, self.load[old] - 1)
        worker = self._pick_worker(split, failed)
        state["leased"][split] = worker
        self.load[worker] += 1
        return worker

    def finish(self, token: str, epoch: int, split: int) -> None:
        self._hello(token)
        state = self._epoch(epoch)
        worker = state["leased"].pop(split, None)
        if worker is not None:
            self.load[worker] = max(0, self.load[worker] - 1)
        state["holder"].pop(split, None)
        state["resume"].pop(split, None)
        state["done"].add(split)

    def restore(self, consumer: int, count: int, epoch: int, done: list[int],
                active: list[list[Any]]) -> None:
        """Consumer ``consumer``'s checkpoint: ``done`` splits, and ``active`` ones as
        ``[split, state, seq, offset]`` (reserved for it, resumed from there)."""
        self._check_count(count)
        state = self._epoch(epoch)
        if state["started"]:  # a split handed out might be one this state says is done
            raise CheckpointError(
                f"DataService: consumer {consumer}'s state arrived after consumers began "
                f"reading epoch {epoch}; set every consumer's state before any of them reads")
        state["done"].update(done)
        state["reserved"][consumer] = [split for split, *_ in active]
        for split, st, seq, offset in active:
            state["resume"][split] = (st, seq, offset)

    def first_open_epoch(self, consumer: int, count: int) -> int:
        """The epoch a new consumer of index ``consumer`` starts in (static sharding):
        the first epoch begun whose splits of that index are not all done (those a
        consumer left wait there for it), else the one after the last begun."""
        mine = set(range(consumer, self.num_splits, count))
        for epoch in sorted(self.epochs):
            state = self.epochs[epoch]
            if state["started"] and not mine <= state["done"]:
                return epoch
        return max(self.epochs, default=-1) + 1

    def stats(self) -> dict[str, Any]:
        return {"failures": list(self.failures), "load": list(self.load),
                "done": {e: sorted(s["done"]) for e, s in self.epochs.items()},
                "reassigned": self.reassigned}


# -- the service and its consumers ----------------------------------------------------


class DataService:
    """Run ``dataset`` (or ``dataset_fn(split, num_splits)``) on ``num_workers`` Ray
    actors and serve its elements to consumers on any node, exactly once per epoch
    (see the module doc).

    ``memory_budget``: each actor's budget (its pipeline and its queued chunks); each
    asks Ray for it plus ``worker_baseline``. ``num_splits``: how many position ranges
    to cut a pipeline of known length into (default 4 per worker; a file pipeline is
    cut into its files; a ``dataset_fn`` needs it). ``chunk_size``: elements per
    transfer; ``prefetch``: chunk requests in flight per split a consumer reads.
    ``max_restarts``: how often Ray restarts a dead worker actor (its splits move to
    other workers at once either way). ``start_timeout``: seconds to wait for the
    actors to be placed before :class:`ServiceError` (a cluster without room for them).

    Consumers that leave. ``consumer.close()`` (or leaving its ``with`` block, or the
    consumer being garbage collected while it holds splits) gives back each split it
    is reading together with the point it yielded up to; with dynamic sharding the next
    consumer to ask takes it and resumes exactly there. With static sharding a split
    belongs to its consumer index, so it is kept for a replacement consumer of that
    index (``service.consumer(i, count)`` again), which resumes it in the same order.
    ``lease_timeout_s``: a consumer renews its splits as it reads (it reports each chunk
    as it begins yielding it, and a thread renews them while a slow trainer step runs);
    one silent for this long (its process died, or hangs) loses them: the chunks it
    began count as delivered to it, the rest goes to the others (or, static, to a
    replacement of its index). It should exceed the longest pause of a live consumer's
    process; a consumer that comes back after it gets :class:`ServiceError`.
    """

    def __init__(
        self,
        dataset: Dataset | Callable[[int, int], Dataset],
        num_workers: int = 2,
        *,
        sharding: str = "dynamic",
        memory_budget: int | str = "256MiB",
        num_splits: int | None = None,
        chunk_size: int = 16,
        prefetch: int = 2,
        num_cpus: float = 1,
        worker_baseline: int | str = WORKER_BASELINE,
        max_restarts: int = 3,
        start_timeout: float = 120.0,
        lease_timeout_s: float = 60.0,
    ) -> None:
        if (isinstance(lease_timeout_s, bool) or not isinstance(lease_timeout_s, (int, float))
                or not lease_timeout_s > 0):
            raise InvalidArgumentError(
                f"DataService: lease_timeout_s must be a number of seconds > 0, got "
                f"{lease_timeout_s!r}")
        for name, value in (("num_workers", num_workers), ("chunk_size", chunk_size),
                            ("prefetch", prefetch)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"DataService: {name} must be an int >= 1, "
                                           f"got {value!r}")
        if num_splits is not None and (isinstance(num_splits, bool)
                                       or not isinstance(num_splits, int) or num_splits < 1):
            raise InvalidArgumentError(
                f"DataService: num_splits must be an int >= 1, got {num_splits!r}")
        if sharding not in ("dynamic", "static"):
            raise InvalidArgumentError(
                f"DataService: sharding must be 'dynamic' or 'static', got {sharding!r}")
        self.plan = _plan(dataset, num_splits, num_workers)
        self.sharding, self.prefetch, self.num_workers = sharding, prefetch, num_workers
        self.memory_budget = parse_bytes(memory_budget)
        self.lease_timeout_s = float(lease_timeout_s)
        if not ray.is_initialized():
            ray.init()
        worker_cls: Any = ray.remote(_Worker).options(
            num_cpus=num_cpus, memory=task_memory(self.memory_budget, worker_baseline),
            max_concurrency=64, max_restarts=max_restarts, scheduling_strategy="SPREAD")
        self.workers: list[Any] = [worker_cls.remote(self.plan, self.memory_budget, chunk_size)
                                   for _ in range(num_workers)]
        coordinator_cls: Any = ray.remote(_Coordinator)
        # on the driver's node: the job's progress lives there, and a node the coordinator
        # shared with workers could die with them
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.coordinator: Any = coordinator_cls.options(
            num_cpus=0, scheduling_strategy=here).remote(
                self.plan.count, num_workers, sharding, self.lease_timeout_s, self.workers)
        pings = [w.ping.remote() for w in self.workers]
        ready, _ = ray.wait(pings, num_returns=len(pings), timeout=start_timeout)
        if len(ready) < len(pings):
            free: Any = ray.available_resources  # untyped
            self.shutdown()
            raise ServiceError(
                f"DataService: only {len(ready)} of {num_workers} worker actors started "
                f"within {start_timeout} s; each asks Ray for {num_cpus} CPU and "
                f"{task_memory(self.memory_budget, worker_baseline)} bytes of memory, and "
                f"the cluster has {free()} free")

    @property
    def num_splits(self) -> int:
        return self.plan.count

    def consumer(self, index: int, count: int = 1) -> ServiceConsumer:
        """The iterable for consumer ``index`` of ``count`` (picklable: pass it to a
        trainer's actor or task on any node)."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise InvalidArgumentError(f"DataService.consumer: count must be an int >= 1, "
                                       f"got {count!r}")
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
            raise InvalidArgumentError(
                f"DataService.consumer: index must be in 0..{count - 1}, got {index!r}")
        consumer = ServiceConsumer(self.coordinator, self.workers, index, count, self.prefetch,
                                   self.sharding, self.num_splits, self.lease_timeout_s)
        if self.sharding == "static":
            # a replacement reads on where its index stands: the splits its predecessor
            # left are in that epoch (an earlier one is done: its first pass would be empty)
            consumer.epoch = ray.get(self.coordinator.first_open_epoch.remote(index, count))
        return consumer

    def stats(self) -> dict[str, Any]:
        """The coordinator's view: worker failures seen, splits leased per worker, the
        splits done per epoch, and how many splits were taken from consumers whose
        leases expired (``reassigned``)."""
        result: dict[str, Any] = ray.get(self.coordinator.stats.remote())
        return result

    def shutdown(self) -> None:
        """Stop the actors (consumers then fail with :class:`ServiceError`)."""
        for actor in [*self.workers, self.coordinator]:
            with contextlib.suppress(Exception):
                ray.kill(actor)


class _Reading:
    """A split a consumer reads: its worker, the chunks in flight and received."""

    def __init__(self, split: int, worker: int, attempt: int, state: dict[str, Any] | None,
                 seq: int, offset: int, token: str = "") -> None:
        self.split, self.worker, self.attempt, self.token = split, worker, attempt, token
        self.state, self.seq, self.offset = state, seq, offset  # the yield position
        self.received: dict[int, tuple[list[Any], dict[str, Any]]] = {}
        self.in_flight: list[Any] = []
        self.total: int | None = None  # chunks in the split, once its end was seen

    @property
    def key(self) -> str:
        # the consumer's token first: a split re-assigned from an expired consumer runs
        # under another key on the same worker, and the worker drops the old one's
        return f"{self.token}/{self.split}/{self.attempt}"

    def next_unreceived(self) -> int:
        seq = self.seq
        while seq in self.received:
            seq += 1
        return seq


class ServiceConsumer:
    """One trainer's stream from a :class:`DataService`; iterate it for one epoch
    (the next ``iter()`` reads the next epoch). Picklable (before it reads).

    ``close()`` (or leaving ``with consumer:``) gives its unfinished splits back to the
    service, resuming exactly after what it yielded, so the consumers that stay read
    them (static sharding: a replacement consumer of the same index). A consumer whose
    process dies loses its splits after the service's ``lease_timeout_s``: the chunks
    it began count as delivered to it (at most ``chunk_size - 1`` elements per split it
    was reading never reach another consumer), the rest goes to the others."""

    def __init__(self, coordinator: Any, workers: list[Any], index: int, count: int,
                 prefetch: int, sharding: str, num_splits: int,
                 lease_timeout_s: float = 60.0) -> None:
        self.coordinator, self.workers, self.sharding = coordinator, workers, sharding
        self.num_splits, self.lease_timeout_s = num_splits, lease_timeout_s
        self.index, self.count, self.prefetch = index, count, prefetch
        self.epoch = 0
        self.done: list[int] = []
        self.reading: list[_Reading] = []
        self.exhausted = False
        # who holds a lease: one token per consumer object (a copy sent to a trainer
        # gets its own), so a consumer whose leases expired is told apart from the one
        # that took its splits
        self.token = uuid.uuid4().hex[:12]
        self._generation = 0  # bumped by close(): an iterator made before it ends
        self._renewer: threading.Thread | None = None
        # when the last call the coordinator answered was sent (time.monotonic()), and
        # the chunk report not yet confirmed with its sending time
        self._contact = 0.0
        # chunks begun and not yet reported: (epoch, split) -> (next seq, state before it)
        self._unreported: dict[tuple[int, int], tuple[int, Any]] = {}
        self._wake = threading.Event()

    def __getstate__(self) -> dict[str, Any]:
        if self.reading:
            raise InvalidArgumentError(
                f"ServiceConsumer {self.index}: send a consumer to a trainer before it "
                "reads; one reading holds splits on the workers that its copy could not "
                "finish (checkpoint with get_state() and resume a new job instead)")
        return {"coordinator": self.coordinator, "workers": self.workers, "index": self.index,
                "count": self.count, "prefetch": self.prefetch, "sharding": self.sharding,
                "num_splits": self.num_splits, "lease_timeout_s": self.lease_timeout_s,
                "state": self.get_state()}

    def __setstate__(self, data: dict[str, Any]) -> None:
        self.__init__(data["coordinator"], data["workers"], data["index"],  # type: ignore[misc]
                      data["count"], data["prefetch"], data["sharding"], data["num_splits"],
                      data.get("lease_timeout_s", 60.0))
        self._load(data["state"])

    # -- checkpoints ------------------------------------------------------------------

    def get_state(self) -> dict[str, Any]:
        """Where this consumer is: small JSON (no elements)."""
        return {"format": _STATE_FORMAT, "index": self.index, "count": self.count,
                "num_splits": self.num_splits, "sharding": self.sharding,
                "epoch": self.epoch, "finished": self.exhausted, "done": sorted(self.done),
                "reading": [[r.split, r.state, r.seq, r.offset] for r in self.reading]}

    def _load(self, state: dict[str, Any]) -> None:
        self.epoch, self.done = state["epoch"], list(state["done"])
        self.reading = [_Reading(split, -1, 0, st, seq, offset, self.token)
                        for split, st, seq, offset in state["reading"]]
        self.exhausted = bool(state.get("finished", False))

    def set_state(self, state: dict[str, Any]) -> None:
        """Resume where ``state`` was taken; call it on every consumer before any reads."""
        if not isinstance(state, dict) or state.get("format") != _STATE_FORMAT:
            raise CheckpointError(
                f"ServiceConsumer.set_state: not a DataService consumer state (format "
                f"{state.get('format') if isinstance(state, dict) else type(state).__name__!r},"
                f" expected {_STATE_FORMAT!r})")
        if (state["index"], state["count"]) != (self.index, self.count):
            raise CheckpointError(
                f"ServiceConsumer.set_state: the state is consumer {state['index']} of "
                f"{state['count']}'s, this is consumer {self.index} of {self.count}")
        # Splits are numbered within one cut of the pipeline: under another cut the
        # state's done and reading splits are other positions (repeats and losses).
        taken = (state.get("num_splits", self.num_splits), state.get("sharding", self.sharding))
        if taken != (self.num_splits, self.sharding):
            raise CheckpointError(
                f"ServiceConsumer.set_state: the state was taken from a service of "
                f"{taken[0]} splits with sharding={taken[1]!r}; this one has "
                f"{self.num_splits} with sharding={self.sharding!r} (the default number of "
                "splits follows num_workers): make the service with num_splits="
                f"{taken[0]} and sharding={taken[1]!r} to resume from it")
        self._close_all()
        self._load(state)
        ray.get(self.coordinator.restore.remote(
            self.index, self.count, self.epoch, self.done,
            [[r.split, r.state, r.seq, r.offset] for r in self.reading]))

    def state_dict(self) -> dict[str, Any]:
        """``get_state()`` in PyTorch's ``state_dict()`` form."""
        from headrace._stateful import to_state_dict

        return to_state_dict(self.get_state())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from headrace._stateful import from_state_dict

        self.set_state(from_state_dict(state_dict, "ServiceConsumer"))

    # -- reading ----------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        if self.exhausted:  # the next epoch
            self.epoch, self.done, self.reading, self.exhausted = self.epoch + 1, [], [], False
        return self._elements()

    def _ask(self, method: str, *args: Any) -> Any:
        """Call the coordinator; its ServiceError (this consumer's leases expired)
        arrives as itself, not wrapped in Ray's error."""
        sent = time.monotonic()
        try:
            answer = self._ask_ref(getattr(self.coordinator, method).remote(*args))
            self._contact = max(self._contact, sent)
            return answer
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as error:
            raise ServiceError(
                f"ServiceConsumer {self.index}: the service's coordinator is gone (shut "
                f"down, or its node died): {type(error).__name__}") from None

    def _open(self, reading: _Reading) -> None:
        """(Re-)open ``reading``'s split on its worker after the last chunk received in
        order: the worker numbers its chunks on from there, so one received already
        (out of order) is recognised by its number and dropped."""
        start = reading.next_unreceived()
        state = reading.received[start - 1][1] if start - 1 in reading.received else reading.state
        for _ in range(4 * len(self.workers) + 1):
            try:
                ray.get(self.workers[reading.worker].open.remote(
                    reading.key, reading.split, state, 0, start))
                return
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                self._replace(reading)
        raise ServiceError(
            f"DataService: split {reading.split} could not be opened on any worker (each "
            "died or was unavailable in turn)")

    def _replace(self, reading: _Reading) -> None:
        reading.worker = self._ask("replace", self.token, self.epoch, reading.split,
                                   reading.worker)
        reading.attempt += 1
        reading.in_flight = []

    def _lease(self) -> str:
        """Lease the next split: "got", "none" (nothing left for this consumer) or
        "wait" (none free now, but a silent consumer's may come back)."""
        got = self._ask("lease", self.token, self.index, self.count, self.epoch)
        if got is None:
            return "none"
        if got[0] == "wait":
            return "wait"
        split, worker, resume = got
        restored = next((r for r in self.reading if r.split == split and r.worker < 0), None)
        if restored is not None:
            restored.worker = worker
            reading = restored
        elif resume is not None:  # a split another consumer left: resume where it did
            state, seq, offset = resume
            reading = _Reading(split, worker, 0, state, seq, offset, self.token)
            self.reading.append(reading)
        else:
            reading = _Reading(split, worker, 0, None, 0, 0, self.token)
            self.reading.append(reading)
        self._open(reading)
        self._start_renewing()
        return "got"

    def _report(self, split: int, seq: int, after: dict[str, Any] | None) -> None:
        """Record that this consumer begins the chunk before ``seq`` (the split resumes
        after it if the consumer dies). Its thread sends what was recorded at most every
        ``_REPORT_EVERY_S`` in one call, so a fast consumer does not make one call per
        chunk. A consumer the coordinator has not answered for half the lease timeout (a
        stall, a process stopped and resumed) reports at once and waits for the answer,
        so an expired one raises before it yields a chunk another consumer now reads."""
        if time.monotonic() - self._contact < self.lease_timeout_s / 2:
            self._unreported[(self.epoch, split)] = (seq, after)
            self._wake.set()
        else:
            self._ask("progress", self.token, [[self.epoch, split, seq, after]])

    def _ask_ref(self, ref: Any) -> Any:
        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as error:
            cause = getattr(error, "cause", None)
            if isinstance(cause, ServiceError):
                raise ServiceError(f"ServiceConsumer {self.index}: {cause}") from None
            raise

    def _start_renewing(self) -> None:
        """Renew this consumer's leases from a thread while it holds splits, so a slow
        trainer step (between two chunks) does not look like a dead consumer."""
        if self._renewer is None or not self._renewer.is_alive():
            self._renewer = threading.Thread(
                target=_renew, args=(weakref.ref(self), self._wake, self.lease_timeout_s / 4),
                daemon=True, name=f"headrace-consumer-{self.index}-renew")
            self._renewer.start()

    def _fail_over(self, reading: _Reading) -> None:
        self._replace(reading)
        self._open(reading)

    def _request(self, reading: _Reading) -> None:
        while len(reading.in_flight) < self.prefetch and reading.total is None:
            ref = self.workers[reading.worker].take.remote(reading.key)
            reading.in_flight.append(ref)

    def _receive(self, reading: _Reading, ref: Any) -> None:
        reading.in_flight.remove(ref)
        try:
            message = ray.get(ref)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError,
                ray.exceptions.ObjectLostError):  # its worker or its node died
            self._fail_over(reading)
            return
        except ray.exceptions.RayTaskError as error:
            cause: Any = error.as_instanceof_cause  # untyped
            raise cause() from None
        if message[0] == "chunk":
            _, seq, elements, after = message
            if seq >= reading.seq and seq not in reading.received:
                reading.received[seq] = (elements, after)
        elif message[0] == "end":
            reading.total = message[1]
        elif message[0] == "lost":
            self._fail_over(reading)

    def _elements(self) -> Iterator[Any]:
        generation = self._generation
        # the splits read at once: enough to keep every worker busy across consumers
        width = max(1, -(-len(self.workers) // self.count))
        more = True
        while True:
            if more:
                more = self._lease_splits(width)
            if not more:  # a restored split the coordinator no longer reserves is done
                self.reading = [r for r in self.reading if r.worker >= 0]
            if not self.reading:
                break
            # static: the splits in their order; dynamic: whichever has data first
            current = self.reading[0] if self.sharding == "static" else self._ready_reading()
            if current.seq in current.received:
                elements, after = current.received.pop(current.seq)
                # the chunk is this consumer's from its first element on: the service
                # resumes the split after it if this consumer dies (or its leases
                # expired: then this raises instead of yielding what others now read)
                self._report(current.split, current.seq + 1, after)
                for element in elements[current.offset:]:
                    current.offset += 1
                    yield element
                    if self._generation != generation:
                        return  # closed: its splits went back to the service
                current.state, current.seq, current.offset = after, current.seq + 1, 0
                continue
            if current.total is not None and current.seq >= current.total:
                self._finish_split(current)
                continue
            self._wait(current)
        self.exhausted = True

    def _lease_splits(self, width: int) -> bool:
        """Lease splits until ``width`` are read at once, restored ones first (the
        coordinator hands this consumer its reserved ones); False once the service has
        none left for it."""
        while len(self.reading) < width or any(r.worker < 0 for r in self.reading):
            got = self._lease()
            if got == "none":
                return False
            if got == "wait":
                if any(r.worker >= 0 for r in self.reading):
                    break  # read what it holds; ask again after a chunk
                time.sleep(min(0.25, self.lease_timeout_s / 8))
        return True

    def _finish_split(self, current: _Reading) -> None:
        """A split read to its end: its worker's reader closed, the service told."""
        with contextlib.suppress(Exception):
            self.workers[current.worker].close.remote(current.key)
        self._ask("finish", self.token, self.epoch, current.split)
        self.reading.remove(current)
        self.done.append(current.split)

    def _ready_reading(self) -> _Reading:
        """A split with a chunk or its end ready, else the first."""
        for reading in self.reading:
            if reading.seq in reading.received or (
                    reading.total is not None and reading.seq >= reading.total):
                return reading
        for reading in self.reading:
            self._request(reading)
        refs = [ref for r in self.reading for ref in r.in_flight]
        ready, _ = ray.wait(refs, num_returns=1)
        owner = next(r for r in self.reading if ready[0] in r.in_flight)
        self._receive(owner, ready[0])
        return owner

    def _wait(self, current: _Reading) -> None:
        for reading in self.reading:
            self._request(reading)
        if not current.in_flight:
            return
        ready, _ = ray.wait(current.in_flight, num_returns=1)
        self._receive(current, ready[0])

    def _close_all(self) -> None:
        for reading in self.reading:
            if reading.worker >= 0:
                with contextlib.suppress(Exception):
                    self.workers[reading.worker].close.remote(reading.key)

    def close(self) -> None:
        """Leave: give each split this consumer is reading back to the service, to
        resume exactly after the last element it yielded (dynamic: the next consumer
        to ask takes it; static: a replacement consumer of this index), and release
        them on the workers. An iterator of it ends; iterating it again reads on in
        the same epoch with whatever splits are left."""
        held = [r for r in self.reading if r.worker >= 0]
        self._generation += 1
        self._unreported = {}  # the release below says exactly where it stopped
        if held:
            self._ask("release", self.token, self.epoch,
                      [[r.split, r.state, r.seq, r.offset] for r in held])
        self._close_all()
        self.reading = [r for r in self.reading if r.worker < 0]

    def __enter__(self) -> ServiceConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # a consumer dropped mid-epoch: its splits go back at once instead of after the
        # lease timeout (best effort: at interpreter exit Ray may be gone)
        held = [r for r in getattr(self, "reading", []) if r.worker >= 0]
        if held and ray.is_initialized():
            with contextlib.suppress(Exception):
                self.coordinator.release.remote(
                    self.token, self.epoch, [[r.split, r.state, r.seq, r.offset] for r in held])
                self._close_all()


def _renew(consumer_ref: weakref.ref[ServiceConsumer], wake: threading.Event,
           interval: float) -> None:
    """The consumer's reporting thread: sends the chunks it began (at most every
    ``_REPORT_EVERY_S``) and renews its leases every ``interval`` while it holds any.
    Holds the consumer weakly, so it can be collected."""
    while True:
        wake.wait(interval)
        wake.clear()
        consumer = consumer_ref()
        if consumer is None or not ray.is_initialized():
            return  # (after ray.shutdown, a remote call would start Ray again)
        try:
            sent = time.monotonic()
            taken, consumer._unreported = consumer._unreported, {}
            reports = list(taken.items())  # one step under the GIL: the reader may add
            # ref.future(), not ray.get: a ray.shutdown() between the check above and
            # the wait would make ray.get start Ray again from this thread (auto-init)
            if reports:
                consumer.coordinator.progress.remote(
                    consumer.token, [[e, s, q, a] for (e, s), (q, a) in reports]
                ).future().result(timeout=max(interval, 10.0))
            elif any(r.worker >= 0 for r in consumer.reading):
                consumer.coordinator.renew.remote(consumer.token).future().result(
                    timeout=max(interval, 10.0))
            else:
                continue
            consumer._contact = max(consumer._contact, sent)
        except Exception:  # expired (its next chunk says so), or Ray shut down
            return
        finally:
            del consumer
        time.sleep(_REPORT_EVERY_S)  # the chunks begun meanwhile go in the next call


# -- Ray Data interop -----------------------------------------------------------------


def _block(rows: list[Any], batched: bool) -> Any:
    """A Ray Data block from headrace elements: dicts become columns, anything else the
    column ``item`` (Ray's name for unnamed rows); batches are stacked along axis 0."""
    import numpy as np
    from ray.data.block import BlockAccessor

    if batched:
        first = rows[0]
        if isinstance(first, dict):
            columns = {k: np.concatenate([np.asarray(r[k]) for r in rows]) for k in first}
        else:
            columns = {"item": np.concatenate([np.asarray(r) for r in rows])}
    elif isinstance(rows[0], dict):
        columns = {k: np.stack([np.asarray(r[k]) for r in rows]) for k in rows[0]}
    else:
        columns = {"item": np.stack([np.asarray(r) for r in rows])}
    to_block: Any = BlockAccessor.batch_to_block  # untyped
    return to_block(columns)


class _SplitRead:
    """One Ray Data read task: split ``index`` of the plan, in blocks of ``block_rows``
    elements, under ``budget``."""

    def __init__(self, plan: _Plan, index: int, budget: int, block_rows: int,
                 batched: bool) -> None:
        self.plan, self.index, self.budget = plan, index, budget
        self.block_rows, self.batched = block_rows, batched

    def __call__(self) -> Iterator[Any]:
        rows: list[Any] = []
        for element in self.plan.split(self.index, self.budget):
            rows.append(element)
            if len(rows) == self.block_rows:
                yield _block(rows, self.batched)
                rows = []
        if rows:
            yield _block(rows, self.batched)


def to_ray(dataset: Dataset, *, num_splits: int | None = None,
           memory_budget: int | str = "256MiB", block_rows: int = 1024,
           batched: bool = False) -> Any:
    """``dataset`` as a Ray Data ``Dataset``: one read task per split (its files, or
    ranges of its positions, as :class:`DataService` cuts it), each running its part of
    the pipeline under ``memory_budget`` and yielding blocks of ``block_rows`` elements.
    Dict elements become columns, others the column ``item``; ``batched``: the elements
    are batches (their rows become Ray rows). Ray Data's own operators follow."""
    import ray.data
    from ray.data.block import BlockMetadata
    from ray.data.datasource import Datasource, ReadTask

    plan = _plan(dataset, num_splits, 1)
    budget = parse_bytes(memory_budget)

    class HeadraceDatasource(Datasource):  # type: ignore[misc]
        def estimate_inmemory_data_size(self) -> int | None:
            return None

        def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                           data_context: Any = None) -> list[Any]:
            metadata = BlockMetadata(num_rows=None, size_bytes=None, exec_stats=None,
                                     input_files=None)
            return [ReadTask(_SplitRead(plan, i, budget, block_rows, batched), metadata,
                             per_task_row_limit=per_task_row_limit)
                    for i in range(plan.count)]

    source: Any = HeadraceDatasource
    return ray.data.read_datasource(source())


class _RayRows:
    """The rows of a Ray Data ``Dataset``, read batch by batch (a generator's body)."""

    def __init__(self, ray_dataset: Any, batch_size: int) -> None:
        self.ray_dataset, self.batch_size = ray_dataset, batch_size

    def __call__(self) -> Iterator[dict[str, Any]]:
        for batch in self.ray_dataset.iter_batches(batch_size=self.batch_size,
                                                   batch_format="numpy"):
            columns = list(batch.items())
            for i in range(len(columns[0][1])):
                yield {name: values[i] for name, values in columns}


def from_ray(ray_dataset: Any, *, batch_size: int = 256) -> Dataset:
    """A headrace pipeline over a Ray Data ``Dataset``'s rows (dicts of NumPy values),
    read ``batch_size`` rows at a time from Ray's streaming executor. The columns' types
    come from its first row; resuming replays it and skips what was delivered."""
    from headrace._structure import TensorSpec

    sample = ray_dataset.take_batch(1, batch_format="numpy")
    if not isinstance(sample, dict) or not sample:
        raise InvalidArgumentError(
            f"from_ray: expected a Ray Data Dataset with columns, got "
            f"{type(ray_dataset).__name__} whose first batch is {type(sample).__name__}")
    signature = {name: TensorSpec(values.shape[1:], values.dtype)
                 for name, values in sample.items()}
    return Dataset.from_generator(_RayRows(ray_dataset, batch_size), output_signature=signature)

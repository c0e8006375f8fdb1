"""The worker threads of a parallel map: calls handed over with as few wake-ups as can be.

``concurrent.futures.ThreadPoolExecutor`` costs, per call, a Future with a
Condition of its own, a work item, two locks to submit, a Semaphore released by
the worker after each call, and a ``notify_all`` by ``set_result`` with the GIL
held. A map's call is about one image on two cores: the consumer waits for
nearly every call, so each hand-off is paid per element, and a wake-up while
the GIL is held lets the woken thread run only to block on the GIL.

Here a call is one object (:class:`ThreadCall`): the worker takes it from a
queue, keeps its result in it, and wakes the consumer only if the consumer
waits on that very call (through a lock made for that one wait); a worker that
is busy takes its next call from the queue without any wake-up. All the calls
of a stage share one guard lock, held only to change a call's state.

It offers what the map uses of a future: ``result``, ``cancel`` and
``add_done_callback``, so that calls on threads and on worker processes
(``concurrent.futures.Future``) are driven by the same code
(:class:`~headrace._transforms._map_calls.CallFuture`).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import CancelledError
from queue import SimpleQueue
from typing import Any

__all__ = ["MapThreads", "ThreadCall"]

_PENDING, _RUNNING, _DONE, _CANCELLED = range(4)
_log = logging.getLogger(__name__)


class ThreadCall:
    """One call on a map's threads, and the future of its result (see the module doc).

    One thread at a time may wait on it (the stage's consumer).
    """

    __slots__ = ("args", "callbacks", "error", "fn", "guard", "state", "value", "waiter")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...],
                 guard: threading.Lock) -> None:
        self.fn: Callable[..., Any] | None = fn
        self.args: tuple[Any, ...] | None = args
        self.guard = guard
        self.state = _PENDING
        self.value: Any = None
        self.error: BaseException | None = None
        self.callbacks: list[Callable[[Any], object]] | None = None
        # the lock the consumer blocks on, made only when it has to wait
        self.waiter: threading.Lock | None = None

    def run(self) -> None:
        """Run the call (on a worker), unless it was cancelled first."""
        with self.guard:
            if self.state != _PENDING:
                return
            self.state = _RUNNING
        fn, args = self.fn, self.args
        self.fn = self.args = None  # (the inputs are not kept past the call)
        assert fn is not None and args is not None
        try:
            self.value = fn(*args)
        except BaseException as error:  # as a Future keeps it: raised by result()
            self.error = error
        del fn, args
        self._finish(_DONE)

    def _finish(self, state: int) -> None:
        with self.guard:
            self.state = state
            waiter, self.waiter = self.waiter, None
            callbacks, self.callbacks = self.callbacks, None
        if waiter is not None:
            waiter.release()
        for callback in callbacks or ():
            self._call_back(callback)

    def _call_back(self, callback: Callable[[Any], object]) -> None:
        try:
            callback(self)
        except Exception:  # as concurrent.futures does: the worker goes on
            _log.exception("headrace map: a done callback raised")

    def result(self, timeout: None = None) -> Any:
        """The call's result, once it is done (its error raised, as ``Future.result``)."""
        if self.state != _DONE:
            with self.guard:
                state = self.state
                waiter = None
                if state < _DONE:  # (pending or running)
                    assert self.waiter is None, "one thread waits on a call"
                    waiter = self.waiter = threading.Lock()
                    waiter.acquire()
            if state == _CANCELLED:
                raise CancelledError
            if waiter is not None:
                waiter.acquire()  # released by the worker that finishes the call
        if self.state == _CANCELLED:
            raise CancelledError
        error = self.error
        if error is not None:
            try:
                raise error
            finally:
                del error  # (no cycle through this frame)
        return self.value

    def cancel(self) -> bool:
        """Cancel the call if it has not started; whether it is cancelled."""
        with self.guard:  # (a worker's run() checks the state under the guard too)
            if self.state != _PENDING:
                return self.state == _CANCELLED
            self.state = _CANCELLED
        self.fn = self.args = None
        self._finish(_CANCELLED)
        return True

    def add_done_callback(self, fn: Callable[[Any], object]) -> None:
        """Call ``fn(self)`` once the call is done or cancelled (now if it is)."""
        with self.guard:
            if self.state < _DONE:  # (pending or running)
                if self.callbacks is None:
                    self.callbacks = []
                self.callbacks.append(fn)
                return
        self._call_back(fn)


def _work(calls: SimpleQueue[ThreadCall | None]) -> None:
    while True:
        call = calls.get()
        if call is None:
            return
        call.run()
        del call  # (not kept, with its result, while the next get() blocks)


def _stop(calls: SimpleQueue[ThreadCall | None], count: int) -> None:
    for _ in range(count):
        calls.put(None)


class MapThreads:
    """Up to ``most`` worker threads of one map stage, started as calls come.

    The threads hold the queue, not this object: a stage dropped without
    :meth:`shutdown` still lets them go (its finalizer puts their stop marks).
    """

    __slots__ = ("__weakref__", "_stopper", "calls", "guard", "most", "name", "started")

    def __init__(self, most: int, name: str = "headrace-map") -> None:
        self.most, self.name = most, name
        self.calls: SimpleQueue[ThreadCall | None] = SimpleQueue()
        self.guard = threading.Lock()
        self.started = 0
        self._stopper: weakref.finalize[..., MapThreads] | None = None

    def submit(self, fn: Callable[..., Any], *args: Any) -> ThreadCall:
        """Run ``fn(*args)`` on a worker; the call is its future."""
        if self.started < self.most:
            # (started before the call is queued: a thread that cannot start raises
            # here, and no call is left queued that nothing runs)
            thread = threading.Thread(target=_work, args=(self.calls,), daemon=True,
                                      name=f"{self.name}_{self.started}")
            thread.start()
            self.started += 1
            if self._stopper is not None:
                self._stopper.detach()
            self._stopper = weakref.finalize(self, _stop, self.calls, self.started)
        call = ThreadCall(fn, args, self.guard)
        self.calls.put(call)
        return call

    def shutdown(self) -> None:
        """Let the threads go once the calls queued before are taken (cancel them first:
        a cancelled call is skipped)."""
        if self._stopper is not None:
            self._stopper()  # (puts the stop marks once)
            self._stopper = None
        self.started = 0

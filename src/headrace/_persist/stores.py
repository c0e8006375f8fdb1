"""What every cache store does: take elements while the cache is written, then read them."""

from __future__ import annotations

from typing import Any

from headrace._memory.buffer import Reservation

__all__ = ["PassThrough", "Store", "StoreReader"]


class Store:
    """Where one cache's elements go while it is written, and how it is read."""

    #: Whether stopping before the end discards cached elements (and so warns).
    partial = True

    def __init__(self, epochs: tuple[int, ...]) -> None:
        #: The epochs (of enclosing repeats) of the iterator that wrote it: a rebuild
        #: replays the input as that iterator saw it.
        self.epochs = epochs
        self.complete = False
        self.count = 0

    def append(self, element: Any, upstream: Reservation) -> tuple[Any, Reservation]:
        raise NotImplementedError

    def finish(self) -> None:
        raise NotImplementedError

    def discard(self) -> None:
        raise NotImplementedError

    def fail(self) -> None:
        """Discard after an error of the store's own (a full disk, a refused upload): the
        pass was not stopped early, so closing gives no advice about ``take(k)``."""
        self.partial = False
        self.discard()

    def reader(self) -> StoreReader:
        raise NotImplementedError


class PassThrough(Store):
    """Another iterator writes the file: pass the input's elements on, write nothing."""

    partial = False

    def append(self, element: Any, upstream: Reservation) -> tuple[Any, Reservation]:
        self.count += 1
        return element, upstream

    def finish(self) -> None:
        """Nothing was written, so nothing completes: later passes look for the file."""

    def discard(self) -> None:
        """Nothing to remove."""


class StoreReader:
    def pull(self) -> tuple[Any, Reservation]:
        raise NotImplementedError

    def skip(self, count: int) -> int:
        raise NotImplementedError

    def close(self) -> None:
        """Nothing to release by default."""

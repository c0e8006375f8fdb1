"""The one way headrace's resources support ``with``."""

from __future__ import annotations

from typing import TypeVar

_T = TypeVar("_T", bound="ClosesOnExit")


class ClosesOnExit:
    """``with thing:`` closes ``thing`` when the block ends, by error or not.

    For every object that holds something the process must give back (threads,
    descriptors, budget): subclasses define an idempotent ``close()``.
    """

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _T) -> _T:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

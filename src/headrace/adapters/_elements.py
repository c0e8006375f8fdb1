"""The iterator the adapters hand to torch, Keras and ``from_generator``.

A generator (``with iter(ds) as it: for e in it: yield convert(e)``) is the
obvious way to adapt a pipeline, and it loses data: a generator ends at the
first exception that leaves it, so after one bad element raised by ``next()``
the following ``next()`` says ``StopIteration`` and every later element is
gone — although headrace's own iterator goes on after an element's error (a
torch ``DataLoader`` worker, a user catching the error and calling ``next()``
again, Keras on a backend that tolerates it, all saw the stream end early).
:class:`ConvertedElements` is an iterator object instead: an error from the
pipeline or from ``convert`` is raised at its element's position, and the next
``next()`` continues with the element after it, exactly as ``iter(dataset)``.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterator as PyIterator
from typing import TYPE_CHECKING, Any

from headrace._closing import ClosesOnExit
from headrace._errors import CheckpointError, IteratorClosedError
from headrace._stateful import StateDict

if TYPE_CHECKING:
    from headrace._dataset import Dataset
    from headrace.core.run import DatasetIterator

__all__ = ["ConvertedElements"]


class ConvertedElements(ClosesOnExit, StateDict, PyIterator[Any]):
    """One run of ``dataset``, each element passed through ``convert``.

    ``end`` makes the exception raised when the pipeline is exhausted (by
    default ``StopIteration``; Keras's TF trainer wants ``OutOfRangeError``).
    ``get_state``/``set_state`` are the run's own (the position after the
    last element handed out, a failed one included); ``state_dict``/``load_state_dict``
    the same for PyTorch's checkpoint tools, so a torchdata ``StatefulDataLoader``
    keeps each worker's position.
    """

    def __init__(
        self,
        dataset: Dataset,
        convert: Callable[[Any], Any] | None = None,
        end: Callable[[], BaseException] | None = None,
    ) -> None:
        self._elements: DatasetIterator = iter(dataset)
        self._convert = convert
        self._end = end
        #: once the pipeline ended (and was closed): its last state, or why it had none
        self._final: dict[str, Any] | CheckpointError | None = None

    def __iter__(self) -> ConvertedElements:
        return self

    def __next__(self) -> Any:
        if self._final is not None:
            raise StopIteration if self._end is None else self._end()
        try:
            element = next(self._elements)
        except StopIteration:
            self._finish()
            if self._end is None:
                raise
            raise self._end() from None
        return element if self._convert is None else self._convert(element)

    def _finish(self) -> None:
        """The pipeline ended: its threads, files and budget go back now (not when the
        framework drops this iterator), and its last state stays readable."""
        try:
            self._final = self._elements.get_state()
        except CheckpointError as error:  # refused there (a stage out of order): say so later
            self._final = CheckpointError(str(error))
        self._elements.close()

    def get_state(self) -> dict[str, Any]:
        """The pipeline's state after the last element handed out (see ``DatasetIterator``)."""
        if isinstance(self._final, CheckpointError):
            raise CheckpointError(str(self._final))
        if self._final is not None:
            return dict(self._final)
        return self._elements.get_state()

    def set_state(self, state: dict[str, Any]) -> None:
        """Resume where ``state`` was taken (see ``DatasetIterator.set_state``)."""
        if self._final is not None:
            raise IteratorClosedError(
                "this iterator ran to its end; make a new one to restore a state into"
            )
        self._elements.set_state(state)

    def close(self) -> None:
        """Stop the pipeline's threads and return its memory now (also on ``with`` exit)."""
        self._elements.close()

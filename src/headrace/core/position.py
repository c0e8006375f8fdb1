"""Where the element a map function runs on sits in the pipeline: what an int ``seed``
of a random op inside the function is combined with.

Why: tf.data users write ``random_flip_left_right(image, seed=42)`` inside a map. A
generator per seed and process gives each element whatever draw comes next, so
the augmentation depended on which worker (thread or process) took the element,
on thread timing and on restarts (G3, G4). The map now says, while its function
runs, which element it is: the epoch of every ``repeat`` around the map and the
element's index in the map's input (the count of elements the map has taken in
this run of its iterator, upstream errors included, the same whether the map
runs sequentially, on threads or on processes, and restored with its state). A
random op seeded with an int draws from that position (see
``headrace.image._random``), so the same element gets the same augmentation
whatever runs it, and another one in the next epoch. Outside a pipeline (no map
running) there is no position.
"""

from __future__ import annotations

from contextvars import ContextVar

__all__ = ["element_position", "position_of"]

CURRENT_POSITION: ContextVar[tuple[int, ...] | None] = ContextVar(
    "headrace_element_position", default=None
)


def element_position() -> tuple[int, ...] | None:
    """``(*epochs, index)`` of the element the running map function was called on: the
    epoch of each ``repeat`` enclosing the map (outermost first) and the element's
    index in the map's input; None outside a pipeline's map."""
    return CURRENT_POSITION.get()


def position_of(epochs: tuple[int, ...], index: int) -> tuple[int, ...]:
    """The position of element ``index`` of a map's input in the epochs ``epochs``."""
    return (*epochs, index)

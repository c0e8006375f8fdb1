"""``state_dict()``/``load_state_dict()``: the checkpoint protocol of PyTorch's tools.

``torch.distributed.checkpoint`` saves any object with these two methods (its
``Stateful`` protocol), torchdata's ``StatefulDataLoader`` asks each worker's
iterator for them, and many training loops call them on everything they
checkpoint. A headrace iterator already has ``get_state``/``set_state``; this
mixin gives it the other two names, over one representation:
``{"headrace_state": <the state as JSON text>}``.

Why one JSON string rather than the nested state dict: DCP flattens nested
dicts into one key per leaf and, on load, fills the keys of the state dict a
*fresh* object reports. A pipeline's state has keys that depend on where it
is (an interleave's open slots, a buffer's drawn counters), so a fresh
iterator's keys need not match the saved ones; one string leaf always does,
and stays readable (and checksummed, G4) in the checkpoint.
"""

from __future__ import annotations

import json
from typing import Any

from headrace._errors import CheckpointError

__all__ = ["STATE_DICT_KEY", "StateDict", "from_state_dict", "to_state_dict"]

#: The one key of a headrace ``state_dict()``.
STATE_DICT_KEY = "headrace_state"


def to_state_dict(state: dict[str, Any]) -> dict[str, Any]:
    """A ``get_state()`` dict in ``state_dict()`` form (see the module doc)."""
    return {STATE_DICT_KEY: json.dumps(state, sort_keys=True)}


def from_state_dict(state_dict: Any, where: str) -> dict[str, Any]:
    """The ``get_state()`` dict inside a ``state_dict()``; ``where`` names the caller."""
    if not isinstance(state_dict, dict) or STATE_DICT_KEY not in state_dict:
        keys = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
        raise CheckpointError(
            f"{where}.load_state_dict: expected a dict with the key {STATE_DICT_KEY!r}, as "
            f"state_dict() makes, got {keys!r}"
        )
    text = state_dict[STATE_DICT_KEY]
    if isinstance(text, bytes):
        text = text.decode()
    if not isinstance(text, str):
        raise CheckpointError(
            f"{where}.load_state_dict: {STATE_DICT_KEY!r} must be the JSON text state_dict() "
            f"made, got {type(text).__name__}"
        )
    try:
        state = json.loads(text)
    except ValueError as error:
        raise CheckpointError(
            f"{where}.load_state_dict: {STATE_DICT_KEY!r} is not JSON ({error})"
        ) from None
    if not isinstance(state, dict):
        raise CheckpointError(
            f"{where}.load_state_dict: {STATE_DICT_KEY!r} holds a {type(state).__name__}, "
            "not an iterator state"
        )
    return state


class StateDict:
    """Mixin: ``state_dict``/``load_state_dict`` over the class's ``get_state``/``set_state``."""

    def get_state(self) -> dict[str, Any]:
        raise NotImplementedError

    def set_state(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """This iterator's position for PyTorch's checkpoint tools (DCP's ``Stateful``,
        torchdata's ``StatefulDataLoader``): ``get_state()`` as one JSON string."""
        return to_state_dict(self.get_state())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume where :meth:`state_dict` was taken (``set_state``'s checks apply)."""
        self.set_state(from_state_dict(state_dict, type(self).__name__))

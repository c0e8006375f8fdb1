"""Orbax: a ``CheckpointHandler`` that saves every host's headrace iterator state.

``orbax.checkpoint.CheckpointManager`` saves the model's arrays collectively; an
input pipeline's position is per host (each reads its own shard, see
:func:`headrace.auto_shard`), so each process writes its own file,
``process_<i>-of-<n>.json``, into the item's directory, and restores its own —
not only the primary host's, which would give every host the primary's position.
The file is the iterator's ``get_state()`` (JSON, checksummed: G4), so it is
also readable without Orbax.

Use it through its args, in a ``Composite`` with the model's::

    manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(train_state),
        data=HeadraceCheckpointSave(iterator)))
    manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state),
        data=HeadraceCheckpointRestore(iterator)))

``iterator`` is anything with ``get_state``/``set_state``: ``iter(ds)``,
:func:`headrace.adapters.jax.to_jax`'s iterator (which counts only the batches
handed out, not those already on the device), ``to_torch()``'s.
``import headrace.adapters.orbax`` imports Orbax (``headrace[jax]``).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import orbax.checkpoint as ocp
from etils import epath

from headrace._errors import CheckpointError

__all__ = ["HeadraceCheckpointHandler", "HeadraceCheckpointRestore", "HeadraceCheckpointSave"]


def _process() -> tuple[int, int]:
    import jax

    return jax.process_index(), jax.process_count()


class HeadraceCheckpointHandler(ocp.CheckpointHandler):  # type: ignore[misc]
    """Saves and restores this process's iterator state as ``process_<i>-of-<n>.json``.

    ``process_index``/``process_count`` default to JAX's (``jax.process_index()``
    of ``jax.process_count()``); give them where another launcher numbers the
    hosts.
    """

    def __init__(self, process_index: int | None = None, process_count: int | None = None) -> None:
        self._index, self._count = process_index, process_count

    def _name(self) -> str:
        index, count = _process()
        if self._index is not None:
            index = self._index
        if self._count is not None:
            count = self._count
        return f"process_{index}-of-{count}.json"

    def save(self, directory: epath.Path, *args: Any, **kwargs: Any) -> None:
        save_args = kwargs.get("args", args[0] if args else None)
        iterator = getattr(save_args, "iterator", save_args)
        if iterator is None:
            raise CheckpointError(
                "HeadraceCheckpointHandler.save: pass the iterator to save "
                "(args=HeadraceCheckpointSave(iterator))"
            )
        state = iterator.get_state()
        (epath.Path(directory) / self._name()).write_text(json.dumps(state))

    def restore(self, directory: epath.Path, *args: Any, **kwargs: Any) -> Any:
        restore_args = kwargs.get("args", args[0] if args else None)
        iterator = getattr(restore_args, "iterator", restore_args)
        if iterator is None:
            raise CheckpointError(
                "HeadraceCheckpointHandler.restore: pass the iterator to restore into "
                "(args=HeadraceCheckpointRestore(iterator))"
            )
        path = epath.Path(directory) / self._name()
        if not path.exists():
            found = sorted(p.name for p in epath.Path(directory).glob("process_*.json"))
            raise CheckpointError(
                f"HeadraceCheckpointHandler: no iterator state for this process ({path}); "
                f"the checkpoint holds {found} (saved by another number of processes?)"
            )
        try:
            state = json.loads(path.read_text())
        except ValueError as error:
            raise CheckpointError(f"{path}: not an iterator state ({error})") from None
        iterator.set_state(state)
        return iterator

    def metadata(self, directory: epath.Path) -> None:
        return None

    def close(self) -> None:
        pass


@ocp.args.register_with_handler(HeadraceCheckpointHandler, for_save=True)  # type: ignore[misc]
@dataclasses.dataclass
class HeadraceCheckpointSave(ocp.args.CheckpointArgs):  # type: ignore[misc]
    """Orbax save args: the iterator whose state this process saves."""

    iterator: Any


@ocp.args.register_with_handler(HeadraceCheckpointHandler, for_restore=True)  # type: ignore[misc]
@dataclasses.dataclass
class HeadraceCheckpointRestore(ocp.args.CheckpointArgs):  # type: ignore[misc]
    """Orbax restore args: the iterator (of the same pipeline) to restore into."""

    iterator: Any

"""Stand-ins for a record not read yet, so that a per-record parse can be seen, not run.

``parse_single_example(DeferredRecord(), spec)`` answers with one :class:`DeferredFeature`
per feature instead of values. A caller that applies a function to a DeferredRecord
learns, without data, whether the function only parses its record and picks features
from the result - and then which parse it performs and how the result is arranged. That
is what lets ``map(parse one record).batch(n)`` run as one columnar parse per batch
(``headrace._transforms.parse_fusion``), as tf.data traces a map function once and fuses
map and batch.

Anything else done with a stand-in (arithmetic, NumPy conversion, truth tests,
attributes) raises ``TypeError``: the function then does more than parse, and runs per
record as written.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NoReturn

from headrace.io.example.specs import FeatureSpec

__all__ = ["DeferredFeature", "DeferredRecord"]


class DeferredRecord:
    """A serialized record that is not there yet; collects the parses asked of it."""

    __slots__ = ("parses",)

    def __init__(self) -> None:
        #: One feature dict per parse call on this record, in call order.
        self.parses: list[dict[str, FeatureSpec]] = []

    def parse(self, features: Mapping[str, FeatureSpec]) -> dict[str, DeferredFeature]:
        """Record a parse of this record with ``features``; stand-ins for its results."""
        index = len(self.parses)
        self.parses.append(dict(features))
        return {name: DeferredFeature(self, index, name) for name in features}

    def _refuse(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError("a deferred record can only be parsed")

    __array__ = __bool__ = __len__ = __iter__ = _refuse


class DeferredFeature:
    """Feature ``name`` of parse number ``parse`` of ``record``, not computed yet."""

    __slots__ = ("name", "parse", "record")

    def __init__(self, record: DeferredRecord, parse: int, name: str) -> None:
        self.record, self.parse, self.name = record, parse, name

    def _refuse(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError(f"feature {self.name!r} of a deferred record has no value yet")

    __array__ = __bool__ = __len__ = __iter__ = __float__ = __int__ = __index__ = _refuse
    __getitem__ = __add__ = __radd__ = __mul__ = __rmul__ = __sub__ = __rsub__ = _refuse
    __truediv__ = __rtruediv__ = __lt__ = __le__ = __gt__ = __ge__ = _refuse

    def __repr__(self) -> str:
        return f"<deferred feature {self.name!r}>"

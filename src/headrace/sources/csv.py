"""Moved to :mod:`headrace.csv.source` (CSV is one package); this path still imports it."""

from headrace.csv.source import *  # noqa: F403
from headrace.csv.source import __all__ as __all__

"""Moved to :mod:`headrace.csv.reader` (CSV is one package); this path still imports it."""

from headrace.csv.reader import *  # noqa: F403
from headrace.csv.reader import __all__ as __all__

"""Moved to :mod:`headrace.csv.datasets` (CSV is one package); this path still imports it."""

from headrace.csv.datasets import *  # noqa: F403
from headrace.csv.datasets import __all__ as __all__

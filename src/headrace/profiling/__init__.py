"""Where memory and time go: process memory, per-stage bookings, throughput.

- ``Dataset.profile`` (giving a :class:`Profile`): run a pipeline, count and time
  every stage, sample memory by stage over time; a terminal table and an HTML
  report. ``headrace.profiling.profile(ds)`` still works but is deprecated.
- :class:`Monitor`: the same samples over time for any iterator, at no cost per
  element (it reads what the stages already keep) — cheap enough to leave on.
- :func:`diagnose`: the leak detector and lint of ``headrace doctor``.
- :func:`lint_recipe`: a recipe's hazards, each with a concrete fix.
"""

from headrace._warn import deprecated_attributes
from headrace.profiling.doctor import Diagnosis, diagnose
from headrace.profiling.lint import Finding, lint_recipe
from headrace.profiling.profiler import Profile, StageProfile
from headrace.profiling.timeline import Decision, Monitor, Sample

__all__ = [
    "Decision",
    "Diagnosis",
    "Finding",
    "Monitor",
    "Profile",
    "Sample",
    "StageProfile",
    "diagnose",
    "lint_recipe",
]

__getattr__ = deprecated_attributes(
    __name__, {"profile": ("headrace.profiling.profiler:profile", "Dataset.profile(...)")}
)

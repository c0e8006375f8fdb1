"""Where memory and time go: process memory, per-stage bookings, throughput.

- :func:`profile` / ``Dataset.profile``: run a pipeline, count and time every
  stage, sample memory by stage over time; a terminal table and an HTML report.
- :class:`Monitor`: the same samples over time for any iterator, at no cost per
  element (it reads what the stages already keep) — cheap enough to leave on.
- :func:`diagnose`: the leak detector and lint of ``headrace doctor``.
- :func:`lint_recipe`: a recipe's hazards, each with a concrete fix.
"""

from headrace.profiling.doctor import Diagnosis, diagnose
from headrace.profiling.lint import Finding, lint_recipe
from headrace.profiling.profiler import Profile, StageProfile, profile
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
    "profile",
]

"""Is a measure growing from epoch to epoch, or only wandering? One answer for every caller.

``headrace doctor``, the tf.data graph diagnosis and Keras's ``MemoryMonitor``
all ask it of a few numbers, one per epoch, so the test has to be honest with
few points. The slope is fitted twice: least squares, with its standard error,
and Theil-Sen (the median of the slopes between every pair of epochs), which
one outlying epoch cannot move. Growth is significant when the robust slope
passes a floor *and* the least-squares slope is above zero by more than the
Student-t critical value with ``points - 2`` degrees of freedom at the tail
probability that ``sigmas`` has under a normal law. With a normal threshold
instead, three epochs of allocator noise (one degree of freedom) pass "three
sigma" one time in ten; with the t value they need to lie close to a straight
line, as a real leak's do (it adds about the same bytes every epoch).
"""

from __future__ import annotations

import functools
import math
import statistics
from dataclasses import dataclass

from headrace._memory.units import format_bytes

__all__ = ["Trend", "fit_trend", "t_critical"]


def _t_inside(t: float, df: int) -> float:
    """P(|T| < t) for Student's t with ``df`` degrees of freedom (exact finite sums)."""
    theta = math.atan(t / math.sqrt(df))
    sin, cos = math.sin(theta), math.cos(theta)
    term, total = 1.0, 1.0
    if df % 2:  # odd: (2/pi)(theta + sin cos (1 + 2/3 cos^2 + 2*4/(3*5) cos^4 + ...))
        if df == 1:
            return 2 / math.pi * theta
        for k in range(1, (df - 1) // 2):
            term *= cos * cos * (2 * k) / (2 * k + 1)
            total += term
        return 2 / math.pi * (theta + sin * cos * total)
    for k in range(1, df // 2):  # even: sin (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ...)
        term *= cos * cos * (2 * k - 1) / (2 * k)
        total += term
    return sin * total


@functools.lru_cache(maxsize=256)
def t_critical(df: int, sigmas: float) -> float:
    """The t with ``P(T_df > t)`` equal to a normal law's ``P(Z > sigmas)``."""
    if df < 1:
        return math.inf
    tail = 0.5 * math.erfc(sigmas / math.sqrt(2))

    def above(t: float) -> float:
        return (1 - _t_inside(t, df)) / 2

    low, high = 0.0, 1.0
    while above(high) > tail:
        low, high = high, high * 2
        if high > 1e12:
            return math.inf
    while high - low > 1e-9 * high:  # bisection: the tail shrinks as t grows
        mid = (low + high) / 2
        low, high = (mid, high) if above(mid) > tail else (low, mid)
    return high


@dataclass(frozen=True)
class Trend:
    """Growth per epoch of one measure: robust and least-squares slopes, with uncertainty."""

    what: str
    slope: float  # Theil-Sen: median of pairwise slopes
    ols: float
    stderr: float
    points: int

    def significant(self, floor: float, sigmas: float = 4.0) -> bool:
        """Growth beyond noise: the robust slope passes ``floor`` and the fitted slope is
        above zero by more than the t critical value at ``sigmas``' normal tail."""
        if self.points < 3 or self.slope <= floor:
            return False
        return self.ols > t_critical(self.points - 2, sigmas) * self.stderr

    def format(self, unit: str = "bytes") -> str:
        """One line for a report: both slopes, in bytes or as plain numbers."""
        if unit == "bytes":
            return (f"{self.what}: {_signed_bytes(self.slope)}/epoch (least squares "
                    f"{_signed_bytes(self.ols)} ± {format_bytes(int(self.stderr))})")
        return f"{self.what}: {self.slope:+.2f}/epoch (least squares {self.ols:+.2f} ± {self.stderr:.2f})"


def _signed_bytes(value: float) -> str:
    return ("-" if value < 0 else "+") + format_bytes(int(abs(value)))


def fit_trend(what: str, values: list[float]) -> Trend:
    """Fit the slope of ``values`` (one per epoch) both ways (see the module doc)."""
    n = len(values)
    if n < 2:
        return Trend(what, 0.0, 0.0, 0.0, n)
    xs = list(range(n))
    pairwise = [
        (values[j] - values[i]) / (j - i) for i in range(n) for j in range(i + 1, n)
    ]
    robust = statistics.median(pairwise)
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(values)
    sxx = sum((x - mean_x) ** 2 for x in xs)
    ols = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, values, strict=True)) / sxx
    residuals = [y - (mean_y + ols * (x - mean_x)) for x, y in zip(xs, values, strict=True)]
    stderr = (
        (sum(r * r for r in residuals) / (n - 2) / sxx) ** 0.5 if n > 2 else float("inf")
    )
    return Trend(what, robust, ols, stderr, n)

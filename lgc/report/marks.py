"""The three marks of a comparison fixed before its runs, and what a cell can detect.

A method's gap to the reference (its metric minus the reference's, paired by seed, in points) has a
two-sided Student-t interval over the seeds. Against a margin ``m`` (1 point in lgc's protocols):

* ``within``: the interval's lower end is at or above ``-m``: the method loses less than the margin;
* ``worse``: the interval's upper end is below ``-m``: it loses more than the margin;
* ``inconclusive``: the interval straddles ``-m``: at this many seeds neither can be said.

"Not within" is never "worse": at a cell's spread a method that loses nothing can still fail to be
marked within, and how often is printed with the table. For a cell whose paired gaps spread by
``sd`` over ``n`` seeds, :func:`detectable_loss` is the smallest true loss the cell marks ``worse``
with a given probability, and :func:`within_probability` the probability that a method with a
given true gap is marked ``within``; both from the noncentral t distribution of the interval's
statistic (the spread taken as the true one).
"""

from __future__ import annotations

import math

from lgc.report.seeds import Interval

__all__ = ["MARKS", "detectable_loss", "mark", "within_probability", "worse_probability"]

#: The marks, best first.
MARKS = ("within", "inconclusive", "worse")


def _critical(n: int, confidence: float) -> float:
    from scipy.stats import t

    return float(t.ppf(0.5 + confidence / 2, n - 1))


def mark(gap: Interval | None, margin: float, confidence: float = 0.95) -> str | None:
    """``within``, ``worse`` or ``inconclusive`` for a paired gap (in the margin's unit); None
    without an interval (fewer than two paired seeds). ``gap`` must be at ``confidence``: the
    :class:`~lgc.report.seeds.Interval` of lgc's reports is at 95 %."""
    if margin < 0:
        raise ValueError(f"margin must be >= 0, got {margin!r}")
    if gap is None or gap.half_width is None:
        return None
    if confidence != 0.95:
        half = _critical(gap.n, confidence) * (gap.sd or 0.0) / math.sqrt(gap.n)
        low, high = gap.mean - half, gap.mean + half
    else:
        low, high = gap.low, gap.high
    assert low is not None and high is not None
    if low >= -margin:
        return "within"
    if high < -margin:
        return "worse"
    return "inconclusive"


def _check(sd: float, n: int) -> None:
    if not (sd > 0 and math.isfinite(sd)):
        raise ValueError(f"sd must be a positive finite spread, got {sd!r}")
    if n < 2:
        raise ValueError(f"n must be at least 2 seeds, got {n!r}")


def worse_probability(loss: float, sd: float, n: int, margin: float, confidence: float = 0.95) -> float:
    """Probability that a method whose true gap is ``-loss`` is marked ``worse`` (paired spread ``sd``, n seeds)."""
    from scipy.stats import nct

    _check(sd, n)
    return float(nct.sf(_critical(n, confidence), n - 1, (loss - margin) * math.sqrt(n) / sd))


def within_probability(gap: float, sd: float, n: int, margin: float, confidence: float = 0.95) -> float:
    """Probability that a method whose true gap is ``gap`` (0: as good as the reference) is marked ``within``."""
    from scipy.stats import nct

    _check(sd, n)
    return float(nct.sf(_critical(n, confidence), n - 1, (gap + margin) * math.sqrt(n) / sd))


def detectable_loss(sd: float, n: int, margin: float, power: float = 0.8, confidence: float = 0.95) -> float:
    """The smallest true loss that is marked ``worse`` with probability ``power``."""
    from scipy.optimize import brentq

    _check(sd, n)
    if not 0 < power < 1:
        raise ValueError(f"power must be in (0, 1), got {power!r}")
    upper = margin + sd * 50
    return float(brentq(lambda loss: worse_probability(loss, sd, n, margin, confidence) - power, margin, upper))

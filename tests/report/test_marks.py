"""The three marks and the detectable loss, against their definitions and a simulation."""

import numpy as np
import pytest

from lgc.report.marks import detectable_loss, mark, within_probability, worse_probability
from lgc.report.seeds import Interval


@pytest.mark.parametrize(
    ("gaps", "expected"),
    [
        ([0.1, -0.2, 0.3, 0.0, -0.1], "within"),  # interval about [-0.24, 0.28]
        ([-2.0, -2.5, -1.8, -2.2, -2.1], "worse"),  # wholly below -1
        ([-1.0, 0.5, -2.5, 0.0, -1.5], "inconclusive"),  # straddles -1
        ([-0.5, -1.5, -0.8, -1.2, -1.0], "inconclusive"),
    ],
)
def test_marks_follow_the_interval_against_the_margin(gaps, expected):
    gap = Interval.of(gaps)
    assert mark(gap, margin=1.0) == expected
    low, high = gap.low, gap.high
    assert (expected == "within") == (low >= -1) and (expected == "worse") == (high < -1)


def test_no_interval_no_mark_and_a_negative_margin_is_refused():
    assert mark(Interval.of([0.3]), 1.0) is None and mark(None, 1.0) is None
    with pytest.raises(ValueError, match="margin must be >= 0, got -1"):
        mark(Interval.of([0.0, 1.0]), -1)


def test_probabilities_match_a_simulation_of_the_marks():
    # The marks' rule, vectorised over many simulated 5-seed cells (mark() itself is tested above).
    from scipy.stats import t

    rng = np.random.default_rng(0)
    sd, n, margin, trials = 0.8, 5, 1.0, 40000
    half = t.ppf(0.975, n - 1) / np.sqrt(n)
    for true_gap in (0.0, -1.0, -2.5):
        draws = rng.normal(true_gap, sd, size=(trials, n))
        mean, spread = draws.mean(axis=1), draws.std(axis=1, ddof=1)
        within = np.mean(mean - half * spread >= -margin)
        worse = np.mean(mean + half * spread < -margin)
        assert within == pytest.approx(within_probability(true_gap, sd, n, margin), abs=0.01)
        assert worse == pytest.approx(worse_probability(-true_gap, sd, n, margin), abs=0.01)
    # The vectorised rule is mark()'s on a few of the draws.
    for row in rng.normal(-1.0, sd, size=(20, n)):
        gap = Interval.of(list(row))
        expected = "within" if gap.low >= -margin else "worse" if gap.high < -margin else "inconclusive"
        assert mark(gap, margin) == expected


def test_the_detectable_loss_is_where_the_power_is_reached():
    loss = detectable_loss(0.8, 5, 1.0, power=0.8)
    assert worse_probability(loss, 0.8, 5, 1.0) == pytest.approx(0.8, abs=1e-6)
    # Beyond the margin by more than the interval's half-width, and growing with the spread.
    assert loss > 1.0 + 2.776 * 0.8 / np.sqrt(5)
    assert detectable_loss(1.6, 5, 1.0) > loss > detectable_loss(0.4, 5, 1.0)
    # A method as good as the reference is marked within 56 % of the time at a spread of 0.8 points (5 seeds).
    assert within_probability(0.0, 0.8, 5, 1.0) == pytest.approx(0.562, abs=0.001)
    with pytest.raises(ValueError, match="sd must be a positive finite spread"):
        detectable_loss(0.0, 5, 1.0)

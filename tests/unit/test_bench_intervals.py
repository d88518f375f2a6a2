"""bench/pipeline_bench.py's claims against the on-policy bound: paired by round, with a 95% interval, and called a
gain only when the whole interval lies below zero. Made-up numbers; nothing here is timed."""

import math

import pytest

from bench.pipeline_bench import Interval, paired_difference, t_interval, verdict


def test_t_interval_matches_a_hand_computed_one():
    # mean 2, sample sd 1, 3 values: half-width t(2) * 1 / sqrt(3) = 4.303 / 1.732
    interval = t_interval([1.0, 2.0, 3.0])
    assert interval.estimate == pytest.approx(2.0)
    assert interval.high - interval.estimate == pytest.approx(4.303 / math.sqrt(3))
    assert interval.estimate - interval.low == pytest.approx(4.303 / math.sqrt(3))


def test_paired_difference_is_the_geometric_mean_of_the_ratios_minus_one():
    difference = paired_difference([0.8, 0.9, 0.85])
    assert difference.estimate == pytest.approx((0.8 * 0.9 * 0.85) ** (1 / 3) - 1)
    assert difference.low < difference.estimate < difference.high


def test_a_mean_below_the_bound_is_not_a_gain_when_its_interval_crosses_zero():
    # on average 10% under the bound, but one round of three lands above it: the interval crosses zero
    noisy = paired_difference([0.7, 0.95, 1.05])
    assert noisy.estimate < 0 < noisy.high
    assert verdict(noisy) == "within noise"


def test_a_difference_is_a_gain_only_when_the_whole_interval_is_below_zero():
    steady = paired_difference([0.74, 0.76, 0.75, 0.77])
    assert steady.high < 0
    assert verdict(steady) == "beats the bound"
    assert verdict(paired_difference([1.2, 1.25, 1.22])) == "above the bound"
    assert verdict(Interval(estimate=-0.2, low=-0.4, high=0.0)) == "within noise"


def test_one_round_says_nothing():
    only = paired_difference([0.5])
    assert only.low == -1.0 and only.high == math.inf
    assert verdict(only) == "within noise"


def test_drift_between_rounds_cancels_in_the_pairing():
    # the machine is 40% slower in round 2; the mode stays 20% under its own round's bound
    bounds = [1.0, 1.4, 1.0]
    steps = [0.8 * b for b in bounds]
    difference = paired_difference([s / b for s, b in zip(steps, bounds)])
    assert difference.estimate == pytest.approx(-0.2)
    assert verdict(difference) == "beats the bound"

"""The benchmarks' confidence interval for a paired median (``benchmarks/train_steps.py``): the order statistics
the binomial law gives, and its coverage on skewed noise with a known median."""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from train_steps import median_interval


def test_the_order_statistics_of_the_textbook_interval() -> None:
    # n = 100: the 40th and 61st values (1-based) cover the median with 96.5%; the 41st and 60th only with 94.3%
    assert median_interval([float(i) for i in range(100)]) == (39.0, 60.0)
    # n = 6: only the extremes, covering 1 - 2/64 = 96.9%; n = 5: the extremes cover 93.75%, below 95%
    assert median_interval([3.0, 1.0, 2.0, 6.0, 5.0, 4.0]) == (1.0, 6.0)
    assert median_interval([1.0, 2.0, 3.0, 4.0, 5.0]) is None
    assert median_interval([1.0, 2.0, 3.0, 4.0, 5.0], level=0.9) == (1.0, 5.0)


def test_coverage_on_skewed_noise() -> None:
    """Step ratios are skewed (a step slowed by the machine is slower by more than one sped up is faster):
    lognormal draws around a known median of 1.02. In law at least 95% of the intervals hold it (96.2% at n = 40);
    2,000 trials are asserted at 94%, below that by more than three of their binomial standard deviations."""
    rng = random.Random(0)
    trials, held = 2000, 0
    for _ in range(trials):
        values = [1.02 * rng.lognormvariate(0.0, 0.05) for _ in range(40)]
        low, high = median_interval(values)
        held += low <= 1.02 <= high
    assert held / trials >= 0.94, held / trials

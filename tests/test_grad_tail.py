"""benchmarks/grad_tail.py's tail bar against the exponential distribution's own quantile."""

import math
import random

from benchmarks.grad_tail import MIN_FIT, P, tail_bar


def test_the_tail_bar_is_the_exponential_quantile_it_is_sized_for():
    # Exp(1): P(X > x) = exp(-x), so the level passed with probability P is -ln(P)
    rng = random.Random(0)
    sample = sorted(rng.expovariate(1.0) for _ in range(50_000))
    assert abs(tail_bar(sample) - (-math.log(P))) < 0.1
    # scale and shift carry through: 2 X + 1 passes 1 - 2 ln(P) with probability P
    assert abs(tail_bar([2 * v + 1 for v in sample]) - (1 - 2 * math.log(P))) < 0.2


def test_the_tail_bar_waits_for_enough_history():
    assert tail_bar([0.1] * (MIN_FIT - 1)) == -math.inf
    assert tail_bar([0.1] * MIN_FIT) == 0.1  # nothing above the 90th percentile: the level itself

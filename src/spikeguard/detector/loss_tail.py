"""The loss rules' bar from the run's own tail (host floats; the device twin is in ``gate.py``).

The loss-outlier rule's bar, 6 robust spreads above the loss's short median, assumes a batch's
loss is nearly Gaussian about its level: a language model averages thousands of token losses a
batch, and no clean run of the detection matrix or the zoo stood 6 spreads out more than 0.23
times per 1,000 steps. A loss that averages a few dozen heavy-tailed example losses does not
behave so: a classifier on noisy labels (a batch of 32 holds 0-8 mislabelled examples at 3-5
nats each), a CNN once most examples are fitted (a batch with one hard example stands 15x the
median), a regression with heavy-tailed targets. There a healthy run stood past the bar 5-68
times per 1,000 steps, and past loss / EMA = 2 12-48 times: skipped batches, Tier 2 pages for a
skip storm, and held-out losses up to 2.3% worse than the same run unguarded.

So the rules measure the tail they judge against. Each armed step's excursion r = (loss -
median) / spread (the loss rule's own median and spread, before the step) is a sample of it;
the excursions past ``loss_tail_from`` spreads (u) are the tail's. An exponential tail above u
(the peaks-over-threshold model) with rate a (the share of steps past u) and scale beta (their
mean excess over u) puts the 1-in-1/p excursion at

    z_p = u + beta x ln(a / p),       p = ``loss_tail_rate``

and the loss rule's bar becomes max(``loss_z``, z_p) spreads: a run whose tail is as light as
the 6-spread bar assumes keeps that bar (a Gaussian's z_p at p = 1e-4 is 3.9), a heavy one
gets the bar its own tail sets, with p as its stated false-alarm rate.

An exponential tail cannot follow a power law: a regression whose targets carry Student-t
noise with 2 degrees of freedom averages squared residuals with no mean, and its batch loss
stood 50-700 spreads out on healthy steps, far past any exponential z_p. So the same steps also
fit a Pareto tail about the loss's zero (the Hill estimator): b, the mean of ln(loss / x_u)
over the steps past x_u = median + u x spread, puts the 1-in-1/p loss at x_u (a / p)^b, which
is

    z_p' = u + (median / spread + u) x (exp(b ln(a / p)) - 1)   spreads,

where the Pareto tail explains the excursions decisively better than the exponential one.
Both have one parameter, so their maximised likelihoods on the m excursions compare directly:
the log of their ratio is m (ln(beta / ((median / spread + u) b)) - b), and the Pareto tail is
taken where that passes ln(1/p), a likelihood 1/p times the exponential's. The bar is then
max(``loss_z``, z_p, z_p'): the Pareto fit only ever widens it. On the recorded runs that
ratio's log reached 24-126 on every Student-t(2) regression and at most 6.8 on any other loss
(language models, a noisy classifier, a CNN, a denoiser); taken wherever it was merely
positive, the Pareto fit moved the bar on 10 of 278 language-model runs, and a chaotic natural
instability's page by a step past its departure. Where the spread is small beside the level (a
language model's loss, a few hundredths of a nat about 2-4) ln(loss / x_u) is (loss - x_u) / x_u
to first order and z_p' is z_p; the two part only where the loss's own noise is of the order of
its level. A loss whose x_u is not positive (a loss
that can be negative) has no Pareto fit: those steps add nothing to its sums.

The loss / EMA rules (skip past ``skip_ratio``, alert past ``alert_ratio``) also need the loss
past that many spreads above its median: a doubled loss is far out for a language model (there
it always was) and ordinary for a noisy classifier, whose first excursions, before any fit,
stand 3-4 spreads out.

The sums are cumulative over armed steps and halve every ``loss_tail_window`` of them, so old
steps fade. A step flagged by a rule counts too, its excursion capped at the bar (its tail is
censored there, and a heavy tail shows as steps piling up at the bar); a step past
``loss_tail_far`` times the bar counts not at all: a garbage batch is not the run's noise, and a
storm of them must not widen the bar for the next. The fit waits for ``loss_tail_min``
excursions past u. The work is a comparison a step, and a division and a log on a step past
u.
"""

from __future__ import annotations

import math
from typing import Any

from .config import DetectorConfig

__all__ = ["LossTail"]

_EXP_MAX = 700.0
"""The Pareto quantile's exponent is capped here (math.exp overflows a float past about 709)."""


class LossTail:
    """The loss excursions' tail (module docstring): ``bar`` is the loss rule's bar in spreads;
    ``add`` takes an armed step's loss. The bar is refitted only on a step past u or a halving
    (the work of a step is then one comparison)."""

    __slots__ = ("bar", "c", "count", "exceed", "excess", "far", "held", "lexceed", "lexcess",
                 "u", "window")

    def __init__(self, c: DetectorConfig) -> None:
        self.c = c
        self.u = c.loss_tail_from if c.loss_tail_rate else math.inf  # off: nothing is past it
        self.far, self.window = c.loss_tail_far, c.loss_tail_window
        self.exceed = self.excess = 0.0
        """Steps past ``loss_tail_from``, their summed excess (halved every ``loss_tail_window``
        counted steps)."""
        self.lexceed = self.lexcess = 0.0
        """The steps past u with x_u > 0, their summed ln(loss / x_u) (the Pareto fit; halved
        with the others)."""
        self.held = 0.0
        """The counted steps before the last halving, halved at each (``n``)."""
        self.count = 0
        """Steps counted, never halved (it times the halving)."""
        self.bar = c.loss_z
        """The loss rule's bar in spreads above the median: max(loss_z, z_p)."""

    @property
    def n(self) -> float:
        """Steps counted, halved every ``loss_tail_window`` (exact: halves of small ints)."""
        return self.held + self.count % self.window

    def quantile(self, level: float, spread: float) -> float | None:
        """The fitted 1-in-1/p excursion in spreads, at ``level`` and ``spread``: the exponential
        tail's z_p, or the Pareto tail's z_p' where that fits the excursions decisively better
        and is larger (module docstring); None while off or with fewer than ``loss_tail_min``
        excursions past u (u itself where their rate is at or below p)."""
        c = self.c
        if c.loss_tail_rate == 0 or self.exceed < c.loss_tail_min:
            return None
        rate = self.exceed / self.n
        if not rate > c.loss_tail_rate:
            return c.loss_tail_from
        u, k = c.loss_tail_from, math.log(rate / c.loss_tail_rate)
        zp = u + self.excess / self.exceed * k
        if self.lexceed >= c.loss_tail_min and level + u * spread > 0.0:
            b, scale = self.lexcess / self.lexceed, level / spread + u
            # the Pareto tail where its likelihood is 1/p times the exponential's and it puts
            # the bar further out
            if b > 0.0 and self.lexceed * (math.log(self.excess / self.exceed / (scale * b))
                                           - b) > -math.log(c.loss_tail_rate):
                # the exponent capped where exp would overflow: a bar past any float loss
                zp = max(zp, u + scale * math.expm1(min(b * k, _EXP_MAX)))
        return zp

    def add(self, loss: float, level: float, spread: float) -> None:
        """Count an armed step's ``loss`` against the ``level`` and ``spread`` it was judged
        against (and ``bar``, which judged it). ``LossSpike.update`` inlines the common case: a
        step not past u and not at a halving only adds to ``count``."""
        if not spread > 0.0:
            return
        self.count += 1
        self.after(loss, level, spread)

    def after(self, loss: float, level: float, spread: float) -> None:
        """``add`` once ``count`` has taken the step (``spread`` > 0)."""
        u = self.u
        base = level + u * spread  # x_u
        past = loss > base
        if past:
            bar = self.bar
            if loss > level + self.far * bar * spread:  # not the run's noise: not counted
                self.count -= 1
                return
            self.exceed += 1.0
            self.excess += min((loss - level) / spread, bar) - u
            if base > 0.0:
                self.lexceed += 1.0
                self.lexcess += math.log(min(loss, level + bar * spread) / base)
        half = self.count % self.window == 0
        if half:
            self.held = 0.5 * (self.held + self.window)
            self.exceed *= 0.5
            self.excess *= 0.5
            self.lexceed *= 0.5
            self.lexcess *= 0.5
        if past or half:
            zp = self.quantile(level, spread)
            self.bar = self.c.loss_z if zp is None else max(self.c.loss_z, zp)

    def state_dict(self) -> dict[str, Any]:
        return {"held": self.held, "exceed": self.exceed, "excess": self.excess,
                "count": self.count, "bar": self.bar, "lexceed": self.lexceed,
                "lexcess": self.lexcess}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.held, self.exceed = float(state["held"]), float(state["exceed"])
        self.excess, self.count = float(state["excess"]), int(state["count"])
        self.bar = float(state["bar"])
        self.lexceed, self.lexcess = float(state["lexceed"]), float(state["lexcess"])

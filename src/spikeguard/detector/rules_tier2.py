"""The detector's Tier 2 rules (an ALERT in the verdict; the caller's policy picks the response).

Tier 2 rules are events: each fires once, at the update where its condition starts to hold, not
on every step while it holds; a latch re-arms it once the condition has cleared. The conventions
(events, ``keep``, the ``kept`` argument, state dicts) are those of ``rules.py``. The log Z
rules are in ``rules_log_z.py``.
"""

from __future__ import annotations

import math
from typing import Any

from ..measure.stats import EMA, EventWindow, RunningMedian, SlidingMin
from .config import DetectorConfig
from .rules import Event, Rule, StepInput

__all__ = ["LossElevated", "RatioHeld", "Recovery", "SkipStorm", "UpdateJump"]

_isfinite = math.isfinite
_nan = math.nan


class RatioHeld(Rule):
    """loss_ema_ratio above tier2_ratio for tier2_ratio_steps consecutive armed updates: the
    loss has jumped to a new level and stayed there, which skipping step by step cannot fix.
    Dated by the start of the run of ratios above alert_ratio (``LossRatio.onset``)."""

    __slots__ = ("above", "count", "reason", "steps")
    _scalars = ("count",)
    phase = "judge"

    def __init__(self, c: DetectorConfig) -> None:
        self.above = c.tier2_ratio
        self.steps = c.tier2_ratio_steps
        self.count = 0
        self.reason = f"loss_ema_ratio > {c.tier2_ratio:g} for {c.tier2_ratio_steps} steps"

    def update(self, x: StepInput) -> Event | None:
        if not x.armed:
            return None
        if x.ratio > self.above:
            self.count += 1
            # `==`, not `>=`: the event fires once per run
            if self.count == self.steps:
                return (x.ratio_onset, self.reason)
        else:
            self.count = 0
        return None


class SkipStorm(Rule):
    """A storm: more than max_consecutive_skips Tier 1 flags in a row, or more than
    max_skip_fraction of the last skip_window updates skipped. Each skip alone is harmless; many
    in a row on healthy weights mean the data has gone bad; flags in a row whose updates went
    through (``x.released``: the weights were at fault) with the loss up as well (a loss rule
    flagged them) mean the weights are not recovering by themselves. Either way the run needs
    Tier 2, not more of Tier 1. A released flag on the grad norm alone neither counts nor ends
    the run: a gradient spike at an ordinary loss is what the clipped update is repairing (near
    the end of warmup six such steps in a row, 11-160x the median, healed by themselves). A
    blind release (``x.blind``: no batch to test the weights with) counts as a skip would.

    Only Tier 1 flags count (never fp16 overflows, which the GradScaler handles); the fraction
    rule counts only skips, and is dated by the oldest skip still in the window.

    Twice damaged: a second flag within ``loss_window`` updates that the weights check found the
    weights at fault for (released, not blind) with the loss up (a loss rule flagged it) is
    Tier 2 at once, dated at the first: an old, healthy batch fails under these weights, the
    loss is up, and it happened again, which no run of fresh outliers does. The zoo's output-logit
    proxy (tiny, no z-loss, LR 1.0, seed 2) had two such flags at steps 92 and 93 and a
    third at 99, where its unguarded loss departed from its trend; the skip-storm run needs six
    in a row and the log Z rules fired only at 108. None of 41 clean zoo runs scanned (17
    settings, seeds 0 and 2, and 7 of seed 1) had even one flag the weights check blamed on the
    weights.
    """

    __slots__ = ("calm", "count", "frac_reason", "latched", "limit", "max_run", "need",
                 "released", "run", "run_onset", "run_reason", "span", "suspect", "twice_reason",
                 "weights_at", "weights_latched", "weights_reason", "window")
    _scalars = ("run", "run_onset", "latched", "released", "suspect", "calm", "weights_at",
                "weights_latched")
    _stats = ("window",)
    phase = "judge"

    def __init__(self, c: DetectorConfig) -> None:
        self.max_run = c.max_consecutive_skips
        self.need = c.arm_quiet
        self.suspect = False
        """A storm made the weights the suspect: the detector, left to decide (``released``
        None), recommends no more skips until ``calm`` reaches arm_quiet."""
        self.calm = 0
        """Unflagged updates in a row while ``suspect``."""
        self.limit = c.max_skip_fraction * c.skip_window
        self.window = EventWindow(c.skip_window)
        self.run = 0
        self.run_onset: int | None = None
        self.latched = False
        self.count = 0
        """Skips among the last skip_window updates, this one included."""
        self.released = 0
        """Flags of the current run whose updates went through."""
        self.run_reason = f"skips > {c.max_consecutive_skips} consecutive"
        self.weights_reason = (f"flagged > {c.max_consecutive_skips} consecutive, the weights "
                               "at fault")
        self.frac_reason = f"skips > {c.max_skip_fraction:.0%} of last {c.skip_window}"
        self.span = c.loss_window
        self.weights_at: list[int] | None = None
        """[update index, step] of the last flag the weights check blamed on the weights, with
        the loss up (None: none yet)."""
        self.weights_latched = False
        """The twice-damaged event fired for the current cluster of such flags."""
        self.twice_reason = (f"the weights at fault twice within {c.loss_window} steps, the "
                             "loss up (an old batch fails under them)")

    def update(self, x: StepInput) -> list[Event] | None:
        step, i, flag = x.step, x.i, x.skip
        skip = flag and not x.released
        events = None
        if flag:
            self.calm = 0
        elif self.suspect:
            self.calm += 1
            if self.calm >= self.need:  # in control again: skips may repair batches again
                self.suspect, self.calm = False, 0
        if flag and (skip or x.loss_flag or x.blind):
            if self.run == 0:
                self.run_onset, self.released = step, 0
            self.run += 1
            self.released += x.released
            if skip:
                self.window.add(i, step)
            if self.run == self.max_run + 1:
                reason = self.weights_reason if self.released else self.run_reason
                events = [(self.run_onset, reason)]
            if self.run > self.max_run:  # from the storm's Tier 2 on
                self.suspect = True
        elif not flag:
            self.run = 0
        if flag and x.released and x.loss_flag and not x.blind:
            events = self._damaged(i, step, events)
        window = self.window
        # the count only grows by a skip (added above): while it is 0 and this step adds
        # none, it stays 0 without a look at the window
        n = self.count = window.count(i) if skip or self.count else 0
        if n > self.limit:
            # fire on a skip only: the step that tips the window over is the one to act on
            if skip and not self.latched:
                event = (window.first_step(), self.frac_reason)
                events = [event] if events is None else [*events, event]
                self.latched = True
        elif n <= self.limit / 2:
            # hysteresis: a window that hovers at the limit (old skips leaving as new ones come)
            # would fire again and again; re-arm only once the skips have clearly thinned out
            self.latched = False
        return events

    def _damaged(self, i: int, step: int, events: list[Event] | None) -> list[Event] | None:
        """A flag the weights check blamed on the weights, the loss up: the second within
        ``span`` updates of the one before is the twice-damaged event (once per cluster)."""
        last = self.weights_at
        if last is not None and i - last[0] <= self.span:
            if not self.weights_latched:
                self.weights_latched = True
                event = (last[1], self.twice_reason)
                events = [event] if events is None else [*events, event]
        else:
            self.weights_latched = False
        self.weights_at = [i, step]
        return events

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # a state saved before the twice-damaged event: no such flag on record
        super().load_state_dict({"weights_at": None, "weights_latched": False, **state})
        self.count = len(self.window)  # at most the count: the next update looks at the window


class LossElevated(Rule):
    """The short loss EMA (span recovery_ema_steps) more than spike_nats above its pre-spike
    level for more than elevated_steps consecutive updates: a slow excursion that no single step
    flags.

    The pre-spike level is the floor: the minimum of the short EMA over the last median_window
    kept updates. An excursion starts (and is dated) where the short EMA rises loss_onset_nats
    above the floor, and ends when it falls back within loss_onset_nats of that level. Measuring
    against the floor rather than a long EMA matters: a long EMA follows a slow climb and would
    never see it as elevated.

    Both levels are in nats, and a short EMA of a noisy loss wanders by more: its standard error
    is the loss's spread / sqrt(2 span - 1), and a regression on Student-t(2) noise (spread
    0.5-1.5 nats) held its EMA 0.2-0.9 nats above the floor for 250 healthy steps. So both are
    raised in proportion until spike_nats is ``elevated_z`` such errors (the loss rule's spread
    before each step, ``x.loss_noise``; the scale is fixed at an excursion's onset, as its floor
    is). A language model's spread of a few hundredths of a nat keeps 0.1.
    """

    __slots__ = ("context", "count", "ema", "err", "floor", "onset", "onset_nats", "pre",
                 "reason", "scale", "short", "spike_nats", "steps")
    _scalars = ("onset", "pre", "count", "scale")
    _stats = ("ema", "floor")

    def __init__(self, c: DetectorConfig) -> None:
        self.ema = EMA(1.0 / c.recovery_ema_steps)
        self.floor = SlidingMin(c.median_window)
        self.onset_nats = c.loss_onset_nats
        self.spike_nats = c.spike_nats
        self.steps = c.elevated_steps
        # spike_nats in the EMA's standard errors per unit of the loss's spread
        self.err = c.elevated_z / math.sqrt(2 * c.recovery_ema_steps - 1) / c.spike_nats
        self.onset: int | None = None
        self.pre = 0.0
        self.count = 0
        self.scale = 1.0
        """The levels' multiple, >= 1 (the class docstring): the current excursion's, fixed at
        its onset."""
        self.short = _nan
        """The short loss EMA after this update (this step's loss in it when kept)."""
        self.reason = f"loss +{c.spike_nats:g} nats for > {c.elevated_steps} steps"
        self.context = f"loss +{c.loss_onset_nats:g} nats above its floor"

    def update(self, x: StepInput) -> Event | None:
        """``x.j``: the index of this update among the kept ones (the floor's window counts
        them). Publishes ``x.short``."""
        step, loss, j, armed = x.step, x.loss, x.j, x.armed
        if self.onset is None:  # no excursion: the levels follow the loss's noise
            scale = self.err * x.loss_noise
            self.scale = scale if scale > 1.0 else 1.0  # NaN (no spread yet): 1
        onset_nats, spike_nats = self.onset_nats * self.scale, self.spike_nats * self.scale
        if x.kept:
            self.ema.update(loss)
            short = x.short = self.short = self.ema.value
            floor, _ = self.floor.min_before(j)
            self.floor.push(j, short, step)
            # an excursion starts on a kept step only: a flagged step is another rule's business
            if armed and self.onset is None and short > floor + onset_nats:
                self.onset, self.pre, self.count = step, floor, 0
        else:
            short = x.short = self.short = self.ema.value
        if self.onset is None:
            return None
        if short <= self.pre + onset_nats:
            self.onset, self.count = None, 0
        elif short > self.pre + spike_nats:
            self.count += 1
            if self.count == self.steps + 1:
                return (self.onset, self.reason)
        else:
            # between the onset and the spike level: still the same excursion (its onset is
            # kept), but the count of spike-level updates must be consecutive
            self.count = 0
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # a state saved before the levels followed the noise: the fixed nats
        super().load_state_dict({"scale": 1.0, **state})


class Recovery(Rule):
    """A Tier 1 skip must recover: within recovery_steps updates the short loss EMA must come back
    below max(the spike's loss, pre-spike short EMA + spike_nats), else Tier 2.

    Skipping throws one batch away; if the loss keeps climbing afterwards, the damage was done
    before the skip (or the data itself has changed) and a rollback is needed. Recovery is judged
    only after min(recovery_ema_steps, recovery_steps) updates: right after a skip the short EMA
    still holds the pre-spike level and would call every spike recovered. The threshold takes the
    larger of the two levels so that a low-loss outlier (a batch of repeated bytes) is not held to
    its own loss. Further skips while one is pending raise the threshold to their loss.
    """

    __slots__ = ("pending", "reason", "spike_nats", "steps", "wait")
    _scalars = ("pending",)

    def __init__(self, c: DetectorConfig) -> None:
        self.spike_nats = c.spike_nats
        self.wait = min(c.recovery_ema_steps, c.recovery_steps)
        self.steps = c.recovery_steps
        self.pending: list[float] | None = None
        """[onset, update index of the skip, pre-spike short EMA, threshold], or None."""
        self.reason = f"loss not recovered within {c.recovery_steps} steps"

    def update(self, x: StepInput) -> Event | None:
        p = self.pending
        skip = x.skip
        if not skip and p is None:  # nothing to judge
            return None
        i, onset, loss, short = x.i, x.t1_onset, x.loss, x.short
        if skip:
            if p is None:
                self.pending = [onset, i, short, max(loss, short + self.spike_nats)]
            else:
                p[3] = max(p[3], loss)
            return None
        if p is None:
            return None
        progress = i - p[1]
        if progress >= self.wait and short < p[3]:
            self.pending = None
        elif progress >= self.steps:
            self.pending = None
            return (int(p[0]), self.reason)
        return None

    def state_dict(self) -> dict:
        # a copy: the list is mutated in place while a spike is pending
        return {"pending": None if self.pending is None else list(self.pending)}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if self.pending is not None:
            self.pending = list(self.pending)


class UpdateJump(Rule):
    """The update ratio past update_jump x its running median (update_window readings): the
    update just applied moved the weights many times more than the run's updates do, so the
    learning rate or the optimizer's state is wrong, and the loss has not moved yet (under Adam
    a gradient spike barely changes the update; a 50x LR moves it 50x). Dated at this step, the
    update at fault. A reading past the bar stays out of the median; the rule fires once per
    excursion and re-arms when a reading is back under the bar. Silent without readings (the
    signals off) and on a skipped step (it reads 0)."""

    __slots__ = ("jump", "latched", "median", "need", "reason")
    _scalars = ("latched",)
    _stats = ("median",)

    def __init__(self, c: DetectorConfig) -> None:
        self.jump = c.update_jump
        self.median = RunningMedian(c.update_window)
        self.need = max(1, c.update_window // 2)
        self.latched = False
        self.reason = f"update_ratio > {c.update_jump:g}x median"

    def update(self, x: StepInput) -> Event | None:
        r = x.update_ratio
        if not self.jump or not (r > 0.0 and r < math.inf):  # NaN, a skip's 0, no reading
            return None
        median = self.median
        if x.armed and len(median) >= self.need and r > self.jump * median.value:
            if self.latched:
                return None
            self.latched = True
            return (x.step, self.reason)
        self.latched = False
        median.update(r)
        return None

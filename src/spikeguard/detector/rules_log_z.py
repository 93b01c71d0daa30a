"""The detector's Tier 2 rules on log Z, the mean log-partition of the output logits.

Logits that grow without bound end in a loss spike (PaLM's output z-loss exists to hold log Z
near 0); log Z shows the growth before the loss does. Three views of it, each an event of the
conventions in ``rules_tier2.py``: a drift above its running median over the run
(``LogZDrift``), a rise within a few hundred updates (``LogZRise``), and a jump above its median
of the last few dozen updates (``LogZJump``).
"""

from __future__ import annotations

import math
from typing import Any

from ..measure.stats import RunningMedian, SlidingMin
from .config import DetectorConfig
from .rules import Event, Rule, StepInput, quiet_arm

__all__ = ["LogZDrift", "LogZJump", "LogZRise"]

_isfinite = math.isfinite
_nan = math.nan


class LogZDrift(Rule):
    """log Z (the mean log-partition of the output logits) more than log_z_drift above its running
    median over the kept updates.

    A drift slower than log_z_rise per log_z_rise_steps never trips ``LogZRise`` (a climb of +2
    per 300 updates, say), yet carries log Z many nats above where it was: the logits are growing
    without bound, which ends in a loss spike. An excursion starts (and is dated) where log Z
    stands log_z_onset above the median; it also sets ``advice`` (add or raise the z-loss of PaLM,
    which pulls log Z back to 0) when log Z is above z_loss_advice_log_z. A missing (None/NaN)
    log Z leaves the rule and its history untouched.
    """

    __slots__ = ("advice", "advice_at", "arm", "context", "drift", "fired", "med", "median",
                 "need", "on", "onset", "onset_dev", "quiet", "reason")
    _scalars = ("onset", "fired", "quiet", "on")
    _stats = ("median",)

    def __init__(self, c: DetectorConfig) -> None:
        self.arm = c.grad_arm_after
        self.need, self.quiet, self.on = c.arm_quiet, 0, False
        self.median = RunningMedian(c.median_window)
        self.onset_dev = c.log_z_onset
        self.drift = c.log_z_drift
        self.advice_at = c.z_loss_advice_log_z
        self.onset: int | None = None
        self.fired = False
        self.med = _nan
        """The median this step was judged against."""
        self.advice = False
        """This update advises a z-loss."""
        self.reason = f"log_z > median + {c.log_z_drift:g}"
        self.context = f"log_z > median + {c.log_z_onset:g}"

    def update(self, x: StepInput) -> Event | None:
        """Publishes ``x.log_z_onset``."""
        step, lz, armed = x.step, x.log_z, x.armed
        med = self.med = self.median.value
        self.advice = False
        if not _isfinite(lz):
            x.log_z_onset = self.onset
            return None
        dev = lz - med
        if dev > self.onset_dev:
            if self.onset is None:
                self.onset = step
        else:
            self.onset = None
            self.fired = False
        event = None
        if self.on:
            if dev > self.drift and not self.fired:
                event = (self.onset, self.reason)
                self.fired = True
            self.advice = lz > self.advice_at and dev > self.onset_dev
        elif armed and x.j >= self.arm and dev == dev:
            self.quiet, self.on = quiet_arm(self.quiet, self.need, dev > self.drift)
        if x.kept:
            self.median.update(lz)
        x.log_z_onset = self.onset
        return event


class LogZRise(Rule):
    """log Z more than log_z_rise above its minimum over the last log_z_rise_steps kept updates.

    Dated by the log Z excursion (``LogZDrift.onset``) when one is open, else by the step of that
    minimum. Once fired it stays quiet until the excursion has ended: a ramp that keeps climbing
    would otherwise fire again each time the window slides past its foot.
    """

    __slots__ = ("arm", "fired", "limit", "need", "on", "quiet", "reason", "rise", "window")
    _scalars = ("fired", "quiet", "on")
    _stats = ("window",)

    def __init__(self, c: DetectorConfig) -> None:
        self.arm = c.grad_arm_after
        # in control over its whole window: a rise still building up stays inside the bar
        self.need, self.quiet, self.on = max(c.arm_quiet, c.log_z_rise_steps), 0, False
        self.window = SlidingMin(c.log_z_rise_steps)
        self.limit = c.log_z_rise
        self.fired = False
        self.rise = _nan
        """log Z minus the window's minimum at this update; NaN without a log Z."""
        self.reason = f"log_z +{c.log_z_rise:g} within {c.log_z_rise_steps} steps"

    def update(self, x: StepInput) -> Event | None:
        step, lz, j, armed, onset = x.step, x.log_z, x.j, x.armed, x.log_z_onset
        if not _isfinite(lz):
            self.rise = _nan
            return None
        low, low_step = self.window.min_before(j)
        rise = self.rise = lz - low
        event = None
        if self.on:
            if rise > self.limit:
                if not self.fired:
                    event = (onset if onset is not None else low_step, self.reason)
                    self.fired = True
            elif onset is None:
                self.fired = False
        elif armed and j >= self.arm and rise == rise:
            self.quiet, self.on = quiet_arm(self.quiet, self.need, rise > self.limit)
        if x.kept:
            self.window.push(j, lz, step)
        return event


class LogZJump(Rule):
    """log Z more than log_z_jump above the median of its last log_z_jump_window kept readings:
    the logits grew by a nat within a few dozen updates. A healthy run's log Z climbs as it
    trains (+0.3 to +1.4 over 300 steps on the small models), which a short median follows and
    the run-long one of ``LogZDrift`` does not; a logit drift of 0.05 a step crossed this bar
    7-14 updates in, before the loss had moved 2% (the +3 rules came 37-73 updates in), and no
    step of the clean benchmark matrix crossed it. Dated by the start of the excursion, where
    log Z first stood log_z_onset above that median; fires once per excursion, re-armed when
    log Z is back within log_z_onset of it. Waits for a full window, and arms with the grad rule
    (``grad_arm_after`` kept updates when the warmup is known): through the warmup log Z moves as
    fast as the grad norm does (the clean runs stood up to 0.92 above their median at step 32,
    at most 0.78 from step 40 on). Fires on an update past the bar when log_z_jump_run (1) of
    the last log_z_jump_run + 1 were past it (2: two of three, which waits out one batch of easy
    text: docs/design.md).

    A jump alone, with neither the grad norm past the joint test's grad bar (``x.grad_half``,
    half-way to the grad rule's noise-sized bar) nor a loss rule's flag at that update, must
    also pass the bar of the run's own healed excursions: the kept updates that stood more than
    log_z_onset (u) above the median, in excursions that have since come back near it, are
    an exponential tail with rate a (their share of the kept updates judged) and scale beta
    (their mean excess over u), and the bar is max(log_z_jump, u + beta ln(a / p)), p =
    log_z_jump_rate. An excursion is not the run's noise until log Z is back within
    log_z_jump_heal of its median: a swing comes back, a drift that hovers above it (its median
    following a little behind) does not, and never widens its own bar. The tail waits for
    log_z_jump_min such updates. A missing log Z leaves it untouched. 0: off."""

    __slots__ = (
        "above",
        "arm",
        "dev",
        "fired",
        "heal",
        "jump",
        "mask",
        "median",
        "need",
        "on",
        "onset",
        "onset_dev",
        "quiet",
        "rate",
        "reason",
        "run",
        "tail",
        "tail_min",
        "window",
    )
    _scalars = ("onset", "fired", "quiet", "on", "above", "tail")
    _stats = ("median",)

    def __init__(self, c: DetectorConfig) -> None:
        self.jump = c.log_z_jump
        self.arm = c.grad_arm_after
        self.need, self.quiet, self.on = c.arm_quiet, 0, False
        self.window = c.log_z_jump_window
        self.median = RunningMedian(c.log_z_jump_window)
        self.onset_dev = min(c.log_z_onset, c.log_z_jump)
        self.onset: int | None = None
        self.fired = False
        self.run = c.log_z_jump_run
        self.mask = (1 << (c.log_z_jump_run + 1)) - 1
        self.above = 0
        """Which of the last log_z_jump_run + 1 updates were past the bar (bit 0: this one)."""
        self.dev = _nan
        """log Z minus the short median at this update; NaN until the window is full."""
        self.rate, self.tail_min = c.log_z_jump_rate, c.log_z_jump_min
        self.heal = min(c.log_z_jump_heal, self.onset_dev)
        self.tail = [0, 0, 0.0, 0, 0.0]
        """[kept updates judged, those past onset_dev in healed excursions (back within heal of
        the median since), their summed excess over onset_dev, the same two for the excursion
        in progress]."""
        self.reason = f"log_z > median of last {c.log_z_jump_window} + {c.log_z_jump:g}"

    def update(self, x: StepInput) -> Event | None:
        lz = x.log_z
        if not self.jump or not _isfinite(lz):
            return None
        median = self.median
        dev = self.dev = lz - median.value if len(median) >= self.window else _nan
        if dev > self.onset_dev:
            if self.onset is None:
                self.onset = x.step
        else:
            self.onset = None
            self.fired = False
        event = None
        if self.on:
            past = dev > self.jump
            self.above = ((self.above << 1) | past) & self.mask
            if (past and self.above.bit_count() >= self.run and not self.fired
                    and (x.loss_flag or x.grad_norm > x.grad_half or dev > self._lone_bar())):
                self.fired = True
                event = (self.onset, self.reason)
        elif x.armed and x.j >= self.arm and dev == dev:
            self.quiet, self.on = quiet_arm(self.quiet, self.need, dev > self.jump)
        if x.kept:
            median.update(lz)
            if self.rate and dev == dev:
                # the tail (inline: a kept update's cost): past u the deviation joins the
                # excursion in progress; back within heal of the median it ends it, which then
                # counts
                tail = self.tail
                tail[0] += 1
                if dev > self.onset_dev:
                    tail[3] += 1
                    tail[4] += dev - self.onset_dev
                elif dev <= self.heal and tail[3]:
                    tail[1] += tail[3]
                    tail[2] += tail[4]
                    tail[3] = 0
                    tail[4] = 0.0
        return event

    def _lone_bar(self) -> float:
        """The bar of a jump with no second sign (the class docstring)."""
        judged, m, excess = self.tail[:3]
        if not self.rate or m < self.tail_min:
            return self.jump
        return max(self.jump, self.onset_dev + excess / m * math.log(m / judged / self.rate))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # a state saved before the tail: nothing on record, the bar is log_z_jump's
        super().load_state_dict({"tail": [0, 0, 0.0, 0, 0.0], **state})

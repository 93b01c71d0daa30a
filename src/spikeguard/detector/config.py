"""DetectorConfig: every threshold of the spike detector, one field each.

The defaults are sized for a long pretraining run: medians over 5,000 updates, a loss EMA over
1,000. ``DetectorConfig.for_run`` shrinks the windows (and the arming delay) for short runs. Why
each rule exists is written beside it, in ``rules.py``, ``rules_tier2.py`` and ``rules_log_z.py``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from .._validate import check_int, check_positive

__all__ = ["DetectorConfig"]

# windows that DetectorConfig.for_run shrinks to total_steps // 4 for short runs (skip_window
# is not among them: a tiny window makes one skip a storm)
_WINDOWS = ("median_window", "loss_ema_steps", "recovery_ema_steps", "recovery_steps",
            "elevated_steps", "log_z_rise_steps")

# for_run arms on no fewer kept updates than this for a run of 20 steps or more (a median and a
# spread of a handful of values, taken while the grad norm still falls, is no baseline: a
# 20-step run armed at step 5 skipped its last five steps), and on no fewer than 5 for shorter
# ones (a short log replayed by diagnose)
_MIN_ARM_AFTER = 10


@dataclass(kw_only=True, frozen=True)
class DetectorConfig:
    """Thresholds of :class:`~spikeguard.detector.detector.SpikeDetector`.

    Every window counts detector updates (steps that reached ``update``), not step indices, so a
    stream that starts at step 50,000, or a log with gaps, works the same. Windows of histories
    count only unflagged updates: a skipped step never enters a median or an EMA.
    """

    arm_after: int = 50
    """Rules other than Tier 3 and fp16 overflows stay off until this many unflagged updates."""
    grad_arm_after: int = 0
    """The grad-norm rule (not the loss rules) counts towards its arming only from this many
    unflagged updates on (where larger than arm_after): the LR warmup (``for_run``'s
    ``warmup_steps`` sets it), while the grad norm moves with the LR. It then turns on once
    ``arm_quiet`` judged updates in a row stayed inside its bar: as the LR reaches its peak,
    and for a few dozen updates after, the grad norm of a healthy run spikes 5-160x its median
    on batches that are fine (tiny model, peak LR 1e-3 to 1e-2: steps 15-62 for warmups of 10,
    20 and 40), and plain AdamW + clipping rides it out; each such spike restarts the count, so
    the rule waits them out whether or not the warmup is given (docs/design.md). Until the rule
    is on, a grad norm is skipped only with the loss past half its bar's rise and the grad norm
    past half its bar (the joint test, ``rules.joint_grad_bar``): such spikes come at an
    ordinary loss."""
    arm_quiet: int = 20
    """The grad-norm rule and the log Z rules turn on once this many judged updates in a row
    (after ``arm_after``; the grad rule also after ``grad_arm_after``) stayed inside their bar
    (the log Z rise rule: its whole window): the statistic is in control, whatever the warmup
    and the optimizer made of the first steps. Under SGD with momentum log Z climbs 2-3 nats in
    the first 50 steps of a healthy run (docs/design.md)."""
    grad_arm_quiet: int | None = None
    """The grad rule's own quiet count, where it differs from ``arm_quiet`` (None: the same).
    0 turns its quiet arming off: the rule is on from max(arm_after, grad_arm_after) kept
    updates on, spikes or not (``spikeguard diagnose`` replays a log from another trainer so:
    there a grad-norm spike is worth naming whenever it comes)."""
    median_window: int = 5000
    """Updates in the running medians of grad norm and log Z, and in the loss floor."""
    grad_k: float = 3.0
    """Tier 1 SKIP when grad_norm > grad_k x its running median (and past grad_z spreads)."""
    grad_z: float = 6.0
    """...and when log grad norm stands more than this many robust spreads (1.4826 x the median
    absolute deviation) above the log of its median: the run's own noise widens the bar."""
    loss_window: int = 32
    """Updates in the running median of the loss and its spread (short: the loss falls fast
    early on, and an outlier batch is judged against the last few dozen batches)."""
    loss_z: float = 6.0
    """Tier 1 SKIP when the loss stands more than this many robust spreads above its running
    median over loss_window (an outlier batch early in a run, where loss / EMA still divides
    by a mean that carries the first, higher losses)."""
    loss_min_rise: float = 0.4
    """...and at least this fraction above that median (a run whose loss barely varies)."""
    loss_tail_rate: float = 1e-4
    """The loss rules' false-alarm rate where the run's own loss tail is heavier than loss_z
    spreads assume: the loss rule's bar becomes max(loss_z, z_p) spreads, z_p the excursion
    that the tail fitted to the run's excursions past loss_tail_from spreads (exponential, or
    Pareto about the loss's zero where that fits them decisively better) puts at this rate a
    step; the loss / EMA rules need the loss past that many spreads too
    (``detector/loss_tail.py``). 0: off (the fixed bar; the loss / EMA rules still need the
    loss past loss_z spreads)."""
    loss_tail_from: float = 2.5
    """Spreads above the loss median where the fitted tail starts (its threshold)."""
    loss_tail_min: int = 5
    """Excursions past loss_tail_from before the tail is fitted."""
    loss_tail_window: int = 1000
    """Armed steps after which the tail's sums halve (old steps fade)."""
    loss_tail_far: float = 3.0
    """A loss past this multiple of the bar is not counted in the tail (a fault, not noise)."""
    grad_elevated: float = 1.5
    """A norm above this multiple of the median is 'elevated'; the run of them dates the onset."""
    storm_loss_frac: float = 0.25
    """Right after a skip the guard's weights check blamed on its batch (at most
    max_consecutive_skips - 1 in a row), Tier 1 SKIP when the loss is past this fraction of the
    loss bar's rise above its median and the grad norm past grad_elevated x its median: a
    storm's later batch can sit inside the bars a fresh outlier passes. 0 turns it off."""
    loss_ema_steps: int = 1000
    """Span of the loss EMA behind loss_ema_ratio (alpha = 1 / span)."""
    alert_ratio: float = 1.5
    """ALERT (Tier 1, no skip) when loss_ema_ratio exceeds this alone."""
    skip_ratio: float = 2.0
    """Tier 1 SKIP when loss_ema_ratio exceeds this (the loss doubled: not noise)."""
    tier2_ratio: float = 2.5
    """Tier 2 when loss_ema_ratio stays above this for tier2_ratio_steps consecutive updates."""
    tier2_ratio_steps: int = 10
    """Consecutive updates above tier2_ratio that make Tier 2."""
    recovery_ema_steps: int = 50
    """Span of the short loss EMA used for recovery and the elevated-loss rule (alpha = 1/span)."""
    recovery_steps: int = 200
    """A Tier 1 spike must recover within this many updates, else it escalates to Tier 2."""
    spike_nats: float = 0.1
    """Spike size in nats: the short loss EMA this far above the pre-spike level is a spike."""
    loss_onset_nats: float = 0.05
    """A loss excursion (and its onset) starts where the short EMA rises this far above its floor."""
    elevated_steps: int = 500
    """Tier 2 when the short loss EMA stays spike_nats above pre-spike for more updates than this."""
    elevated_z: float = 6.0
    """The elevated-loss rule's levels (spike_nats, loss_onset_nats) are raised, in proportion,
    until spike_nats is at least this many standard errors of the short loss EMA (the loss's
    spread / sqrt(2 recovery_ema_steps - 1)): on a loss whose batch-to-batch noise is nats wide
    that EMA wanders past 0.1 nats for hundreds of steps. 0: off (the fixed nats alone)."""
    log_z_rise: float = 3.0
    """Tier 2 when log Z rises more than this within log_z_rise_steps (a fast logit blow-up)."""
    log_z_rise_steps: int = 300
    """Window of the log Z rise rule, in updates."""
    log_z_drift: float = 3.0
    """Tier 2 when log Z stands more than this above its running median (a drift too slow for
    the rise rule)."""
    log_z_onset: float = 0.5
    """A log Z excursion (and its onset) starts where log Z stands this far above its median."""
    log_z_jump: float = 1.0
    """Tier 2 when log Z stands more than this above its median over the last log_z_jump_window
    kept updates (a logit blow-up too fast for that median to follow, long before the +3 rules:
    a 0.05-a-step logit drift crossed it 7-14 updates in). 0: off."""
    log_z_jump_window: int = 32
    """Kept updates in the log Z jump rule's median; the rule waits for a full window."""
    log_z_jump_run: int = 1
    """The log Z jump fires on an update past its bar when this many of the last
    log_z_jump_run + 1 updates were (1: the first update past it). 2 waits out one batch of easy
    text, which can lift a noisy log Z (a run without z-loss) by more than a nat, at the price
    of later pages on a drift."""
    log_z_jump_rate: float = 1e-3
    """A log Z jump alone (at that update neither the grad norm past the joint test's grad bar,
    half-way to the grad rule's own noise-sized bar, nor a loss rule's flag) must also pass the
    level that this run's healed log Z excursions pass with this probability an update: an
    exponential tail fitted to the kept updates that stood more than log_z_onset above the
    short median in excursions that have since come back near it (log_z_jump_heal;
    rules_log_z.LogZJump). Under SGD with momentum the tiny GPT's log Z swings by 0.5-1 nat with
    a period of 10-15 updates, and 8 of 108 clean runs crossed the 1-nat bar for one or two
    updates: a page each (none with this bar, none of them ever on 36 held-out runs). A jump
    with a second sign, or one in a run whose log Z has not swung and come back, keeps the 1-nat
    bar. 0: off (every jump against log_z_jump)."""
    log_z_jump_heal: float = 0.2
    """An excursion of log Z past log_z_onset joins the lone jump's tail once log Z is back
    within this many nats of its short median (0: at the median). Under SGD a rising log Z's
    median lags, and swings that came back to within 0.1 nats of it never counted: 2 of 108
    clean SGD runs were paged for it (seeds 29 and 30, on which 0.2 was chosen); the planted
    drifts' delays and every other replay are unchanged. Taken at most log_z_onset (there every
    dip under the onset would end an excursion, and a drift's own dips would widen its bar)."""
    log_z_jump_min: int = 5
    """The log Z jump's tail waits for this many kept updates past log_z_onset in healed
    excursions before it moves the bar (fewer fit nothing)."""
    z_loss_advice_log_z: float = 12.0
    """Above this log Z, still rising over the median window, the verdict advises z-loss."""
    qk_advice_bound: float = 100.0
    """A Tier 2 page suggests QK-norm or QK-Clip when the attention-logit bound (the guard's
    signals) is above this (Kimi K2's QK-Clip threshold) and qk_advice_growth times the run's
    first reading (guard/remedies.py)."""
    qk_advice_growth: float = 10.0
    """See qk_advice_bound: without QK-norm the bound is loose, and a healthy small Llama's
    grows 7x in 300 steps under AdamW; the tiny GPT's at LR 1.0 without QK-norm, 100-100,000x."""
    max_consecutive_skips: int = 5
    """Skip storm (Tier 2): more consecutive Tier 1 skips than this."""
    skip_window: int = 1000
    """Skip storm window, in updates (not shrunk by for_run: 1 percent of a tiny window is one skip)."""
    max_skip_fraction: float = 0.01
    """Skip storm (Tier 2): more than this fraction of the last skip_window updates skipped."""
    halt_loss_nats: float = 10.0
    """Tier 3 when the loss exceeds this with no grad-norm explanation (needs vocab_size)."""
    halt_loss_vocab_fraction: float = 0.8
    """The halt_loss_nats rule applies once the loss EMA is below this fraction of ln(vocab)."""
    vocab_size: int | None = None
    """Vocabulary size; None (unknown) turns the halt_loss_nats rule off."""
    update_jump: float = 20.0
    """Tier 2 when the update ratio (the applied update's RMS over the weights', which the
    signals record every step: every guard reads them unless built with ``probes=False`` or
    ``GuardConfig(signals=False)``, and then the rule is silent) passes this many times its
    median over the last update_window readings: an update far larger than the run's own (the
    learning rate or the optimizer's state gone wrong), seen at the update itself, before the
    loss moves. An LR x50 moves it 50x; on clean runs it stayed within 2x of its median. 0: off."""
    update_window: int = 32
    """Readings in the update ratio's running median; the rule waits for half of them."""
    max_scaler_skips: int = 10
    """fp16: this many consecutive GradScaler overflows make Tier 3 HALT."""
    min_grad_scale: float = 1.0
    """fp16: an overflow with grad_scale below this makes Tier 3 HALT."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "log_z_jump":
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not (
                        v == 0 or 0 < v < math.inf):
                    raise ValueError(f"DetectorConfig.log_z_jump={v!r} must be a number > 0 "
                                     "(nats above log Z's recent median; default 1.0) or 0 "
                                     "(off)")
                continue
            if f.name == "update_jump":
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not (
                        v == 0 or v > 1):
                    raise ValueError(f"DetectorConfig.update_jump={v!r} must be a number > 1 "
                                     "(a multiple of the update ratio's median; default 20) "
                                     "or 0 (off)")
                continue
            if f.name == "storm_loss_frac":
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1:
                    raise ValueError(f"DetectorConfig.storm_loss_frac={v!r} must be a number in "
                                     "[0, 1) (a fraction of the loss bar's rise; default 0.25; "
                                     "0: off)")
                continue
            if f.name == "elevated_z":
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not (
                        0 <= v < math.inf):
                    raise ValueError(f"DetectorConfig.elevated_z={v!r} must be a number >= 0 "
                                     "(standard errors of the short loss EMA; default 6; 0: "
                                     "off)")
                continue
            if f.name == "log_z_jump_heal":
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not (
                        0 <= v < math.inf):
                    raise ValueError(f"DetectorConfig.log_z_jump_heal={v!r} must be a number "
                                     ">= 0 (nats above log Z's short median; default 0.2; 0: "
                                     "back at the median)")
                continue
            if f.name in ("loss_tail_rate", "log_z_jump_rate"):
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 0.01:
                    raise ValueError(f"DetectorConfig.{f.name}={v!r} must be a number in "
                                     f"[0, 0.01) (false alarms a step; default {f.default:g}; "
                                     "0: off)")
                continue
            if f.name == "grad_arm_quiet":
                if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                    raise ValueError(f"DetectorConfig.grad_arm_quiet={v!r} must be an int >= 0 "
                                     "(0: no quiet arming) or None (the same as arm_quiet)")
                continue
            if f.name == "vocab_size":
                if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 2):
                    raise ValueError(f"DetectorConfig.vocab_size={v!r} must be an int >= 2 "
                                     "(e.g. 256 for bytes, 128000 for Llama 3) or None")
                continue
            if isinstance(f.default, int):
                check_int(v, f"DetectorConfig.{f.name}", default=f.default,
                          minimum=0 if f.name == "grad_arm_after" else 1)
            else:
                check_positive(v, f"DetectorConfig.{f.name}", default=f.default)
        self._check_relations()

    def _check_relations(self) -> None:
        """The checks that read two fields or more (``__post_init__``)."""
        for name in ("grad_k", "grad_elevated", "alert_ratio", "skip_ratio", "tier2_ratio"):
            if getattr(self, name) <= 1.0:
                raise ValueError(f"DetectorConfig.{name}={getattr(self, name)} must be > 1: it "
                                 "is a multiple of a typical value, and <= 1 flags normal steps")
        if self.loss_tail_from >= self.loss_z:
            raise ValueError(f"DetectorConfig.loss_tail_from={self.loss_tail_from} must be < "
                             f"loss_z={self.loss_z}: the tail is fitted below the bar it moves")
        if self.loss_tail_far <= 1.0:
            raise ValueError(f"DetectorConfig.loss_tail_far={self.loss_tail_far} must be > 1: "
                             "a multiple of the loss bar (default 3)")
        if self.grad_elevated > self.grad_k:
            raise ValueError(f"DetectorConfig.grad_elevated={self.grad_elevated} must be <= "
                             f"grad_k={self.grad_k}: it dates the run that leads to a skip")
        if not self.alert_ratio <= self.skip_ratio <= self.tier2_ratio:
            raise ValueError(f"DetectorConfig ratios must rise alert_ratio <= skip_ratio <= "
                             f"tier2_ratio; got {self.alert_ratio}, {self.skip_ratio}, "
                             f"{self.tier2_ratio} (defaults 1.5, 2.0, 2.5)")
        if self.loss_onset_nats > self.spike_nats:
            raise ValueError(f"DetectorConfig.loss_onset_nats={self.loss_onset_nats} must be <= "
                             f"spike_nats={self.spike_nats}: the onset comes before the spike")
        if self.log_z_onset > self.log_z_drift:
            raise ValueError(f"DetectorConfig.log_z_onset={self.log_z_onset} must be <= "
                             f"log_z_drift={self.log_z_drift}: the onset comes before the drift")
        for name in ("max_skip_fraction", "halt_loss_vocab_fraction"):
            if getattr(self, name) >= 1.0:
                raise ValueError(f"DetectorConfig.{name}={getattr(self, name)} must be < 1 "
                                 f"(default {getattr(type(self), name)})")

    @property
    def grad_quiet_need(self) -> int:
        """The grad rule's quiet count: ``grad_arm_quiet``, or ``arm_quiet`` where that is None."""
        return self.arm_quiet if self.grad_arm_quiet is None else self.grad_arm_quiet

    @classmethod
    def for_run(cls, total_steps: int, *, warmup_steps: int | None = None,
                **overrides: Any) -> DetectorConfig:
        """The defaults, sized for a run of ``total_steps`` updates.

        Each window (median_window, loss_ema_steps, recovery_ema_steps, recovery_steps,
        elevated_steps, log_z_rise_steps) becomes min(default, total_steps // 4), so that it
        fills within the first quarter of the run. ``arm_after`` becomes min(default,
        max(10, total_steps // 10)): the rules start after a tenth of the run (50 updates of a
        100-step run would be half of it), but never on fewer than 10 values (5 for a run
        shorter than 20 steps). With the LR warmup ``warmup_steps`` (in updates) known,
        ``grad_arm_after`` becomes the warmup; unknown (None), it stays 0. Either way the grad
        rule turns on only after ``arm_quiet`` quiet updates past it (``grad_arm_after``).
        ``overrides`` are applied on top. From 20,000 steps on, with no warmup given, the
        result is ``DetectorConfig()``.
        """
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 4:
            raise ValueError(f"for_run(total_steps={total_steps!r}): total_steps must be an "
                             "int >= 4 (the windows become total_steps // 4)")
        cap = total_steps // 4
        sizes: dict[str, Any] = {name: min(getattr(cls, name), cap) for name in _WINDOWS}
        floor = min(_MIN_ARM_AFTER, max(5, total_steps // 2))
        sizes["arm_after"] = min(cls.arm_after, max(floor, total_steps // 10))
        if warmup_steps is not None:
            check_int(warmup_steps, "DetectorConfig.for_run(warmup_steps)", minimum=0)
            sizes["grad_arm_after"] = warmup_steps
        sizes.update(overrides)
        return cls(**sizes)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (JSON-ready)."""
        return dataclasses.asdict(self)

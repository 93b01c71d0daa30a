"""The detector's rules, one small object each: the base class, Tier 1, Tier 3 and fp16 overflows.

Every rule has the same interface. ``update(x)`` takes the step's :class:`StepInput` (the host
numbers, the update counters, ``armed``, and what earlier rules of the step published in it)
and returns its *events*: None, one ``(onset_step, reason)`` tuple, or a list of them. A rule
declares its ``tier`` (the tier of its events) and its ``phase``: "judge" rules run before the
detector decides whether the step is *kept* (a step that a Tier 1 rule skips or a Tier 3 rule
halts never enters any history), "after" rules run once ``x.kept`` is known. Judge rules with a
history get the kept step through ``fold(x)``. ``SpikeDetector`` loops over its rules in
declared order within each phase, sorts their events by onset and turns them into a Verdict.
A rule may publish numbers for the rules after it (``x.ratio``, ``x.short``, ...): the fields
of StepInput say who writes what. Tier 2 rules are in ``rules_tier2.py``; the non-finite path
(``NonFinite``, ``ScalerOverflow``) runs instead of the phases and takes the StepMetrics.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

from ..measure.spread import LogSpread, Spread
from ..measure.stats import EMA, RunningMedian
from ..record import StepMetrics
from .config import DetectorConfig
from .loss_tail import LossTail

__all__ = ["Event", "GradSpike", "LossHalt", "LossRatio", "LossSpike", "NonFinite", "Rule",
           "ScalerOverflow", "StepInput", "grad_limit", "grad_spike", "joint_grad_bar",
           "joint_spike", "loss_limit", "loss_spike", "quiet_arm", "ratio_spike", "storm_spike"]

Event = tuple[int, str]
"""(onset step, reason): where the anomaly a rule saw began, and a short text naming its metric."""

_isfinite = math.isfinite
_nan = math.nan


def grad_limit(median: float, spread: float, c: DetectorConfig) -> float:
    """The grad norm above which a step is a Tier 1 outlier: median x max(grad_k,
    exp(grad_z x spread)), ``spread`` the robust spread of log grad norm (NaN while unknown: the
    fixed multiple alone). Host floats; the device gate's twin is DeviceGate._grad_limit."""
    mult = c.grad_k if not spread == spread else max(c.grad_k, math.exp(c.grad_z * spread))
    return median * mult


def grad_spike(grad_norm: Any, limit: Any) -> Any:
    """The Tier 1 grad-norm test against ``grad_limit`` (floats or 0-d tensors; a NaN limit,
    before any history, compares false). One definition for the host rule, the device gate and
    a re-run's check."""
    return grad_norm > limit


def loss_limit(level: float, spread: float, c: DetectorConfig, z: float | None = None) -> float:
    """The loss above which a step is a Tier 1 outlier: its running median plus max(loss_min_rise
    x median, z x spread) (NaN while either is unknown), ``z`` the bar in spreads (``loss_z``
    unless the run's own tail widens it: ``LossTail``). Host floats; the device twin is
    DeviceGate._loss_limit."""
    return level + max(c.loss_min_rise * level, (c.loss_z if z is None else z) * spread)


def joint_spike(grad_norm: Any, grad_half: Any, loss: Any, level: Any, limit: Any) -> Any:
    """The Tier 1 joint test: the loss past half its bar's rise above the median **and** the grad
    norm past ``grad_half`` (``joint_grad_bar``). A batch of garbage inputs on a noisy
    small-batch run can sit just inside both bars (tiny, batch 8, seed 2: five such batches at
    1.3-1.37x the median loss, 5.5 spreads, and 3-4x the median grad norm, under a 4x bar),
    while a healthy batch is rarely far out on both at once: none of 12,352 armed steps of 80
    clean tiny runs was."""
    return (loss > level + 0.5 * (limit - level)) & (grad_norm > grad_half)


def joint_grad_bar(median: float, limit: float) -> float:
    """The joint test's grad bar (host floats; the device twin is in DeviceGate.test): the
    geometric midpoint of the median and ``grad_limit`` (sqrt(median x limit)), before the grad
    rule is on as after; inf while the median is not positive (no history: the test is off).
    Before the grad rule is on, a healthy run's grad norm spikes 5-160x its median after
    warmup, but on fine batches, at an ordinary loss; a garbage batch moves both (tiny, batch 8,
    warmup 40: a batch of random bytes at step 68 stood at 9.7x the median grad norm and 1.37x
    the median loss, under the loss rule's +40% floor; the zoo's batch of random token ids at
    step 52 of seed 3, 4.7x the median grad norm and 1.24x the median loss, inside a 10.5x grad
    bar). On the 214 recorded clean runs no step before the grad rule is on was past this bar
    with its loss past half the loss bar's rise (0 of 4,998 such steps), as with the whole grad
    bar, which it replaced (docs/design.md)."""
    if not median > 0.0:
        return math.inf
    return math.sqrt(median * limit)


def storm_spike(grad_norm: Any, grad_median: Any, loss: Any, level: Any, limit: Any,
                c: DetectorConfig) -> Any:
    """The Tier 1 storm test, for a step right after a skip the weights check blamed on its
    batch (``StepInput.after_skip``): the loss past ``storm_loss_frac`` of its bar's rise above
    the median **and** the grad norm past ``grad_elevated`` x its median (floats or 0-d tensors;
    NaN compares false). A storm's later batch can look milder than a fresh outlier: the zoo's
    storm of random token ids 2 steps after arming (tiny, seed 1) had its third batch at 5.7x
    the grad median under a 5.8x bar and +19% loss, inside the joint test, and, applied, left
    the last two at 2.2-2.6x. On the recorded clean runs no step right after a skip (26 and 30
    such steps) passed it; at any armed step 1.4 per 1,000 did on the tuning half (1.1 on the
    held-out half)."""
    return ((loss > level + c.storm_loss_frac * (limit - level))
            & (grad_norm > c.grad_elevated * grad_median))


def quiet_arm(quiet: int, need: int, outside: bool) -> tuple[int, bool]:
    """One judged update of a rule that is not yet on: (the new quiet count, whether the rule is
    on now). A statistic past the rule's bar restarts the count; ``need`` (``arm_quiet``) in a
    row inside it turn the rule on for good: its statistic is in control, whatever the warmup
    or the optimizer made of the run's first steps."""
    quiet = 0 if outside else quiet + 1
    return quiet, quiet >= need


def loss_spike(loss: Any, limit: Any) -> Any:
    """The Tier 1 loss-outlier test against ``loss_limit`` (a NaN limit compares false)."""
    return loss > limit


def ratio_spike(ratio: Any, c: DetectorConfig, loss: Any, gate: Any) -> Any:
    """The Tier 1 loss test: loss / EMA of the kept losses > skip_ratio (floats or tensors; a
    NaN ratio, before any history, compares false), with the loss past ``gate`` (its median
    plus the loss bar's spreads, ``LossSpike``)."""
    return (ratio > c.skip_ratio) & (loss > gate)


class StepInput:
    """One step as every rule sees it. The detector fills the first fields; rules publish the
    rest for the rules after them (named with the rule that writes each)."""

    __slots__ = ("after_skip", "armed", "blind", "ema_prev", "given_ratio", "grad_half",
                 "grad_med", "grad_norm", "grad_on", "i", "j", "kept", "log_z", "log_z_onset",
                 "loss", "loss_flag", "loss_gate", "loss_noise", "ratio", "ratio_onset",
                 "released", "short", "skip", "spike", "step", "t1_onset", "update_ratio")

    def __init__(self) -> None:
        self.step = self.i = self.j = 0
        """The step; the updates seen before it (not non-finite); the updates kept before it."""
        self.loss = self.grad_norm = self.log_z = self.update_ratio = _nan  # the signals' reading
        self.given_ratio: float | None = None
        """A loss_ema_ratio already in the StepMetrics (a replayed log), else None."""
        self.armed = False
        """Whether the statistical rules are on (arm_after kept updates before this one)."""
        self.after_skip = False
        """The step before was a skip the weights check blamed on its batch (the caller says:
        ``SpikeDetector.update``'s ``after_skip``): the storm test applies (LossSpike)."""
        self.released = self.blind = False
        """The caller applied this step's update although Tier 1 flags it (the weights, not the
        batch, were at fault; ``blind``: released without a test of the weights): no skip, but
        still out of the histories (the detector)."""
        self.grad_on = False
        """Whether the grad rule is on this step (GradSpike: armed and its quiet arming done)."""
        self.grad_med = _nan
        """The grad norm's running median this step is judged against (GradSpike)."""
        self.grad_half = math.inf
        """The joint test's grad bar (``joint_grad_bar``: halfway in log to the grad bar), inf
        while not armed (GradSpike; LossSpike's joint test reads it)."""
        self.skip = self.spike = self.loss_flag = False
        """Tier 1 asks for a skip (GradSpike, LossSpike, LossRatio); the grad-norm rule fired
        (GradSpike); a loss rule asks for a skip (LossSpike, LossRatio)."""
        self.ratio = self.ema_prev = _nan
        """loss / EMA_{t-1} and EMA_{t-1} (LossRatio)."""
        self.loss_gate = -math.inf
        """The loss the loss / EMA rules need it past: its median plus the loss bar's spreads
        (LossSpike; ``loss_tail.LossTail``), -inf while the spread is unknown."""
        self.loss_noise = _nan
        """The loss's spread this step was judged against (LossSpike; LossElevated sizes its
        levels by it), NaN while unknown."""
        self.ratio_onset: int | None = None
        """Start of the current run of ratios above alert_ratio (LossRatio)."""
        self.kept = False
        """Whether the step entered the histories (the detector, between the phases)."""
        self.t1_onset: int | None = None
        """Onset of the first Tier 1 event of a skipped step (the detector)."""
        self.short = _nan
        """The short loss EMA after this step (LossElevated)."""
        self.log_z_onset: int | None = None
        """Start of the current log Z excursion above its median (LogZDrift)."""


class Rule:
    """State round-trip shared by the rules: ``_scalars`` are plain attributes (JSON-ready),
    ``_stats`` are running statistics with their own ``state_dict``. Whatever is not listed is
    either configuration (rebuilt from the DetectorConfig) or a per-step output (``med``,
    ``ratio``, ...) that is rewritten by every ``update`` before anyone reads it. Every rule
    declares ``__slots__``: its attributes are read on every step (slots are faster to read, and
    a misspelt attribute raises instead of creating a new one)."""

    __slots__ = ()
    _scalars: ClassVar[tuple[str, ...]] = ()
    _stats: ClassVar[tuple[str, ...]] = ()
    tier: ClassVar[int] = 2
    """The tier of this rule's events."""
    phase: ClassVar[str] = "after"
    """"judge": before the kept decision (with ``fold``); "after": once ``x.kept`` is known."""

    def update(self, x: StepInput) -> Event | list[Event] | None:
        raise NotImplementedError

    def fold(self, x: StepInput) -> None:
        """A judge rule's history takes the kept step (judge rules with a history override it)."""

    def state_dict(self) -> dict[str, Any]:
        state = {name: getattr(self, name) for name in self._scalars}
        state.update((name, getattr(self, name).state_dict()) for name in self._stats)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        want = set(self._scalars) | set(self._stats)
        if set(state) != want:
            raise ValueError(f"{type(self).__name__} state has keys {sorted(state)}, expected "
                             f"{sorted(want)}; it was not written by this version's state_dict")
        for name in self._scalars:
            setattr(self, name, state[name])
        for name in self._stats:
            getattr(self, name).load_state_dict(state[name])


class GradSpike(Rule):
    """Tier 1 SKIP: grad_norm above ``grad_limit``: grad_k x the running median of the kept grad
    norms, widened to exp(grad_z x spread) x median where the run's log grad norm is noisy
    (``spread``: the robust spread of log grad norm from one kept step to the next,
    ``measure.spread.Spread``). It turns on once ``arm_quiet`` judged updates in a row, from
    ``arm_after`` and ``grad_arm_after`` kept updates on, stayed inside its bar, and then stays
    on: right after the warmup the grad norm of a healthy run spikes 5-160x its median, and each
    such spike restarts the count (see DetectorConfig.grad_arm_after). Until then its bar serves
    only the joint test (``joint_grad_bar``), with the loss, as it does after.

    ``onset`` is the first step of the current run of norms above grad_elevated x median: a
    blow-up usually climbs for a few steps before it crosses grad_k, and the rollback target must
    predate the climb, not its last step. The run also dates the "grad_norm elevated" context
    that the verdict lists when another rule fires.

    ``fold(x)`` adds a kept step's norm to the median. Only kept steps: an outlier in the median would raise the bar
    for the next one, and a storm of them would drag the median up until the storm looks normal.
    """

    __slots__ = ("arm", "c", "context", "elevated", "limit", "med", "median", "need", "on",
                 "onset", "quiet", "reason", "spread")
    _scalars = ("onset", "quiet", "on")
    _stats = ("median", "spread")
    tier, phase = 1, "judge"

    def __init__(self, c: DetectorConfig) -> None:
        self.c = c
        self.arm = c.grad_arm_after
        self.elevated = c.grad_elevated
        self.median = RunningMedian(c.median_window)
        self.spread = LogSpread(c.median_window)
        self.onset: int | None = None
        self.need = c.grad_quiet_need
        self.quiet, self.on = 0, False
        """Quiet arming: the rule turns on once ``arm_quiet`` judged updates in a row, from
        ``arm_after`` and ``grad_arm_after`` kept updates on, stayed inside its bar."""
        self.limit = _nan
        """The grad norm this step was judged against (NaN while the median is empty)."""
        self.med = _nan
        """The median this step was judged against (the window before it); NaN while empty."""
        self.reason = f"grad_norm > {c.grad_k:g}x median"
        self.context = f"grad_norm > {c.grad_elevated:g}x median"

    def update(self, x: StepInput) -> Event | None:
        g = x.grad_norm
        med = self.med = x.grad_med = self.median.value
        if g > self.elevated * med:
            if self.onset is None:
                self.onset = x.step
        else:
            self.onset = None
        self.limit = limit = grad_limit(med, self.spread.value, self.c)
        if not self.on and x.armed and x.j >= self.arm:
            self.quiet, self.on = quiet_arm(self.quiet, self.need, grad_spike(g, limit))
        on = x.grad_on = x.armed and self.on
        x.grad_half = joint_grad_bar(med, limit) if x.armed else math.inf
        if on and grad_spike(g, limit):
            x.skip = x.spike = True
            return (self.onset, self.reason)
        return None

    def fold(self, x: StepInput) -> None:
        self.spread.add(x.grad_norm)
        self.median.update(x.grad_norm)



class LossSpike(Rule):
    """Tier 1 SKIP: the loss above ``loss_limit``: its running median over the last loss_window
    kept steps plus loss_z robust spreads (and at least loss_min_rise x the median).

    An outlier batch is an outlier against the batches just before it. ``loss / EMA`` divides by
    a mean that early in a run still carries the first, much higher losses, so there it misses a
    batch of random bytes (loss/EMA 1.4 at step 150 of a 300-step tiny run, where this rule
    sees 10 spreads). The short median follows the falling loss; the spread (``Spread``: of the
    loss from one kept step to the next) is the run's own batch-to-batch noise, so a noisy run
    is not flagged for ordinary variation. It also flags a step past half of both bars at once
    (``joint_spike``), before the grad rule is on as after (``joint_grad_bar``: the post-warmup
    grad turbulence comes at an ordinary loss, a garbage batch moves both).
    """

    __slots__ = ("c", "early_reason", "joint_reason", "level", "limit", "med", "noise",
                 "reason", "spread", "storm", "storm_reason", "tail", "z")
    _stats = ("level", "spread", "tail")
    tier, phase = 1, "judge"

    def __init__(self, c: DetectorConfig) -> None:
        self.c = c
        self.level = RunningMedian(c.loss_window)
        self.spread = Spread(c.loss_window)
        self.tail = LossTail(c)
        self.z = c.loss_z
        """The bar this step was judged against, in spreads (``LossTail.bar``)."""
        self.med = self.limit = self.noise = _nan
        """The median, the bar and the spread this step was judged against (NaN while empty)."""
        self.reason = f"loss > median + {c.loss_z:g} spreads"
        self.joint_reason = "loss and grad_norm both past half their bars"
        self.early_reason = "loss and grad_norm both past half their bars, grad rule not on"
        self.storm = c.storm_loss_frac > 0.0
        self.storm_reason = (f"loss and grad_norm up right after a skipped garbage batch "
                             f"(past {c.storm_loss_frac:g} of the loss bar's rise, "
                             f"{c.grad_elevated:g}x the median)")

    def update(self, x: StepInput) -> Event | None:
        med = self.med = self.level.value
        self.noise = x.loss_noise = noise = self.spread.value
        self.z = self.tail.bar
        self.limit = limit = loss_limit(med, noise, self.c, self.z)
        if not x.armed:
            x.loss_gate = -math.inf
            return None
        if noise > 0.0:  # LossTail.add, its common case inlined (the hot path)
            x.loss_gate = med + self.z * noise
            tail = self.tail
            tail.count = k = tail.count + 1
            if x.loss > med + tail.u * noise or k % tail.window == 0:
                tail.after(x.loss, med, noise)
        else:  # no spread yet (no gate: the loss / EMA rules as they were), or none at all
            x.loss_gate = med if noise == 0.0 else -math.inf
        if loss_spike(x.loss, limit):
            x.skip = x.loss_flag = True
            return (x.step, self.reason)
        if joint_spike(x.grad_norm, x.grad_half, x.loss, med, limit):
            x.skip = x.loss_flag = True
            return (x.step, self.joint_reason if x.grad_on else self.early_reason)
        if (x.after_skip and self.storm
                and storm_spike(x.grad_norm, x.grad_med, x.loss, med, limit, self.c)):
            x.skip = x.loss_flag = True
            return (x.step, self.storm_reason)
        return None

    def fold(self, x: StepInput) -> None:
        self.spread.add(x.loss)
        self.level.update(x.loss)


class LossRatio(Rule):
    """Tier 1 on loss_ema_ratio = loss / EMA of the kept losses before this step: SKIP above
    skip_ratio, ALERT (no skip) above alert_ratio.

    The ratio divides by EMA_{t-1}, so a spike is measured against the level before it. A ratio
    already in the StepMetrics (a replayed log) is used as it is. ``onset`` is the first step of
    the current run of ratios above alert_ratio; ``RatioHeld`` dates its event by it too.

    ``fold(x)`` adds a kept step's loss to the EMA. A skipped loss stays out, so the steps after a spike are compared with the level before it
    rather than with a mean the spike has pulled up.
    """

    __slots__ = ("alert", "alert_reason", "c", "ema", "ema_prev", "onset", "ratio", "skip",
                 "skip_reason")
    _scalars = ("onset",)
    _stats = ("ema",)
    tier, phase = 1, "judge"

    def __init__(self, c: DetectorConfig) -> None:
        self.ema = EMA(1.0 / c.loss_ema_steps)
        self.alert = c.alert_ratio
        self.c = c
        self.onset: int | None = None
        self.ratio = _nan
        """This step's loss / EMA_{t-1} (NaN before any history)."""
        self.ema_prev = _nan
        """EMA_{t-1}, the denominator."""
        self.skip = False
        """Whether the event this update returned asks for a skip (False for an ALERT)."""
        self.skip_reason = f"loss_ema_ratio > {c.skip_ratio:g}"
        self.alert_reason = f"loss_ema_ratio > {c.alert_ratio:g}"

    def update(self, x: StepInput) -> Event | None:
        ema_prev = x.ema_prev = self.ema_prev = self.ema.value
        given = x.given_ratio
        if given is not None:
            ratio = given
        else:
            # NaN (no history yet) and a non-positive EMA give NaN, which compares False
            ratio = x.loss / ema_prev if ema_prev > 0.0 else _nan
        x.ratio = self.ratio = ratio
        if ratio > self.alert:
            if self.onset is None:
                self.onset = x.step
        else:
            self.onset = None
        x.ratio_onset = self.onset
        if not x.armed:
            return None
        if ratio_spike(ratio, self.c, x.loss, x.loss_gate):
            self.skip = x.skip = x.loss_flag = True
            return (self.onset, self.skip_reason)
        if ratio > self.alert and x.loss > x.loss_gate:
            self.skip = False
            return (self.onset, self.alert_reason)
        return None

    def fold(self, x: StepInput) -> None:
        self.ema.update(x.loss)



class LossHalt(Rule):
    """Tier 3 HALT: loss > halt_loss_nats on a step whose grad norm is not a Tier 1 spike, once
    the loss EMA is below halt_loss_vocab_fraction x ln(vocab_size).

    A model that predicts uniformly over V tokens has loss ln V, so early in training (or with a
    large vocabulary) a loss of 10 nats says nothing; after the model has learned, a loss that
    high with an ordinary gradient is not a bad batch (which would move the gradient too) but a
    broken forward pass, and skipping will not fix it. Off while vocab_size is unknown.
    """

    __slots__ = ("below", "nats", "on", "reason")
    tier, phase = 3, "judge"

    def __init__(self, c: DetectorConfig) -> None:
        self.on = c.vocab_size is not None
        """False while vocab_size is unknown: the rule never fires and need not be called."""
        self.nats = c.halt_loss_nats
        self.below = (c.halt_loss_vocab_fraction * math.log(c.vocab_size)
                      if c.vocab_size is not None else -math.inf)
        self.reason = f"loss > {c.halt_loss_nats:g} nats, grad_norm <= {c.grad_k:g}x median"

    def update(self, x: StepInput) -> Event | None:
        if self.on and x.armed and x.loss > self.nats and x.ema_prev < self.below and not x.spike:
            return (x.step, self.reason)
        return None


class NonFinite(Rule):
    """Tier 3 HALT at the step itself: nan_frac > 0, a non-finite loss or a non-finite grad norm
    (outside fp16 loss scaling, where ``ScalerOverflow`` judges it). Stateless."""

    __slots__ = ()
    tier, phase = 3, "non-finite"

    def update(self, m: StepMetrics) -> list[Event]:  # type: ignore[override]
        events = []
        if not (m.nan_frac or 0.0) <= 0.0:  # `not <=` so that a NaN nan_frac counts too
            events.append((m.step, "nan_frac > 0"))
        if not _isfinite(m.loss):
            events.append((m.step, "loss non-finite"))
        if not _isfinite(m.grad_norm):
            events.append((m.step, "grad_norm non-finite"))
        return events


class ScalerOverflow(Rule):
    """fp16 loss scaling: a non-finite step with ``grad_scale`` set is a GradScaler overflow.

    The scaler has already skipped the step and halved its scale, so an isolated overflow is
    routine (the detector answers SKIP, reason "scaler", Tier 0). It becomes Tier 3 HALT when the
    scale is already below min_grad_scale at an overflow (halving cannot help: the overflow is in
    the model, not the scale), or after max_scaler_skips consecutive overflows. Overflows are not
    Tier 1 skips and never count towards a skip storm.
    """

    __slots__ = ("low_reason", "max_run", "min_scale", "onset", "run", "run_reason")
    _scalars = ("run", "onset")
    tier, phase = 3, "non-finite"

    def __init__(self, c: DetectorConfig) -> None:
        self.min_scale = c.min_grad_scale
        self.max_run = c.max_scaler_skips
        self.run = 0
        self.onset: int | None = None
        self.low_reason = f"grad_scale < {c.min_grad_scale:g} at overflow"
        self.run_reason = f"scaler overflows >= {c.max_scaler_skips} consecutive"

    def update(self, step: int, grad_scale: float) -> Event | None:  # type: ignore[override]
        if self.run == 0:
            self.onset = step
        self.run += 1
        if grad_scale < self.min_scale:
            return (self.onset, self.low_reason)
        if self.run >= self.max_run:
            return (self.onset, self.run_reason)
        return None

    def clear(self) -> None:
        """A finite step ends the run of overflows (a non-finite step outside fp16 does not)."""
        self.run = 0
        self.onset = None

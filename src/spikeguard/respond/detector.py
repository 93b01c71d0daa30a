"""The spike detector: seed 004 section 5.2.2's triage as a pure function of the metrics stream.

``SpikeDetector(DetectorConfig()).update(StepMetrics) -> Verdict``. Pure Python: no torch, no
I/O, host floats in and out; about 10 us an update. Tiers (every number a DetectorConfig field):

* Tier 0: nothing, a z-loss advice ALERT, or an fp16 GradScaler overflow (SKIP, reason "scaler").
* Tier 1: SKIP when grad_norm > 3x its running median OR loss_ema_ratio > 2.0 (shared/SEED-ERRATA:
  OR, not the seed's AND); ALERT when loss_ema_ratio > 1.5 alone. A skipped step never enters a
  median or an EMA. A skip must recover (short loss EMA back below max(spike-step loss,
  pre-spike EMA + 0.1)) within 200 updates, else Tier 2.
* Tier 2 (ROLLBACK; the guard may turn it into an alert): ratio > 2.5 for 10 updates; short loss
  EMA 0.1 above its pre-spike level for > 500 updates; log Z +3 within 300 updates; log Z more
  than 3 above its running median (the drift rule); a skip storm; an unrecovered Tier 1.
  Tier 2 rules are events: each fires once when its condition starts to hold.
* Tier 3 (HALT): nan_frac > 0, a non-finite loss or grad norm (under fp16: only when grad_scale
  is below 1 or after 10 consecutive overflows), or loss > 10 nats that the grad norm does not
  explain once the loss EMA is below 0.8 ln(vocab).

``Verdict.reasons`` lists what fired and which other metrics are in an excursion, ordered by
onset: the first names the metric that moved first. ``onset_step`` is the earliest of those
onsets; the rollback target is the last checkpoint at or before it.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from ..detect.stats import EMA, EventWindow, RunningMedian, SlidingMin
from ..record import Action, StepMetrics
from ._detector_config import DetectorConfig

__all__ = ["Action", "DetectorConfig", "SpikeDetector", "Verdict"]

_STATE_VERSION = 1


class Verdict(NamedTuple):
    """The detector's decision for one step (an immutable named tuple: cheap to build per step).

    ``skip`` is True when this step's update must be discarded: every SKIP, and a ROLLBACK or HALT
    at a step where a Tier 1 rule also fired (a Tier 1 step is skipped whatever the Tier 2
    policy). For CONTINUE, ``reasons`` is empty and ``onset_step`` None.
    """

    step: int
    """The step judged."""
    tier: int
    """0 (nothing, advice, fp16 overflow) to 3 (halt)."""
    action: Action
    """What to do; ``action.value`` is the metrics record's string."""
    reasons: tuple[str, ...]
    """Short strings, each starting with the metric it is about, ordered by onset."""
    onset_step: int | None
    """Where the anomaly began; roll back to the last checkpoint at or before it."""
    evidence: dict[str, float]
    """The numbers behind the decision (NaN where not yet known)."""
    skip: bool
    """Discard this step's update."""


_isfinite = math.isfinite


def _metric(reason: str) -> str:
    return reason.split(" ", 1)[0]


class SpikeDetector:
    """Feed one :class:`StepMetrics` per step, in step order; get a :class:`Verdict` back.

    Windows count updates, not step indices. State (medians, EMAs, windows, runs) round-trips
    through ``state_dict`` / ``load_state_dict`` as JSON-ready plain data.
    """

    def __init__(self, config: DetectorConfig | None = None) -> None:
        self.config = config if config is not None else DetectorConfig()
        c = self.config
        self._r = {
            "grad": f"grad_norm > {c.grad_k:g}x median",
            "grad_ctx": f"grad_norm > {c.grad_elevated:g}x median",
            "skip_ratio": f"loss_ema_ratio > {c.skip_ratio:g}",
            "alert_ratio": f"loss_ema_ratio > {c.alert_ratio:g}",
            "t2_ratio": f"loss_ema_ratio > {c.tier2_ratio:g} for {c.tier2_ratio_steps} steps",
            "not_recovered": f"loss not recovered within {c.recovery_steps} steps",
            "elevated": f"loss +{c.spike_nats:g} nats for > {c.elevated_steps} steps",
            "loss_ctx": f"loss +{c.loss_onset_nats:g} nats above its floor",
            "z_rise": f"log_z +{c.log_z_rise:g} within {c.log_z_rise_steps} steps",
            "z_drift": f"log_z > median + {c.log_z_drift:g}",
            "z_ctx": f"log_z > median + {c.log_z_onset:g}",
            "storm_run": f"skips > {c.max_consecutive_skips} consecutive",
            "storm_frac": f"skips > {c.max_skip_fraction:.0%} of last {c.skip_window}",
            "z_advice": "add or raise z-loss",
            "loss_halt": f"loss > {c.halt_loss_nats:g} nats, grad_norm <= {c.grad_k:g}x median",
            "scale_low": f"grad_scale < {c.min_grad_scale:g} at overflow",
            "scaler_run": f"scaler overflows >= {c.max_scaler_skips} consecutive",
        }
        self._halt_loss_ema = (c.halt_loss_vocab_fraction * math.log(c.vocab_size)
                               if c.vocab_size is not None else -math.inf)
        self._skip_limit = c.max_skip_fraction * c.skip_window
        self.reset()

    def reset(self) -> None:
        """Forget all history (same config)."""
        c = self.config
        self._gmed = RunningMedian(c.median_window)
        self._zmed = RunningMedian(c.median_window)
        self._ema = EMA(1.0 / c.loss_ema_steps)
        self._e50 = EMA(1.0 / c.recovery_ema_steps)
        self._floor = SlidingMin(c.median_window)
        self._zmin = SlidingMin(c.log_z_rise_steps)
        self._skips = EventWindow(c.skip_window)
        self._n_seen = 0          # updates that were not overflows / non-finite
        self._n_clean = 0         # updates that entered the histories
        self._gn_onset: int | None = None     # first step of the run of elevated grad norms
        self._ratio_onset: int | None = None  # first step of the run of ratio > alert_ratio
        self._ratio_hi = 0        # consecutive updates with ratio > tier2_ratio
        self._skip_run = 0
        self._skip_run_onset: int | None = None
        self._storm_latched = False
        self._lx_onset: int | None = None     # loss excursion: onset, pre-spike level, count
        self._lx_pre = 0.0
        self._lx_count = 0
        self._zx_onset: int | None = None     # log Z excursion onset
        self._zx_drift_fired = False
        self._zx_rise_fired = False
        self._pending: list[float] | None = None  # [onset, update index, pre EMA, threshold]
        self._scaler_run = 0
        self._scaler_onset: int | None = None

    @property
    def armed(self) -> bool:
        """True once ``arm_after`` unflagged updates have entered the histories."""
        return self._n_clean >= self.config.arm_after

    @property
    def grad_median(self) -> float:
        """Running median of the unflagged grad norms in the window; NaN while empty."""
        return self._gmed.value

    def update(self, m: StepMetrics) -> Verdict:
        """Judge one step. Call once per step, in order, with host floats."""
        c = self.config
        r = self._r
        step, loss, g = m.step, m.loss, m.grad_norm
        nf = m.nan_frac or 0.0  # None (a log without the column) counts as 0
        if not (nf <= 0.0 and _isfinite(loss) and _isfinite(g)):
            return self._nonfinite(m)
        self._scaler_run = 0
        self._scaler_onset = None
        i = self._n_seen
        self._n_seen = i + 1
        j = self._n_clean
        armed = j >= c.arm_after
        med = self._gmed.value
        ema_prev = self._ema.value
        ratio = m.loss_ema_ratio
        if ratio is None:
            ratio = loss / ema_prev if ema_prev > 0.0 else math.nan
        e50 = self._e50.value

        if g > c.grad_elevated * med:
            if self._gn_onset is None:
                self._gn_onset = step
        else:
            self._gn_onset = None
        if ratio > c.alert_ratio:
            if self._ratio_onset is None:
                self._ratio_onset = step
        else:
            self._ratio_onset = None

        t1: list[tuple[int, str]] = []
        t2: list[tuple[int, str]] = []
        t3: list[tuple[int, str]] = []
        skip = False
        if armed:
            if g > c.grad_k * med:
                t1.append((self._gn_onset, r["grad"]))
                skip = True
            if ratio > c.skip_ratio:
                t1.append((self._ratio_onset, r["skip_ratio"]))
                skip = True
            elif ratio > c.alert_ratio:
                t1.append((self._ratio_onset, r["alert_ratio"]))
            if ratio > c.tier2_ratio:
                self._ratio_hi += 1
                if self._ratio_hi == c.tier2_ratio_steps:
                    t2.append((self._ratio_onset, r["t2_ratio"]))
            else:
                self._ratio_hi = 0
            if (loss > c.halt_loss_nats and ema_prev < self._halt_loss_ema
                    and not g > c.grad_k * med):
                t3.append((step, r["loss_halt"]))

        # skip storms count Tier 1 skips only (never fp16 overflows)
        if skip:
            if self._skip_run == 0:
                self._skip_run_onset = step
            self._skip_run += 1
            self._skips.add(i, step)
            if self._skip_run == c.max_consecutive_skips + 1:
                t2.append((self._skip_run_onset, r["storm_run"]))
        else:
            self._skip_run = 0
        n_skips = self._skips.count(i) if self._skips else 0
        if n_skips > self._skip_limit:
            if skip and not self._storm_latched:
                t2.append((self._skips.first_step(), r["storm_frac"]))
                self._storm_latched = True
        elif n_skips <= self._skip_limit / 2:
            self._storm_latched = False

        flagged = skip or bool(t3)
        if not flagged:
            self._gmed.update(g)
            self._ema.update(loss)
            self._e50.update(loss)
            e50 = self._e50.value
            floor, _ = self._floor.min_before(j)
            self._floor.push(j, e50, step)
            self._n_clean = j + 1
            if armed and self._lx_onset is None and e50 > floor + c.loss_onset_nats:
                self._lx_onset, self._lx_pre, self._lx_count = step, floor, 0
        if self._lx_onset is not None:
            if e50 <= self._lx_pre + c.loss_onset_nats:
                self._lx_onset, self._lx_count = None, 0
            elif e50 > self._lx_pre + c.spike_nats:
                self._lx_count += 1
                if self._lx_count == c.elevated_steps + 1:
                    t2.append((self._lx_onset, r["elevated"]))
            else:
                self._lx_count = 0

        lz = m.log_z if m.log_z is not None else math.nan
        zmed = self._zmed.value
        zrise = math.nan
        advice = False
        if _isfinite(lz):
            dev = lz - zmed
            if dev > c.log_z_onset:
                if self._zx_onset is None:
                    self._zx_onset = step
            else:
                self._zx_onset = None
                self._zx_drift_fired = False
            zmin, zmin_step = self._zmin.min_before(j)
            zrise = lz - zmin
            if armed:
                if dev > c.log_z_drift and not self._zx_drift_fired:
                    t2.append((self._zx_onset, r["z_drift"]))
                    self._zx_drift_fired = True
                if zrise > c.log_z_rise:
                    if not self._zx_rise_fired:
                        onset = self._zx_onset if self._zx_onset is not None else zmin_step
                        t2.append((onset, r["z_rise"]))
                        self._zx_rise_fired = True
                elif self._zx_onset is None:
                    self._zx_rise_fired = False
                advice = lz > c.z_loss_advice_log_z and dev > c.log_z_onset
            if not flagged:
                self._zmed.update(lz)
                self._zmin.push(j, lz, step)

        p = self._pending
        if skip:
            if p is None:
                self._pending = [t1[0][0], i, e50, max(loss, e50 + c.spike_nats)]
            else:
                p[3] = max(p[3], loss)
        elif p is not None:
            progress = i - p[1]
            if progress >= min(c.recovery_ema_steps, c.recovery_steps) and e50 < p[3]:
                self._pending = None
            elif progress >= c.recovery_steps:
                t2.append((int(p[0]), r["not_recovered"]))
                self._pending = None

        evidence = {
            "grad_norm": g, "grad_median": med, "loss": loss, "loss_ema": ema_prev,
            "loss_ema_ratio": ratio, "loss_ema50": e50, "log_z": lz, "log_z_median": zmed,
            "log_z_rise": zrise, "skips_in_window": n_skips,
        }
        if t3:
            tier, action = 3, Action.HALT
        elif t2:
            tier, action = 2, Action.ROLLBACK
        elif t1:
            tier, action = 1, (Action.SKIP if skip else Action.ALERT)
        elif advice:
            tier, action = 0, Action.ALERT
        else:
            return Verdict(step, 0, Action.CONTINUE, (), None, evidence, False)
        if self._lx_onset is not None:
            evidence["pre_spike_loss"] = self._lx_pre
            evidence["loss_elevated_steps"] = self._lx_count
        evidence["skips_consecutive"] = self._skip_run
        return self._verdict(step, tier, action, t3 + t2 + t1, advice, evidence, skip or tier == 3)

    def _verdict(self, step: int, tier: int, action: Action, fired: list[tuple[int, str]],
                 advice: bool, evidence: dict[str, float], skip: bool) -> Verdict:
        r = self._r
        # at equal onsets a metric's own rule comes before a derived one (skip storms)
        items = [(step if o is None else o, _metric(reason) == "skips", reason)
                 for o, reason in fired]
        seen = {_metric(reason) for _, _, reason in items}
        for onset, reason in ((self._gn_onset, r["grad_ctx"]), (self._zx_onset, r["z_ctx"]),
                              (self._lx_onset, r["loss_ctx"])):
            if onset is not None and _metric(reason) not in seen:
                items.append((onset, False, reason))
        items.sort(key=lambda t: (t[0], t[1]))
        reasons = [reason for _, _, reason in items]
        if advice:
            reasons.append(r["z_advice"])
        onset = items[0][0] if items else step
        return Verdict(step, tier, action, tuple(dict.fromkeys(reasons)), onset, evidence, skip)

    def _nonfinite(self, m: StepMetrics) -> Verdict:
        c = self.config
        evidence = {"loss": m.loss, "grad_norm": m.grad_norm, "nan_frac": m.nan_frac,
                    "grad_median": self._gmed.value}
        if m.grad_scale is not None:
            # fp16: GradScaler already skips the step and halves the scale
            if self._scaler_run == 0:
                self._scaler_onset = m.step
            self._scaler_run += 1
            evidence["grad_scale"] = m.grad_scale
            evidence["scaler_overflows"] = self._scaler_run
            if m.grad_scale < c.min_grad_scale:
                why = [(self._scaler_onset, self._r["scale_low"])]
            elif self._scaler_run >= c.max_scaler_skips:
                why = [(self._scaler_onset, self._r["scaler_run"])]
            else:
                return Verdict(m.step, 0, Action.SKIP, ("scaler",), m.step, evidence, True)
            return self._verdict(m.step, 3, Action.HALT, why, False, evidence, True)
        why = []
        if not (m.nan_frac or 0.0) <= 0.0:
            why.append((m.step, "nan_frac > 0"))
        if not math.isfinite(m.loss):
            why.append((m.step, "loss non-finite"))
        if not math.isfinite(m.grad_norm):
            why.append((m.step, "grad_norm non-finite"))
        return self._verdict(m.step, 3, Action.HALT, why, False, evidence, True)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly: JSON-ready plain data."""
        return {
            "version": _STATE_VERSION,
            "config": self.config.to_dict(),
            "grad_median": self._gmed.state_dict(),
            "log_z_median": self._zmed.state_dict(),
            "loss_ema": self._ema.state_dict(),
            "loss_ema50": self._e50.state_dict(),
            "loss_floor": self._floor.state_dict(),
            "log_z_min": self._zmin.state_dict(),
            "skips": self._skips.state_dict(),
            "scalars": {name: getattr(self, name) for name in _SCALARS},
            "pending": None if self._pending is None else list(self._pending),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict``; the config must match this detector's."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"detector state version {state.get('version')!r} is not "
                             f"{_STATE_VERSION}; save it again with this spikeguard")
        mine = self.config.to_dict()
        diff = sorted(k for k, v in state["config"].items() if mine.get(k) != v)
        if diff:
            raise ValueError(f"detector state was saved with a different DetectorConfig "
                             f"(fields {diff}); build the detector with the saved config")
        self.reset()
        self._gmed.load_state_dict(state["grad_median"])
        self._zmed.load_state_dict(state["log_z_median"])
        self._ema.load_state_dict(state["loss_ema"])
        self._e50.load_state_dict(state["loss_ema50"])
        self._floor.load_state_dict(state["loss_floor"])
        self._zmin.load_state_dict(state["log_z_min"])
        self._skips.load_state_dict(state["skips"])
        for name in _SCALARS:
            setattr(self, name, state["scalars"][name])
        self._pending = None if state["pending"] is None else list(state["pending"])


_SCALARS = ("_n_seen", "_n_clean", "_gn_onset", "_ratio_onset", "_ratio_hi", "_skip_run",
            "_skip_run_onset", "_storm_latched", "_lx_onset", "_lx_pre", "_lx_count",
            "_zx_onset", "_zx_drift_fired", "_zx_rise_fired", "_scaler_run", "_scaler_onset")

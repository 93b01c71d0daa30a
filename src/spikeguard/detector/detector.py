"""The spike detector: triage of each training step into tiers, a pure function of the metrics.

``SpikeDetector(DetectorConfig()).update(StepMetrics) -> Verdict``. No torch, no I/O, host
floats in and out (its running statistics compiled, measure/_cstats.c); about 5 us an update
(bench_detector on a 2-core Xeon). Tiers (every number a DetectorConfig field):

* Tier 0: nothing, a z-loss advice ALERT, or an fp16 GradScaler overflow (SKIP, reason "scaler").
* Tier 1: SKIP when grad_norm > 3x its running median OR the loss past its short median by 6
  spreads (or its own tail's 1-in-10,000 excursion where wider: ``loss_tail.py``) OR
  loss_ema_ratio > 2.0 with the loss past that many spreads. Either alone suffices because a bad
  batch can move one without the other: a batch of repeated bytes gives a huge gradient at a
  low loss, a batch of noise a high loss at an ordinary gradient. ALERT when loss_ema_ratio >
  1.5 alone (the loss past the same spreads). Right after a skip the caller's weights check
  blamed on its batch, the next batch of a storm is skipped at a lower bar (a quarter of the
  loss bar's rise and 1.5x the grad median: ``after_skip``). A skipped step never enters a
  median or an EMA. A skip must recover (short loss EMA back below max(spike-step loss,
  pre-spike EMA + 0.1)) within 200 updates, else Tier 2.
* Tier 2 (an ALERT: which response it gets, a page, a rollback or a question to a person, is the
  caller's policy; ``Verdict.advice`` says what a loop with only the detector does): ratio > 2.5
  for 10 updates; short loss
  EMA 0.1 above its pre-spike level for > 500 updates; log Z +3 within 300 updates; log Z more
  than 3 above its running median (a drift too slow for the 300-update rule); log Z more than 1
  above its median over the last 32 kept updates (a blow-up too fast for that median); a skip
  storm; an unrecovered Tier 1; an update ratio (the signals' reading) past 20x its median, at
  the update itself. Tier 2 rules are events: each fires once when its condition starts to hold.
* Tier 3 (HALT): nan_frac > 0, a non-finite loss or grad norm (under fp16: only when grad_scale
  is below 1 or after 10 consecutive overflows), or loss > 10 nats that the grad norm does not
  explain once the loss EMA is below 0.8 ln(vocab).

Each rule is a small object in ``rules.py`` / ``rules_tier2.py`` / ``rules_log_z.py`` with one
interface (``update(StepInput) -> events``, a tier and a phase); this class loops over them in declared
order within two phases (judge, then after the kept decision), keeps flagged steps out of their
histories and turns their events into a Verdict.
``Verdict.reasons`` lists what fired and which other metrics are in an excursion, ordered by
onset: the first names the metric that moved first. ``onset_step`` is the earliest of those
onsets; the rollback target is the newest checkpoint at or before ``onset_step - 2``
(``checkpoint.manager.rollback_target``: the update before the onset may be the cause).
"""

from __future__ import annotations

import math
import numbers
import sys
from typing import Any, NamedTuple

from ..record import Action, StepMetrics
from .config import DetectorConfig
from .rules import (
    Event,
    GradSpike,
    LossHalt,
    LossRatio,
    LossSpike,
    NonFinite,
    Rule,
    ScalerOverflow,
    StepInput,
)
from .rules_log_z import LogZDrift, LogZJump, LogZRise
from .rules_tier2 import (
    LossElevated,
    RatioHeld,
    Recovery,
    SkipStorm,
    UpdateJump,
)

__all__ = ["Action", "DetectorConfig", "SpikeDetector", "Verdict"]

_STATE_VERSION = 10
_NEWER_RULES = frozenset({"log_z_jump"})
"""Rules a version-5 state saved before them may lack: they start fresh on load."""
"""10: the loss tail keeps the Pareto fit's sums; 9: the loss rule keeps its tail
(``loss_tail.LossTail``); 8: the log Z jump rule keeps
which of its last updates were past the bar (``log_z_jump_run``); 7: the
grad-norm rule keeps its quiet count and whether it is on (``arm_quiet``); 6: the log
Z rules keep their quiet count (``arm_quiet``), the skip storm its suspicion of
the weights; 5: adds the update-ratio rule; 4:
the spreads are of step-to-step differences; 3: adds the loss-outlier rule and the spreads; 2: one
entry per rule; 1: one flat dict. Version-5 to 9 states still load (``_from_v5``,
``_from_v6``, ``_from_v7``, ``_from_v8``, ``_from_v9``)."""
_QUIET_RULES = ("log_z_drift", "log_z_rise", "log_z_jump")


def _from_v5(state: dict[str, Any], config: DetectorConfig) -> dict[str, Any]:
    """A version-5 state as version 6: its log Z rules were on once ``arm_after`` and
    ``grad_arm_after`` kept updates had passed, so they stay on (a resumed run keeps its rules)."""
    on = int(state["updates"]["kept"]) >= max(config.arm_after, config.grad_arm_after)
    rules = {name: dict(rule) for name, rule in state["rules"].items()}
    for name in _QUIET_RULES:
        if name in rules:
            rules[name].setdefault("quiet", 0)
            rules[name].setdefault("on", on)
    if "skip_storm" in rules:
        rules["skip_storm"].setdefault("suspect", False)
        rules["skip_storm"].setdefault("calm", 0)
    return {**state, "version": 6, "rules": rules}


def _from_v6(state: dict[str, Any], config: DetectorConfig) -> dict[str, Any]:
    """A version-6 state as version 7: its grad-norm rule was on once ``arm_after`` and
    ``grad_arm_after`` kept updates had passed, so it stays on (a resumed run keeps its rules)."""
    on = int(state["updates"]["kept"]) >= max(config.arm_after, config.grad_arm_after)
    rules = {name: dict(rule) for name, rule in state["rules"].items()}
    if "grad_spike" in rules:
        rules["grad_spike"].setdefault("quiet", 0)
        rules["grad_spike"].setdefault("on", on)
    return {**state, "version": 7, "rules": rules}


def _from_v7(state: dict[str, Any]) -> dict[str, Any]:
    """A version-7 state as version 8: its log Z jump rule fired on the first update past the
    bar, so none is on record (an excursion it fired on stays ``fired``)."""
    rules = {name: dict(rule) for name, rule in state["rules"].items()}
    if "log_z_jump" in rules:
        rules["log_z_jump"].setdefault("above", 0)
    return {**state, "version": 8, "rules": rules}


def _from_v8(state: dict[str, Any], config: DetectorConfig) -> dict[str, Any]:
    """A version-8 state as version 9: its loss rule had no tail, so the tail starts empty (the
    fixed bars until ``loss_tail_min`` excursions are seen)."""
    rules = {name: dict(rule) for name, rule in state["rules"].items()}
    if "loss_spike" in rules:
        rules["loss_spike"].setdefault("tail", {"held": 0.0, "exceed": 0.0, "excess": 0.0,
                                                "count": 0, "bar": config.loss_z})
    return {**state, "version": 9, "rules": rules}


def _from_v9(state: dict[str, Any]) -> dict[str, Any]:
    """A version-9 state as version 10: its loss tail had no Pareto fit, so that fit's sums
    start empty (the exponential fit alone until ``loss_tail_min`` such excursions)."""
    rules = {name: dict(rule) for name, rule in state["rules"].items()}
    if "loss_spike" in rules and "tail" in rules["loss_spike"]:
        rules["loss_spike"]["tail"] = {"lexceed": 0.0, "lexcess": 0.0,
                                       **rules["loss_spike"]["tail"]}
    return {**state, "version": _STATE_VERSION, "rules": rules}


class Verdict(NamedTuple):
    """The detector's decision for one step (an immutable named tuple: cheap to build per step).

    The detector decides the tier, the reasons, ``skip`` (a Tier 1 fact: this batch's update must
    not be applied) and the halt (Tier 3: the numbers are not finite). It does not decide what a
    Tier 2 verdict gets: its ``action`` is ALERT, and a caller's policy answers it (the Guard's
    ``GuardConfig.tier2``: an alert, the default, a rollback or a question to a person; the
    verdicts ``Guard.step`` returns carry the action the guard took). ``skip`` is True for every
    SKIP, and for a Tier 2 or 3 verdict at a step where a Tier 1 rule also fired (a Tier 1 step
    is skipped whatever the Tier 2 policy). For CONTINUE, ``reasons`` is empty and
    ``onset_step`` None.
    """

    step: int
    """The step judged."""
    tier: int
    """0 (nothing, advice, fp16 overflow) to 3 (halt)."""
    action: Action
    """What to do: CONTINUE, SKIP, ALERT (Tier 0 advice, a released Tier 1, every Tier 2 from the
    detector) or HALT; from ``Guard.step``, what the guard did (ROLLBACK under
    ``tier2="rollback"``). ``action.value`` is the metrics record's string."""
    reasons: tuple[str, ...]
    """Short strings, each starting with the metric it is about, ordered by onset."""
    onset_step: int | None
    """Where the anomaly began; roll back to the newest checkpoint at or before onset_step - 2."""
    evidence: dict[str, float]
    """The numbers behind the decision (NaN where not yet known)."""
    skip: bool
    """Discard this step's update."""

    @property
    def advice(self) -> str:
        """What a loop that holds only the detector (no Guard, perhaps no checkpoints) should do
        with this verdict, in one sentence."""
        if self.action is Action.HALT:
            return "stop: the numbers are not finite (or the loss is far past any batch's)"
        if self.tier == 2:
            target = "" if self.onset_step is None else f" at or before step {self.onset_step - 2}"
            return (f"restore the newest checkpoint{target} and skip the data since; without "
                    "one, keep training with the clipped update at a lower learning rate (e.g. "
                    f"half) and watch the loss")
        if self.skip:
            return "skip this step's optimizer and LR-schedule step (the next batch is fresh)"
        if self.action is Action.ALERT:
            return "apply the update (clipped); nothing to do but watch"
        return "apply the update"


_nan = math.nan
_CONTINUE = Action.CONTINUE
_new_verdict = tuple.__new__  # Verdict(...) without the keyword handling: the hot path
_NO_EVENTS: tuple[list[Event], ...] = ([], [], [], [])  # a step without events (only ever read)

# Types of StepMetrics fields already seen not to be torch tensors (numpy floats join on first
# sight), so that the full check costs one set lookup per field.
_HOST_TYPES = {float, int, bool, type(None)}
_FIELDS = ("step", "loss", "grad_norm", "log_z", "nan_frac", "loss_ema_ratio", "grad_scale")


def _check_host(m: StepMetrics) -> None:
    h = _HOST_TYPES
    if (type(m.loss) in h and type(m.grad_norm) in h and type(m.log_z) in h
            and type(m.nan_frac) in h and type(m.loss_ema_ratio) in h
            and type(m.grad_scale) in h and type(m.step) in h):
        return
    torch = sys.modules.get("torch")  # a tensor implies torch is imported: never import it here
    for name in _FIELDS:
        value = getattr(m, name)
        if torch is not None and isinstance(value, torch.Tensor):
            raise TypeError(
                f"StepMetrics.{name} is a torch.Tensor ({value.device}); SpikeDetector.update "
                f"takes host numbers: pass float({name}) (read it once, e.g. one step late). "
                "A tensor here would make every comparison in the detector a hidden device sync")
        if name == "step" and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
            raise TypeError(f"StepMetrics.step={value!r} must be an int")
        if value is not None and not isinstance(value, numbers.Real):
            raise TypeError(f"StepMetrics.{name}={value!r} must be a number (a float)")
        h.add(type(value))


def _file(events: tuple[list[Event], ...] | None, e: Event | list[Event], call: Any
          ) -> tuple[list[Event], ...]:
    """File the event(s) that ``call`` (a rule's bound ``update``) returned under the rule's
    tier. Most steps have none, so the four lists are made at the first event: ``events`` is
    None until then."""
    tier = call.__self__.tier
    if events is None:
        events = ([], [], [], [])
    if type(e) is list:
        events[tier].extend(e)
    else:
        events[tier].append(e)
    return events


def _metric(reason: str) -> str:
    return reason.split(" ", 1)[0]


class SpikeDetector:
    """Feed one :class:`StepMetrics` per step, in step order; get a :class:`Verdict` back.

    Windows count updates, not step indices. State (each rule's medians, EMAs, windows, runs)
    round-trips through ``state_dict`` / ``load_state_dict`` as JSON-ready plain data.

    On its own, in a loop without the Guard (``verdict.advice`` says the same in words)::

        detector = sg.SpikeDetector(sg.DetectorConfig.for_run(steps))
        for step in range(steps):
            out = model.loss(model(x), y)
            out.loss.backward()
            norm = sg.clip_grad_norm_(model.parameters(), 1.0)
            v = detector.update(sg.StepMetrics(step=step, loss=float(out.ce),
                                               grad_norm=float(norm), log_z=float(out.log_z)))
            if v.action is sg.Action.HALT:
                break                      # non-finite numbers: stop and look
            if not v.skip:                 # SKIP: a bad batch; drop its update
                optimizer.step()
                scheduler.step()
            optimizer.zero_grad()
            # v.tier == 2: restore a checkpoint if you keep them, else lower the LR (v.advice)

    A loop that acts only on ``skip`` and HALT is never left skipping: after
    ``max_consecutive_skips`` skips in a row the weights, not the batches, are the suspect
    (skipping cannot repair weights), so the detector pages (Tier 2) and recommends no more
    skips until ``arm_quiet`` steps in a row look healthy again.
    """

    def __init__(self, config: DetectorConfig | None = None) -> None:
        if config is not None and not isinstance(config, DetectorConfig):
            raise TypeError(f"SpikeDetector(config) takes a DetectorConfig (e.g. "
                            f"DetectorConfig.for_run(steps)), got {type(config).__name__}")
        self.config = config if config is not None else DetectorConfig()
        self.reset()

    def _build(self) -> dict[str, Rule]:
        c = self.config
        # the order of evaluation: within a tier, events at equal onsets keep this order
        return {"grad_spike": GradSpike(c), "loss_spike": LossSpike(c),
                "loss_ratio": LossRatio(c), "ratio_held": RatioHeld(c),
                "loss_halt": LossHalt(c), "skip_storm": SkipStorm(c),
                "loss_elevated": LossElevated(c), "log_z_drift": LogZDrift(c),
                "log_z_rise": LogZRise(c), "log_z_jump": LogZJump(c), "recovery": Recovery(c),
                "update_jump": UpdateJump(c), "scaler": ScalerOverflow(c),
                "non_finite": NonFinite()}

    @property
    def weights_reasons(self) -> tuple[str, ...]:
        """The Tier 2 reasons that name the weights, not the data: the log Z rules' and the
        twice-damaged event's (the guard's weights check suspects the weights after one)."""
        r = self._rules
        return (r["log_z_drift"].reason, r["log_z_rise"].reason, r["log_z_jump"].reason,
                r["skip_storm"].twice_reason)

    def _use(self, rules: dict[str, Rule]) -> None:
        self._rules = rules
        self._judge = [r for r in rules.values() if r.phase == "judge"]
        self._after = [r for r in rules.values() if r.phase == "after"]
        # the hot path's view of them: bound methods with their tiers, and only the rules and
        # folds that do something (the loop over rules is most of an update's cost); a loss-halt
        # rule without a vocabulary never fires and need not be called
        self._judge_calls = [r.update for r in self._judge
                             if not (type(r) is LossHalt and not r.on)]
        self._after_calls = [r.update for r in self._after]
        # a step without an update-ratio reading: the update-jump rule is silent and changes
        # nothing (a log without the column, a loop without the signals), so it is not called
        self._after_calls_unread = [r.update for r in self._after if type(r) is not UpdateJump]
        self._folds = [r.fold for r in self._judge if type(r).fold is not Rule.fold]
        # the rules whose numbers the verdict quotes (evidence and context)
        self._grad, self._ratio = rules["grad_spike"], rules["loss_ratio"]
        self._storm, self._loss = rules["skip_storm"], rules["loss_elevated"]
        self._zdrift, self._zrise = rules["log_z_drift"], rules["log_z_rise"]
        self._scaler, self._nonfinite_rule = rules["scaler"], rules["non_finite"]
        self._x = StepInput()

    def reset(self) -> None:
        """Forget all history (same config)."""
        self._use(self._build())
        self._arm_after = self.config.arm_after
        self._n_seen = 0   # updates that reached the rules (not non-finite, not overflows)
        self._n_clean = 0  # updates kept: they entered the histories

    @property
    def armed(self) -> bool:
        """True once ``arm_after`` unflagged updates have entered the histories."""
        return self._n_clean >= self.config.arm_after

    @property
    def grad_median(self) -> float:
        """Running median of the unflagged grad norms in the window; NaN while empty."""
        return self._grad.median.value

    @property
    def loss_ema(self) -> float:
        """Bias-corrected EMA of the unflagged losses: what the next step's loss_ema_ratio divides
        by. NaN before any history."""
        return self._ratio.ema.value

    def update(self, m: StepMetrics, *, released: bool | None = None, blind: bool = False,
               update_ratio: float | None = None, after_skip: bool = False) -> Verdict:
        """Judge one step. Call once per step, in order, with host floats (a torch.Tensor field
        raises TypeError: convert it with ``float(...)`` where a sync is acceptable).
        ``released``: the caller applied this step's update whatever Tier 1 says (the guard
        does when its weights check finds the weights, not the batch, at fault). A flagged
        step is then an ALERT with ``skip`` False, not counted towards a skip storm, and still
        kept out of every history (and watched for recovery, as a skip is). ``blind``: released
        without a test of the weights (no reference batch): it counts towards a storm as a skip
        would, since nothing showed the weights at fault. ``update_ratio``: the signals' reading
        of this step's update (``UpdateJump``), None without one. ``released`` None (the
        default): the detector decides, releasing flagged steps after a skip storm (class
        docstring; the fraction rule pages without releasing). ``after_skip``: the caller's
        weights check blamed the skipped step before on its batch: the storm test applies."""
        if type(m) is not StepMetrics and not isinstance(m, StepMetrics):
            raise TypeError(f"SpikeDetector.update takes a StepMetrics, got {type(m).__name__}")
        step, loss, g, lz, nf, given = (m.step, m.loss, m.grad_norm, m.log_z, m.nan_frac,
                                        m.loss_ema_ratio)
        # the common case in one cheap test; ints, None, numpy floats, tensors: the full check
        if not (type(loss) is float and type(g) is float and type(lz) is float
                and type(nf) is float and type(step) is int and given is None
                and m.grad_scale is None):
            _check_host(m)
        # nan_frac None: a log without the column; x - x is NaN unless x is finite
        if not ((nf is None or nf <= 0.0) and loss - loss == 0.0 and g - g == 0.0):
            # before any history: a NaN in a median or an EMA would poison it for its window
            return self._nonfinite(m)
        if self._scaler.run:
            self._scaler.clear()
        x = self._x  # one per detector, refilled: every field a rule reads is written first
        x.step, x.loss, x.grad_norm, x.log_z, x.given_ratio = (
            step, loss, g, _nan if lz is None else lz, given)
        x.skip = x.spike = x.loss_flag = False
        if released is None:  # the caller leaves it to the detector: release in a storm
            released = blind = self._storm.suspect
        x.released, x.blind, x.after_skip = released, released and blind, after_skip
        x.update_ratio = _nan if update_ratio is None else update_ratio
        j = self._n_clean
        x.i, x.j = self._n_seen, j
        x.armed = j >= self._arm_after
        self._n_seen += 1
        events = None
        for call in self._judge_calls:  # the rules, in declared order (the hot loop)
            e = call(x)
            if e is not None:
                events = _file(events, e, call)
        # a flagged step stays out of every history: the next steps are judged against the
        # run as it was, not against a level the anomaly itself has moved
        if x.skip or (events is not None and events[3]):
            x.kept, x.t1_onset = False, events[1][0][0] if x.skip else None
        else:
            x.kept, x.t1_onset = True, None
            for fold in self._folds:
                fold(x)
            self._n_clean = j + 1
        for call in self._after_calls if update_ratio is not None else self._after_calls_unread:
            e = call(x)
            if e is not None:
                events = _file(events, e, call)
        return self._decide(x, events)

    def _decide(self, x: StepInput, events: tuple[list[Event], ...] | None) -> Verdict:
        """The tier and action from the events (None: there were none), with the evidence behind
        them. A Tier 2 verdict is an ALERT: what it gets (a rollback, a question) is the caller's
        policy."""
        _, t1, t2, t3 = events or _NO_EVENTS
        advice, storm, lx = self._zdrift.advice, self._storm, self._loss
        evidence = {
            "grad_norm": x.grad_norm, "grad_median": self._grad.med, "loss": x.loss,
            "loss_ema": x.ema_prev, "loss_ema_ratio": x.ratio, "loss_ema50": x.short,
            "log_z": x.log_z, "log_z_median": self._zdrift.med, "log_z_rise": self._zrise.rise,
            "skips_in_window": storm.count,
        }
        if t3:
            tier, action = 3, Action.HALT
        elif t2:
            tier, action = 2, Action.ALERT
        elif t1:
            tier, action = 1, (Action.SKIP if x.skip and not x.released else Action.ALERT)
            ls = self._rules["loss_spike"]  # where the loss stood: for attribution's release
            evidence.update(loss_flag=x.loss_flag, loss_median=ls.med, loss_limit=ls.limit,
                            loss_spread=ls.noise, loss_bar_spreads=ls.z)
        elif advice:
            tier, action = 0, Action.ALERT
        else:
            return _new_verdict(Verdict, (x.step, 0, _CONTINUE, (), None, evidence, False))
        if lx.onset is not None:
            evidence["pre_spike_loss"] = lx.pre
            evidence["loss_elevated_steps"] = lx.count
            evidence["loss_elevated_nats"] = lx.spike_nats * lx.scale  # its level, noise-sized
        evidence["skips_consecutive"] = storm.run
        if x.update_ratio == x.update_ratio:  # a reading: the update_jump rule's numbers
            evidence["update_ratio"] = x.update_ratio
            evidence["update_ratio_median"] = self._rules["update_jump"].median.value
        return self._verdict(x.step, tier, action, t3 + t2 + t1, advice, evidence,
                             (x.skip and not x.released) or tier == 3)

    def _verdict(self, step: int, tier: int, action: Action, fired: list[Event],
                 advice: bool, evidence: dict[str, float], skip: bool) -> Verdict:
        # Order: by onset; at equal onsets a metric's own rule comes before a derived one (skip
        # storms), then higher tiers first, then the rules' evaluation order (a stable sort of
        # tier 3 + tier 2 + tier 1 events).
        items = [(step if o is None else o, _metric(reason) == "skips", reason)
                 for o, reason in fired]
        seen = {_metric(reason) for _, _, reason in items}
        # metrics in an excursion that did not fire themselves: the verdict names them as
        # context, dated by their own runs, so that the first reason is the first to move
        for onset, reason in ((self._grad.onset, self._grad.context),
                              (self._zdrift.onset, self._zdrift.context),
                              (self._loss.onset, self._loss.context)):
            if onset is not None and _metric(reason) not in seen:
                items.append((onset, False, reason))
        items.sort(key=lambda t: (t[0], t[1]))
        reasons = [reason for _, _, reason in items]
        if advice:
            reasons.append("add or raise z-loss")
        onset = items[0][0] if items else step
        return Verdict(step, tier, action, tuple(dict.fromkeys(reasons)), onset, evidence, skip)

    def _nonfinite(self, m: StepMetrics) -> Verdict:
        evidence = {"loss": m.loss, "grad_norm": m.grad_norm, "log_z": m.log_z,
                    "nan_frac": m.nan_frac, "grad_median": self._grad.median.value}
        if m.grad_scale is not None:
            e = self._scaler.update(m.step, m.grad_scale)
            evidence["grad_scale"] = m.grad_scale
            evidence["scaler_overflows"] = self._scaler.run
            if e is None:
                return Verdict(m.step, 0, Action.SKIP, ("scaler",), m.step, evidence, True)
            return self._verdict(m.step, 3, Action.HALT, [e], False, evidence, True)
        return self._verdict(m.step, 3, Action.HALT, self._nonfinite_rule.update(m), False,
                             evidence, True)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly: JSON-ready plain data."""
        return {
            "version": _STATE_VERSION,
            "config": self.config.to_dict(),
            "updates": {"seen": self._n_seen, "kept": self._n_clean},
            "rules": {name: rule.state_dict() for name, rule in self._rules.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict``; the config must match this detector's. On an error the
        detector is left as it was."""
        version = state.get("version")
        if version == 5:
            state = _from_v5(state, self.config)
            version = 6
        if version == 6:
            state = _from_v6(state, self.config)
            version = 7
        if version == 7:
            state = _from_v7(state)
            version = 8
        if version == 8:
            state = _from_v8(state, self.config)
            version = 9
        if version == 9:
            state = _from_v9(state)
            version = _STATE_VERSION
        if version != _STATE_VERSION:
            raise ValueError(
                f"detector state version {version!r} cannot be loaded: this spikeguard reads "
                f"version {_STATE_VERSION} (one entry per rule). Resume with the spikeguard that "
                "saved it, or drop the saved detector state and start a fresh SpikeDetector: it "
                f"re-arms after arm_after={self.config.arm_after} updates")
        mine = self.config.to_dict()
        diff = sorted(k for k, v in state["config"].items() if mine.get(k) != v)
        if diff:
            raise ValueError(f"detector state was saved with a different DetectorConfig "
                             f"(fields {diff}); build the detector with the saved config")
        rules = self._build()
        # a rule newer than the state starts fresh (it fills its own window); one this
        # detector does not know is an error
        unknown = set(state["rules"]) - set(rules)
        if unknown or not set(state["rules"]) >= set(rules) - _NEWER_RULES:
            raise ValueError(f"detector state has rules {sorted(state['rules'])}, expected "
                             f"{sorted(rules)}")
        for name, rule in rules.items():
            if name in state["rules"]:
                rule.load_state_dict(state["rules"][name])
        self._use(rules)
        self._n_seen = int(state["updates"]["seen"])
        self._n_clean = int(state["updates"]["kept"])

"""GuardConfig: what the guard does; every threshold of its decisions lives in ``detector``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .._validate import check_int, check_positive
from ..detector.config import DetectorConfig
from ..measure.probes import ProbeConfig
from ..prevent.clipping import ClipConfig
from .arguments import check_nested
from .attribution import AttributionConfig
from .responses.lower_lr import LowerLrConfig

__all__ = ["GuardConfig"]


@dataclass(kw_only=True, frozen=True)
class GuardConfig:
    """What the guard does; every threshold of its decisions lives in ``detector``."""

    detector: DetectorConfig = field(default_factory=DetectorConfig)
    """Thresholds of every tier (DetectorConfig.for_run(total_steps) sizes them for short runs)."""
    clip: float | None = 1.0
    """Clip the global gradient norm to this value; None turns clipping off (never 0 or < 0)."""
    clipping: ClipConfig = field(default_factory=ClipConfig)
    """The adaptive clipping rule (--clip-mode) beside the fixed threshold, which stays a ceiling."""
    tier2: Literal["alert", "rollback", "ask"] = "alert"
    """Tier 2: alert (page with a summary and go on), rollback (needs checkpoints) or ask (page a
    person and apply their answer: Guard(oncall=...), docs/on-call.md)."""
    max_rollbacks: int = 3
    """Rollbacks (and reconfigured resumes) allowed in one run; the next one halts instead."""
    rollback_lr_scale: float = 0.5
    """A rollback replays the steps it rolled back at this multiple of the LR, ramping back to
    1 linearly by the step that detected the anomaly (a second rollback into the same stretch
    multiplies it again), so the replay does not retrace the path that failed."""
    rollback_lr_keep: bool = True
    """A rollback into the stretch the last one replayed (the trouble came back once the LR was
    back) keeps its replay's LR for good instead of ramping back: 0.25x, then 0.125x (the
    record's ``lr_kept``). False: every replay ramps back to the scheduled LR."""
    rollback_qk_clip: bool = True
    """A rollback whose page names the attention logits as a cause (their bound past
    ``detector.qk_advice_bound`` and ``qk_advice_growth`` times its start, guard/remedies.py)
    also turns QK-Clip on at ``detector.qk_advice_bound`` for the replay and the rest of the run
    (the record's ``qk_clip``; kept across a resume): the page's remedy, applied without waiting
    for a person, since the checkpoint it goes back to already holds the grown query and key
    weights and a lower LR does not shrink them. Needs the guard's signals (without them the
    record says why it was not turned on). False: the rollback only lowers the LR; QK-Clip
    rescales the query and key weights of every head whose bound passes the threshold."""
    probes: ProbeConfig = field(default_factory=ProbeConfig)
    """Which probes run and how often, when the guard is built with probes=True."""
    signals: bool = True
    """Built without probes (Guard(probes=None)), the guard still reads the early-warning signals
    of probes.signals (the update ratio every step from its sample, the spike share and the
    logit bound every tenth), the other probes off: the update-ratio rule (Tier 2 at the update
    an LR or optimizer fault makes) needs them. False, or Guard(probes=False): none."""
    read_lag: int | None = None
    """Steps between a step and the host reading its numbers: 0, 1, or None (1 on CUDA, else 0)."""
    respond: bool = True
    """Act on verdicts (skip, roll back, halt); False only measures and records (a baseline)."""
    attribution: AttributionConfig = field(default_factory=AttributionConfig)
    """After a skip: re-run it (data or transient?), quarantine outlier sequences, drop them."""
    weights_check: bool = True
    """Before a flagged step stays skipped, re-run a kept batch from reference_age kept steps
    back under the same weights: if it fails the gate too, the weights are the cause and the
    clipped update goes through (a skip cannot repair weights). Needs guard.step(rerun=...)."""
    reference_age: int = 16
    """How many kept steps back the weights check's reference batch is (an older batch is no
    longer fitted by the updates since, so it tests the weights as a fresh one would)."""
    lr_jump: float = 2.0
    """Withhold, before it is applied, an update whose scheduled LR rose more than this times the
    largest step-to-step LR ratio the run has made (guard/lr_jump.py); 0 turns it off, for a
    schedule with warm restarts or an LR raised on purpose mid-run."""
    token_z: float = 10.0
    """Skip a batch whose input token ids (``guard.step(tokens=x)``) average a surprise under
    the run's own token frequencies more than this many of its own spreads from the median of
    the last 64 kept batches, either way (guard/tokens.py). Clean text passed 10 in none of
    the batches measured (benchmarks/token_far.py); 0 turns it off. Without ``tokens=`` the
    check never runs."""
    lower_lr: LowerLrConfig = field(default_factory=LowerLrConfig)
    """On a Tier 2 verdict, also lower the LR for some steps (off: steps=0; responses/lower_lr.py)."""

    def __post_init__(self) -> None:
        if self.clip is not None:
            check_positive(self.clip, "GuardConfig.clip", default=1.0,
                           hint="None turns clipping off; a negative value would ascend")
        if self.tier2 not in ("alert", "rollback", "ask"):
            raise ValueError(f"GuardConfig.tier2={self.tier2!r} must be 'alert', 'rollback' or "
                             "'ask'")
        if self.lr_jump != 0:
            check_positive(self.lr_jump, "GuardConfig.lr_jump", default=2.0,
                           hint="0 turns the LR-jump check off")
            if self.lr_jump < 1.0:
                raise ValueError(f"GuardConfig.lr_jump={self.lr_jump} must be 0 (off) or >= 1 "
                                 "(below 1 every rising step of a warmup would be withheld)")
        if self.token_z != 0:
            check_positive(self.token_z, "GuardConfig.token_z", default=10.0,
                           hint="0 turns the input-token check off")
        check_int(self.max_rollbacks, "GuardConfig.max_rollbacks", minimum=0, default=3)
        check_int(self.reference_age, "GuardConfig.reference_age", minimum=1, default=16)
        check_positive(self.rollback_lr_scale, "GuardConfig.rollback_lr_scale", default=0.5)
        if self.rollback_lr_scale > 1.0:
            raise ValueError(f"GuardConfig.rollback_lr_scale={self.rollback_lr_scale} must be "
                             "<= 1 (1 replays at the scheduled LR; 0.5 is the default)")
        for name in ("weights_check", "signals", "rollback_lr_keep", "rollback_qk_clip"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GuardConfig.{name}={getattr(self, name)!r} must be True "
                                 "or False")
        check_nested(self)
        if self.read_lag not in (None, 0, 1):
            raise ValueError(f"GuardConfig.read_lag={self.read_lag!r} must be 0, 1 or None (auto)")

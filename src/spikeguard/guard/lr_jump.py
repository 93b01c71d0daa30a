"""The learning rate against its own history: an update whose own size is the anomaly is never
applied.

No gradient clip bounds what a learning rate gone wrong does (docs/design.md, the clip), and the
weights check's "the weights are at fault, let the clipped update through" is the wrong repair
when the LR is what jumped: every such update moves the weights as far again. The LR the
optimizer is about to use is known on the host before the step (``param_groups``' ``lr``: no
device read), so a jump is withheld BEFORE it is applied.

The bar is a statement about this run's own LR changes, not a tuned constant: a schedule made
of smooth pieces (linear warmup, cosine, WSD's stable and decay phases, constant) never makes a
step-to-step ratio larger than the largest it has already made: linear warmup's ratios
``(t + 1) / t`` fall from their first (2 from step 1 to 2), cosine and the decays are at most 1.
A step whose LR is more than ``margin`` (2) times that largest ratio above the LR of the last
step that passed is a jump. False alarms: none on any of those schedules (their ratios never
grow); an exponential warmup, whose ratio is constant, stays at half the bar; only a schedule
that doubles its own largest step-to-step change (a restart of a cosine with a warm restart to a
higher LR, a person raising the LR by hand) is withheld, and then paged. Detection: the first
step of an LR x3 or more after a constant or decaying schedule (ratios 1: bar 2), or of x5 or
more right after a linear warmup's first step (bar 4).

The guard's own multipliers (a replay's ramp, a reconfigure, a response's stretch) are the
guard's decisions and are divided out: only the scheduled LR is judged. The LR a jump is
measured against is that of the last step that passed, so while a transient lasts every step of
it is withheld, and the episode (``open``) is one incident: its first step is the Tier 2, the
rest Tier 1 skips. ``open`` lives outside the run's timeline (a rollback does not reopen it).

An anomaly seen after the fact (the update ratio's Tier 2 at the update itself, any Tier 2, or
the weights check finding the weights at fault) on an update whose LR had risen past the bar
times the median LR of the last ``window`` (32) steps that passed (a ramp whose every step is
under the bar) makes that LR the suspect: the median becomes a ``ceiling``, and until the LR is
back under ``ceiling`` times the bar every step is withheld as a jump (the weights check never
releases an update at that LR). At an LR in its usual range such a verdict changes nothing here.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from ..record import Action

__all__ = ["LrJump", "lr_judged"]


class LrJump:
    """The scheduled LR against its own step-to-step changes (module docstring)."""

    def __init__(self, margin: float = 2.0, window: int = 32) -> None:
        self.margin = margin
        """The bar is this times the largest step-to-step ratio the run's LR has made (at least
        1); 0: the check is off (``GuardConfig.lr_jump``)."""
        self.last: float | None = None
        """The scheduled LR of the last step that passed."""
        self.recent: deque[float] = deque(maxlen=window)
        """The LRs of the last ``window`` steps that passed (the ceiling is their median)."""
        self.largest = 1.0
        """The largest step-to-step ratio of the steps that passed."""
        self.ratios = 0
        """Step-to-step ratios seen (a launcher that steps the schedule once per process, as
        accelerate does, makes a warmup's first ratio 3 or more)."""
        self.ceiling: float | None = None
        self.onset: int | None = None
        """The first step at the risen LR of the last anomaly after the fact."""
        self.open = False
        """A jump is in progress (its first step was the incident; the rest are skips)."""

    @property
    def bar(self) -> float:
        return self.margin * max(self.largest, 1.0)

    def test(self, lr: float | None) -> tuple[bool, str | None]:
        """Whether the step about to run at the scheduled ``lr`` is withheld as a jump, and the
        reason. A step that passes becomes the reference."""
        if lr is None or not lr == lr or lr <= 0.0:
            return False, None
        bar = self.bar
        if self.ceiling is not None:
            if lr > self.ceiling * bar:
                return True, (f"lr {lr:.4g} above {bar:.3g}x {self.ceiling:.4g}, the median lr before "
                              "the anomaly at a risen lr: withheld")
            self.ceiling = None
        if self.last is not None and self.last > 0.0:
            ratio = lr / self.last
            self.ratios += 1  # the first ratio has no history to be judged against: it is learned
            if ratio > bar and self.ratios > 1:
                return True, (f"lr jump: lr {lr:.4g} is {ratio:.3g}x the last step's "
                              f"{self.last:.4g} (bar {bar:.3g}: {self.margin:g}x the largest "
                              f"step-to-step ratio of this run's schedule, {self.largest:.3g})")
            self.largest = max(self.largest, ratio)
        self.last = lr
        self.recent.append(lr)
        return False, None

    def starts(self) -> bool:
        """A withheld jump: True when it opens an episode (its first step: the incident)."""
        first, self.open = not self.open, True
        return first

    def passed(self) -> None:
        """A step no rank withheld for its LR: an episode is over (the host side, agreed)."""
        self.open = False

    def anomaly(self, step: int) -> bool:
        """A Tier 2 or a weights-at-fault verdict on the update of ``step`` (the last that
        passed): when its LR had left its recent range (above the bar times their median), the
        LR is the suspect: hold it under that median (module docstring), and date the trouble
        from the first of the steps in a row above that range (``onset``). The next withheld
        step opens the episode: the weights were moved, so it is the incident. Returns whether
        a ceiling was set."""
        if not self.recent or self.last is None:
            return False
        ordered = sorted(self.recent)
        median = ordered[(len(ordered) - 1) // 2]
        high = median * self.bar
        if self.last <= high:
            return False
        risen = 0
        for lr in reversed(self.recent):
            if lr <= high:
                break
            risen += 1
        self.ceiling, self.open, self.onset = median, False, step - risen + 1
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"last": self.last, "recent": list(self.recent), "largest": self.largest,
                "ceiling": self.ceiling, "ratios": self.ratios}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        # ``open`` and a ceiling set are outside the timeline: a rollback during a jump neither
        # makes a new incident nor lifts the ceiling
        if not state:
            return
        self.last = state["last"]
        self.recent.clear()
        self.recent.extend(float(v) for v in state.get("recent", ()))
        self.largest = float(state["largest"])
        self.ratios = int(state.get("ratios", 2))
        if self.ceiling is None:
            self.ceiling = state["ceiling"]


def lr_judged(jump: LrJump, p: Any, out: Any, respond: bool) -> Any:
    """An update whose own size is the anomaly is never applied: a step withheld for its LR
    (``p.lr_jump``) is a Tier 1 skip, the first of an episode a Tier 2 dated at itself (a page:
    nothing reached the weights); an anomaly seen after the fact on an update whose LR had left
    its recent range holds the LR under that range from the next step on (``LrJump.anomaly``),
    and the first step it withholds is the Tier 2, dated at the first step at the risen LR (the
    weights were moved: a rollback's incident)."""
    v = out.verdict
    if p.lr_jump is not None and v.tier < 3:
        tier = 2 if jump.starts() else max(v.tier, 1)
        out.cause = "lr"
        out.verdict = v._replace(tier=max(v.tier, tier), reasons=(*v.reasons, p.lr_jump),
                                 action=Action.SKIP if tier == 1 else Action.ALERT,
                                 onset_step=(p.lr_onset or p.step) if tier == 2
                                 else v.onset_step, skip=True)
    elif p.lr_jump is None:
        jump.passed()
        if respond and jump.margin and (v.tier == 2 or out.cause == "weights"):
            jump.anomaly(p.step)
    return out

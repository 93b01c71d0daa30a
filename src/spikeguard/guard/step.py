"""The step part: measure, gate, clip, apply. The one owner of the update: the one place an
update is applied, withheld, released, re-applied, counted, and its LR scaled.

``Updater.device_step`` takes the step's mean loss and log Z (device tensors) after backward:

1. **measure**: unscale under fp16, then ``grad_stats``: the global norm with the loss and log Z
   averaged over data ranks, in one all-reduce;
2. **gate**: the DeviceGate's 0-d bool (non-finite, or the Tier 1 test once armed);
3. **clip** with ``min(1, clip / (norm + 1e-6))``, or the adaptive rule of ``ClipConfig``
   (``prevent/clipping.py``: z-score, per-tensor EMA, per-element spikes) under that ceiling;
4. **apply** through ``apply_update``: on fused AdamW the gate becomes ``found_inf`` for this
   step (no host read); other optimizers read the gate once and are not called on a skip.
   With ``ClipConfig.update_bound`` the applied update is then bounded against its own EMA
   (``guard/update_bound.py``), in this step, a release and a re-run's update alike.

No host read on a healthy or skipped step. The other stages never touch the update: they
return requests, and the guard hands them here. ``weights_at_fault`` (the weights check's
answer: release the withheld update now at read_lag 0, or the following steps at read_lag 1),
``release`` (attribution's: a skip with no evidence against its batch), ``apply_without``
(attribution's drop: the re-run without some rows, through the same measure, the same gate test
against the histories as they are, the same clip and ``apply_update``), ``lr`` (a response's
LR multiplier over a range of steps: ``lr_scale.py``). ``settle(update)`` is the host side, once
the step's numbers are read: it counts what happened to the update and steps the LR schedule
for an applied one (and for a loss-scaler overflow, which the guard does not withhold: the
scaler does). ``read_lag``, decided once when the guard is built, lives here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..detector.gate import DeviceGate
from ..measure.gradnorm import GradStats, grad_stats
from ..measure.precision import PrecisionRuntime
from ..prevent.clipping import ClipConfig, Clipper
from .adapter import GuardMisuseWarning
from .grads_aside import GradsAside
from .lr_jump import LrJump
from .lr_scale import LrScale
from .outcome import Update
from .reading import Pending, StepReading
from .tokens import TokenCheck
from .update_bound import UpdateBound

__all__ = ["GradsAside", "RerunUpdate", "ScalerState", "Updater", "apply_update",
           "gated_step", "loss_of"]


def gated_step(optimizer: torch.optim.Optimizer, gate: torch.Tensor | bool) -> None:
    """``optimizer.step()`` unless ``gate`` is true (1.0 / True = skip).

    A 0-d tensor gate on an optimizer that takes ``found_inf`` (fused Adam/AdamW/SGD) goes in as
    ``optimizer.found_inf`` for this step only: no host read, and the fused kernel leaves params,
    moments and the step count untouched, NaN gradients included. Any other optimizer reads the
    gate once on the host and is not called on a skip.
    """
    if not isinstance(gate, torch.Tensor):
        if not gate:
            optimizer.step()
        return
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        if not bool(gate):  # the one host read of the generic path
            optimizer.step()
        return
    # one tensor for every device: the fused kernels copy it to each param device themselves
    optimizer.found_inf = gate.detach().to(torch.float32).reshape(())
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf


def apply_update(precision: PrecisionRuntime, optimizer: torch.optim.Optimizer, *,
                 skip: torch.Tensor | bool = False) -> None:
    """Apply the update unless ``skip``; under fp16 the scaler also skips on its own overflow,
    and its scale is updated from the overflow alone (spikeguard.measure.precision)."""
    scaler = precision.scaler
    if scaler is None:
        gated_step(optimizer, skip)
        return
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        from torch.amp.grad_scaler import OptState

        gate = precision.overflow(optimizer)
        if isinstance(skip, torch.Tensor):
            gate = torch.maximum(gate, skip.detach().to(gate.device, torch.float32).reshape(()))
        elif skip:
            gate = torch.ones_like(gate)
        gated_step(optimizer, gate)
        scaler._per_optimizer_states[id(optimizer)]["stage"] = OptState.STEPPED
    else:
        precision.unscale_(optimizer)  # update() needs the overflow check that unscale_ records
        if not (bool(skip) if isinstance(skip, torch.Tensor) else skip):
            scaler.step(optimizer)
    scaler.update()


@contextlib.contextmanager
def _scaled_lr(optimizer: torch.optim.Optimizer, factor: float) -> Iterator[None]:
    """Every group's LR times ``factor`` for one optimizer step, then as it was (the scheduler
    never sees the change)."""
    if factor == 1.0:
        yield
        return
    saved = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = g["lr"] * factor
    try:
        yield
    finally:
        for g, lr in zip(optimizer.param_groups, saved):
            g["lr"] = lr


def loss_of(out: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, log Z) as float32 0-d tensors from what a ``rerun`` closure returned, as
    ``guard.accumulate`` takes them: a LossOutput, a 0-d loss, a list of either (micro-batches:
    their mean) or None (NaN)."""
    if isinstance(out, (list, tuple)) and not hasattr(out, "log_z"):
        pairs = [loss_of(o, device) for o in out]
        return (torch.stack([p[0] for p in pairs]).mean(), torch.stack([p[1] for p in pairs]).mean())
    nan = torch.full((), math.nan, device=device)
    if hasattr(out, "ce") and hasattr(out, "log_z"):
        return out.ce.detach().float().reshape(()), out.log_z.detach().float().reshape(())
    if isinstance(out, torch.Tensor) and out.numel() == 1:
        return out.detach().float().reshape(()), nan
    return nan, nan


@dataclass
class RerunUpdate:
    """What ``apply_without`` did: the re-run's numbers and whether its update was applied."""

    loss: float
    grad_norm: float
    applied: bool
    weighed: bool = True
    """Whether ``guard.backward`` weighed the re-run's loss (a closure that calls
    ``loss.backward()`` itself bypasses it: then each rank's loss is its own mean)."""
    grads: list[Any] | None = None
    """Under ``guard.decide()``: the applied re-run's gradients, for the framework to step on."""
    passes: bool = False
    """The re-run's loss and grad norm pass the gate's test (applied or not)."""


class Updater:
    """The step part (module docstring): the one owner of the update. It applies, withholds,
    releases and re-applies; ``settle`` counts what happened (``applied``, ``withheld``) and
    steps the LR schedule; ``lr`` holds the LR multipliers; ``read_lag`` (0 or 1, decided once
    by the guard) says whether a step's gradients are still in place when its numbers are read.
    ``loss_weight`` is what ``backward`` multiplies the loss by (1 except in a re-run without
    quarantined rows), ``backwards`` counts its calls."""

    def __init__(self, params: list[torch.Tensor], optimizer: torch.optim.Optimizer,
                 precision: PrecisionRuntime, gate: DeviceGate, *, clip: float | None,
                 respond: bool, read_lag: int, scheduler: Any = None, pp_group: Any = None,
                 tp_group: Any = None, clipping: ClipConfig | None = None,
                 lr_jump: float = 2.0, tokens: TokenCheck | None = None) -> None:
        self.params, self.optimizer, self.precision, self.gate = params, optimizer, precision, gate
        self.clip, self.respond, self.scheduler = clip, respond, scheduler
        self.read_lag = read_lag
        self.clipper = Clipper(clipping, clip, params)
        c = self.clipper.config
        self.bound = UpdateBound(c.update_bound, c.update_beta, c.warmup, params,
                                 pp_group=pp_group, tp_group=tp_group)
        self.pp_group, self.tp_group = pp_group, tp_group
        self.applied = 0
        self.withheld = 0
        """Updates the guard withheld (skips, halts), loss-scaler overflows not included."""
        self.loss_weight, self.backwards = 1.0, 0
        self.lr = LrScale()
        """The multipliers of the scheduled LR (a replay's ramp, a reconfigure, a response)."""
        self.lr_jump = LrJump(lr_jump)
        """The scheduled LR against its own history: a jump is withheld (``lr_jump.py``)."""
        self.tokens = tokens if tokens is not None else TokenCheck(0.0, 1)
        """The batch's input tokens against the run's: garbage is withheld (``tokens.py``)."""
        self._warned_lr = False
        self._release_following = False
        # withhold only non-finite steps from the next step on (read_lag 1, after the weights
        # check found the weights at fault: the step it judged has lost its gradients already)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` through the loss scaler, weighted by ``loss_weight``."""
        if self.loss_weight != 1.0:
            loss = loss * self.loss_weight
        self.backwards += 1
        self.precision.scale(loss).backward()

    def measure(self, loss: torch.Tensor, log_z: torch.Tensor,
                flags: torch.Tensor | None = None) -> GradStats:
        """Unscale (fp16), then one all-reduce: global norm, loss and log Z over data ranks (and
        ``flags``, this rank's withhold flags, the LR jump's and the input tokens': each above 0
        after the mean when it is up on any rank, so every rank withholds alike)."""
        self.precision.unscale_(self.optimizer)
        extras = [loss, log_z] if flags is None else [loss, log_z, *flags.to(loss.dtype)]
        return grad_stats(self.params, extras=torch.stack(extras),
                          pp_group=self.pp_group, tp_group=self.tp_group,
                          per_tensor=self.clipper.per_tensor)

    def device_step(self, loss: torch.Tensor, log_z: torch.Tensor, lr_factor: float = 1.0, *,
                    apply: bool = True, jumped: bool = False,
                    tokens: tuple[torch.Tensor, torch.Tensor] | None = None,
                    ) -> tuple[GradStats, StepReading]:
        """Measure, gate, clip, apply (module docstring); ``apply=False`` (``guard.decide()``)
        applies nothing: the framework steps its optimizer on the gradients in place;
        ``jumped`` (a host decision: the LR jumped, ``lr_jump.py``) withholds it, and so does
        the input tokens' flag (``tokens``: this rank's (score, flag), ``tokens.py``). Returns
        the GradStats and the step's ``StepReading`` as 0-d device tensors."""
        dev, no = loss.device, torch.zeros((), dtype=torch.bool, device=loss.device)
        score = tokens[0].to(dev) if tokens is not None else torch.full((), math.nan, device=dev)
        flags = (torch.stack([torch.full((), float(jumped), device=dev),
                              (tokens[1].to(dev) if tokens is not None else no).float()])
                 if self.respond else None)
        stats = self.measure(loss, log_z, flags)
        loss_g, log_z_g = stats.extras[0], stats.extras[1]
        any_jump = stats.extras[2] > 0 if flags is not None else no
        any_tokens = stats.extras[3] > 0 if flags is not None else no
        armed = self.gate.armed()
        gate = self.gate(stats.norm, loss_g)
        if not self.respond:
            skip = torch.zeros_like(gate)
        elif self._release_following:
            skip = ~torch.isfinite(stats.norm) | ~torch.isfinite(loss_g)
        else:
            skip = gate
        if self.respond:  # the agreed flags: host values on one rank, the same device bools on all
            skip = skip | any_jump.to(skip.device) | any_tokens.to(skip.device)
        coef = (self.clipper.clip_(stats, self.optimizer, skip) if self.clipper.active
                else torch.ones_like(stats.norm))
        bounded = None
        if apply:
            withhold = skip if self.respond else False
            bounded = self._apply(lambda: apply_update(self.precision, self.optimizer,
                                                       skip=withhold), withhold, lr_factor)
        if bounded is None:
            bounded = torch.ones_like(stats.norm)
        scale = self.precision.scale_tensor()
        if scale is None:
            scale = torch.full((), float("nan"), device=stats.norm.device)
        return stats, StepReading(loss_g, log_z_g, stats.norm, skip, armed, coef, scale, gate,
                                  bounded, any_jump, any_tokens, score)

    def _apply(self, step: Callable[[], None], skip: torch.Tensor | bool,
               factor: float) -> torch.Tensor | None:
        """Run ``step`` (the optimizer's step, gated by ``skip``) at the LR times ``factor``,
        under the update bound when it is on (``guard/update_bound.py``: the weights copied
        before, the update bounded after). Returns the bound's coefficient, None when off."""
        if self.bound.active:
            self.bound.before()
        with _scaled_lr(self.optimizer, factor):
            step()
        return self.bound.after(skip, factor) if self.bound.active else None

    def release(self, p: Pending) -> bool:
        """Apply the update the gate withheld at step ``p`` after all, if its gradients are still
        in place (read_lag 0; clipped already; the scaler's overflow check and update ran with
        the step, and a released step is finite). Returns whether it was released (under
        ``guard.decide()`` the framework applies it)."""
        if not p.grads_alive:
            return False
        if not p.framework:
            self._apply(lambda: gated_step(self.optimizer, False), False, p.lr_factor)
        return True

    def weights_at_fault(self, p: Pending, fault: bool, *, withheld: bool) -> bool:
        """The weights check's answer for the flagged step ``p``: when the weights are at
        fault the withheld update goes through, now (read_lag 0) or, with its gradients gone
        (read_lag 1), as the steps after it do until a check finds the weights healthy. Returns
        whether step ``p``'s own update was released."""
        self._release_following = fault and not p.grads_alive
        return fault and withheld and self.release(p)

    def healthy(self) -> None:
        """A kept step: the weights are not at fault (ends a release of the following steps)."""
        self._release_following = False

    def set_aside(self, probes: Any) -> GradsAside:
        """Put the gradients in place aside (and the probes quiet) for a re-run."""
        return GradsAside(self.params, self.precision, probes)

    def put_back(self, aside: GradsAside, p: Pending, *, applied: bool,
                 redo: Callable[[], None] | None) -> None:
        """Bring back what ``set_aside`` took. At read_lag 1 the gradients in place are the next
        step's, taken at the old weights: when an update was applied meanwhile they are stale,
        and ``redo`` re-runs the next step at the new weights (or they are brought to the new
        loss scale without one)."""
        stale = applied and not p.grads_alive
        aside.restore(stale=stale, redo=redo if stale else None)

    def settle(self, update: Update) -> None:
        """The host side of a resolved step: count it and step the LR schedule for an applied
        update, and for a loss-scaler overflow (the detector's Tier 0), which the guard did not
        withhold: the schedule steps as in torch's AMP recipe (``scaler.step``, then
        ``scheduler.step()`` every iteration), so a run the guard never acts on follows the
        plain loop's schedule exactly. A withheld update holds the schedule."""
        if update is Update.WITHHELD:
            self.withheld += 1
            return
        if update is not Update.OVERFLOW:
            self.applied += 1
        if self.scheduler is not None:
            self.scheduler.step()

    def reconfigure(self, kind: str, model: Any) -> None:
        """Train on under the precision ``kind`` (a reconfigured resume)."""
        policy = dataclasses.replace(self.precision.policy, kind=kind)
        self.precision = policy.runtime(model)

    def state_dict(self) -> dict[str, Any]:
        """Counters, the LR multipliers, the clipping rule's and the update bound's statistics
        (JSON-ready; a host read)."""
        return {"applied": self.applied, "withheld": self.withheld, "lr": self.lr.state_dict(),
                "clip": self.clipper.state_dict(), "update_bound": self.bound.state_dict(),
                "lr_jump": self.lr_jump.state_dict(), "tokens": self.tokens.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.applied, self.withheld = int(state["applied"]), int(state["withheld"])
        self.lr.load_state_dict(state["lr"])
        self.clipper.load_state_dict(state.get("clip"))
        self.bound.load_state_dict(state.get("update_bound"))
        self.lr_jump.load_state_dict(state.get("lr_jump"))
        self.tokens.load_state_dict(state.get("tokens"))

    def current_lr(self) -> float | None:
        """The first param group's LR (a number, or a 0-d CPU tensor: no device read); None,
        with a GuardMisuseWarning once, when there is none (the record's ``lr`` is then null)."""
        groups = self.optimizer.param_groups
        lr = groups[0].get("lr") if groups else None
        if isinstance(lr, torch.Tensor) and lr.numel() == 1 and lr.device.type == "cpu":
            lr = lr.item()
        if isinstance(lr, (int, float)) and not isinstance(lr, bool):
            return float(lr)
        if not self._warned_lr:
            self._warned_lr = True
            found = "no param groups" if not groups else f"param_groups[0]['lr'] = {lr!r}"
            warnings.warn(f"the guard cannot read the learning rate ({type(self.optimizer).__name__}"
                          f" has {found}), so the records' lr is null; give the guard the "
                          "optimizer whose param_groups carry a float 'lr' (the inner one of a "
                          "container)", GuardMisuseWarning, stacklevel=4)
        return None

    def measure_rerun(self, out: Any, *, unscale: bool = False,
                      weight: float = 1.0) -> tuple[float, float, float, GradStats]:
        """(loss, log Z, grad norm, GradStats) of the gradients a re-run left (loss and log Z
        times ``weight``), all-reduced as the step's own: one collective, then a host read.
        Without ``unscale`` an fp16 norm is divided by the scale on the host instead."""
        dev = self.precision.device
        loss, log_z = (v * weight for v in loss_of(out, dev))
        scale = 1.0
        if unscale:
            self.precision.unscale_(self.optimizer)
        elif self.precision.scaler is not None:
            scale = self.precision.grad_scale()
        stats = grad_stats(self.params, extras=torch.stack([loss.to(dev), log_z.to(dev)]),
                           pp_group=self.pp_group, tp_group=self.tp_group)
        n, lo, lz = torch.stack([stats.norm.double(), stats.extras[0].double(),
                                 stats.extras[1].double()]).tolist()
        return lo, lz, n / scale, stats  # a power-of-two loss scale divides exactly

    def apply_without(self, p: Pending, keep: torch.Tensor, weight: float, *,
                      apply: bool = True) -> RerunUpdate:
        """Attribution's request: re-run step ``p`` with only the rows ``keep`` marks, each
        rank's loss weighted by ``weight`` (through ``backward``); apply that update if it passes
        the gate's test (under ``guard.decide()``: keep its gradients for the framework). Runs
        with the step's gradients set aside. ``apply`` False: only the gate's answer
        (``passes``), nothing applied and the loss scaler left as it was (the norm is unscaled
        on the host)."""
        for param in self.params:  # the verifying re-run's gradients
            param.grad = None
        calls, self.loss_weight = self.backwards, weight
        try:
            out = p.rerun(keep=keep)
        finally:
            self.loss_weight = 1.0
        weighed = self.backwards != calls
        loss, _, norm, stats = self.measure_rerun(out, unscale=apply,
                                                  weight=weight if weighed else 1.0)
        dev = stats.norm.device
        gate = self.gate.test(torch.tensor(norm, dtype=torch.float64, device=dev),
                              torch.tensor(loss, dtype=torch.float64, device=dev))
        passes = not bool(gate)
        ok = passes and apply
        if ok and self.clip is not None:
            stats.clip_(self.clip)
        grads = None
        if p.framework:
            grads = [param.grad for param in self.params] if ok else None
        elif apply:
            self._apply(lambda: apply_update(self.precision, self.optimizer, skip=not ok),
                        not ok, 1.0)
        for param in self.params:
            param.grad = None
        return RerunUpdate(loss=loss, grad_norm=norm, applied=ok, weighed=weighed, grads=grads,
                           passes=passes)


class ScalerState:
    """The loss scaler as a checkpointed state: always the step part's current runtime (a
    reconfigure may replace it)."""

    def __init__(self, updater: Updater) -> None:
        self.updater = updater

    def state_dict(self) -> dict[str, Any]:
        return self.updater.precision.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.updater.precision.load_state_dict(state)

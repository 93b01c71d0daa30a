"""The Tier 1 and NaN gate, on the device: the detector's skip rule as tensors.

At step t the gate is a 0-d bool tensor, true when the step must not be applied:

    not finite(grad_norm) or not finite(loss)
    or armed and grad on and grad_norm > median x max(grad_k, exp(grad_z x spread of log g))
    or armed and loss > its short running median + max(loss_min_rise x median, z x spread)
    or armed and loss / EMA of earlier kept losses > skip_ratio and loss past z spreads
    or armed and loss past half its bar's rise and grad norm past sqrt(median x bar)
    or armed and after_skip and loss past storm_loss_frac of its bar's rise and grad norm
       past grad_elevated x median (the storm test)

with ``armed`` = at least ``arm_after`` kept updates so far and ``grad on`` = the grad rule's
quiet arming done (``arm_quiet`` finite updates in a row inside the grad bar, counted once
``armed`` and at least ``grad_arm_after`` kept updates: ``rules.GradSpike``). It reads the same
DetectorConfig as
the host SpikeDetector and keeps the same histories (DeviceRunningMedian and DeviceEMA are
twins of the host statistics: the medians and the EMA bit-identical, the log-spread equal up to
the last bit of ``log``/``exp``; the loss tail's sums bit-identical and its bar ``z``,
``loss_tail.LossTail``, to the last bit of ``log``), so on every step of tier <= 1 the gate
equals the host verdict's ``skip``; it just needs no host read. A flagged step never enters
the histories, on the device as on the host. Rules that need host state (Tier 2 windows, the loss > 10 nats
halt) stay with the host detector. ``after_skip`` is the host's word (``resolved``): the step
before was a skip the weights check blamed on its batch, one of fewer than
``max_consecutive_skips`` in a row.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..measure.spread import DeviceSpread
from ..measure.stats import DeviceEMA, DeviceRunningMedian
from .config import DetectorConfig
from .loss_tail import _EXP_MAX
from .rules import grad_spike, joint_spike, loss_spike, ratio_spike, storm_spike

__all__ = ["DeviceGate"]


class DeviceGate:
    """Decide Tier 1 skips and non-finite steps on the device, with no host sync."""

    def __init__(self, config: DetectorConfig, device: torch.device | str = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        self.median = DeviceRunningMedian(config.median_window, device=self.device)
        self.spread = DeviceSpread(config.median_window, device=self.device)
        self.ema = DeviceEMA(1.0 / config.loss_ema_steps, device=self.device)
        self.level = DeviceRunningMedian(config.loss_window, device=self.device)
        self.loss_spread = DeviceSpread(config.loss_window, device=self.device)
        self.grad_quiet = torch.zeros((), dtype=torch.int64, device=self.device)
        self.grad_on = torch.zeros((), dtype=torch.bool, device=self.device)
        f64 = {"dtype": torch.float64, "device": self.device}
        # loss_tail.LossTail's sums: held, the steps past u, their excess, the Pareto fit's
        # two; the count
        self.tail = [torch.zeros((), **f64) for _ in range(5)]
        self.tail_count = torch.zeros((), dtype=torch.int64, device=self.device)
        self.tail_bar = torch.tensor(config.loss_z, **f64)
        """The loss rule's bar in spreads (``LossTail.bar``)."""
        self.skip_run = 0
        """Skips in a row, up to the last step resolved, that the weights check blamed on their
        batch (a host int: the Guard tells ``resolved`` before the next step is gated)."""

    def armed(self) -> torch.Tensor:
        """0-d bool: enough kept updates for the statistical rules (the detector's ``armed``)."""
        return self.ema.count >= self.config.arm_after

    @property
    def after_skip(self) -> bool:
        """Whether the next step gets the storm test (``rules.storm_spike``): the step before
        was a skip the weights check blamed on its batch, and fewer than
        ``max_consecutive_skips`` such skips came in a row (a longer run is the skip-storm
        rule's, and the storm test must not chain on its own flags)."""
        return 0 < self.skip_run < self.config.max_consecutive_skips

    def resolved(self, blamed_skip: bool) -> None:
        """The host's word on the last step: skipped with its batch blamed by the weights
        check, or not (applied, released, not finite, or not checked)."""
        self.skip_run = self.skip_run + 1 if blamed_skip else 0

    def grad_armed(self) -> torch.Tensor:
        """0-d bool: the grad rule is on (its quiet arming done; the host's ``GradSpike.on``)."""
        return self.grad_on

    def test(self, grad_norm: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        """The gate for a step with these numbers (0-d bool), against the histories as they are;
        nothing is folded in (a re-run's check uses this). Without the storm test: a re-run is
        judged as a fresh batch, whatever the step before it was (``reference_test`` adds the
        storm bars for a reference itself)."""
        g = grad_norm.detach().to(self.device, torch.float64).reshape(())
        x = loss.detach().to(self.device, torch.float64).reshape(())
        return self._test(g, x, self._grad_limit())

    def _test(self, g: torch.Tensor, x: torch.Tensor, glimit: torch.Tensor,
              storm: bool = False) -> torch.Tensor:
        """``test`` on float64 0-d tensors, with the grad bar as it is (``_grad_limit``);
        ``storm``: with the storm test (``rules.storm_spike``)."""
        ema = self.ema.value
        # the host detector's ratio is NaN (never a skip) while the EMA is not positive
        ratio = torch.where(ema > 0, x / ema, math.nan)
        grad_on = self.grad_armed()
        llimit, med, spread = self._loss_limit(), self.median.value, self.loss_spread.value
        # the loss / EMA rules' gate: the loss bar's spread part (rules.LossSpike); none while
        # the spread is unknown
        gate = torch.where(spread >= 0, self.level.value + self.tail_bar * spread, -math.inf)
        # rules.joint_grad_bar: the midpoint of the median and the grad bar
        half = torch.where(med > 0, torch.sqrt(med * glimit), math.inf)
        joint = joint_spike(g, half, x, self.level.value, llimit)
        spike = ((grad_spike(g, glimit) & grad_on) | loss_spike(x, llimit) | joint
                 | ratio_spike(ratio, self.config, x, gate))
        if storm and self.config.storm_loss_frac > 0:
            spike = spike | storm_spike(g, med, x, self.level.value, llimit, self.config)
        return ~torch.isfinite(g) | ~torch.isfinite(x) | (self.armed() & spike)

    def reference_test(self, grad_norm: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        """The weights check's test of a reference batch (0-d bool): ``test``, or the loss
        halfway to either loss bar (its median + half the loss rule's rise; loss / EMA above
        (1 + skip_ratio) / 2). A kept batch re-run under weights that a fault has moved need not
        look as bad as a fresh outlier to say the weights are off: after an LR x50 fault the
        reference's loss stood 1.38x the median, just under the 1.4x bar, on weights every
        fresh batch found as bad (tiny, seed 1). The grad bar is not halved: a healthy old
        batch's norm reaches 1.7x the median often enough (1-3% of steps) to let a storm batch
        through, while a loss 20% above the median is a 5-10 sigma event for a healthy one.
        When the flagged step was judged with the storm test (``after_skip``), the reference
        fails its bars too: else a flag the weights caused would blame the batch and chain."""
        g = grad_norm.detach().to(self.device, torch.float64).reshape(())
        x = loss.detach().to(self.device, torch.float64).reshape(())
        c, level, ema = self.config, self.level.value, self.ema.value
        llimit = self._loss_limit()
        ratio = torch.where(ema > 0, x / ema, math.nan)
        loss_up = (x > level + 0.5 * (llimit - level)) | (ratio > 0.5 * (1.0 + c.skip_ratio))
        if self.after_skip and c.storm_loss_frac > 0:
            loss_up = loss_up | storm_spike(g, self.median.value, x, level, llimit, c)
        return self._test(g, x, self._grad_limit()) | (self.armed() & loss_up)

    def reference_elevated(self, grad_norm: torch.Tensor) -> torch.Tensor:
        """0-d bool: a reference's grad norm past the geometric midpoint of the median and the
        grad bar (the joint test's grad half), once the grad rule is armed: the weights check's
        first reference, there and inside the bar, says neither weights nor batch, and a second
        reference's ``reference_test`` decides."""
        g = grad_norm.detach().to(self.device, torch.float64).reshape(())
        mid = torch.sqrt(self.median.value * self._grad_limit())
        return self.armed() & self.grad_armed() & (g > mid)

    def grad_multiple(self) -> torch.Tensor:
        """0-d: the grad bar over the median, the multiple a grad norm must pass (NaN while the
        median is empty)."""
        return self._grad_limit() / self.median.value

    def _grad_limit(self) -> torch.Tensor:
        """rules.grad_limit on the device."""
        c, s = self.config, self.spread.value
        mult = torch.where(torch.isnan(s), c.grad_k, torch.clamp(torch.exp(c.grad_z * s),
                                                                 min=c.grad_k))
        return self.median.value * mult

    def _loss_limit(self) -> torch.Tensor:
        """rules.loss_limit on the device (NaN while the loss median or spread is empty), at
        the bar ``tail_bar``."""
        c, level = self.config, self.level.value
        spread = self.loss_spread.value
        return level + torch.maximum(c.loss_min_rise * level, self.tail_bar * spread)

    def _tail_add(self, x: torch.Tensor) -> None:
        """``LossTail.add`` on the device: count an armed step's loss (NaN: not a step that
        reached the host's rules), then refit the bar on a step past u or a halving."""
        c = self.config
        if c.loss_tail_rate == 0:
            return
        level, spread, u = self.level.value, self.loss_spread.value, c.loss_tail_from
        bar = self.tail_bar
        base = level + u * spread  # x_u
        past = x > base
        count = (self.armed() & torch.isfinite(x) & (spread > 0)
                 & ~(past & (x > level + c.loss_tail_far * bar * spread)))
        past = past & count
        held, exceed, excess, lexceed, lexcess = self.tail
        exceed = torch.where(past, exceed + 1.0, exceed)
        excess = torch.where(past, excess + (torch.minimum((x - level) / spread, bar) - u),
                             excess)
        lpast = past & (base > 0)
        lexceed = torch.where(lpast, lexceed + 1.0, lexceed)
        lexcess = torch.where(lpast, lexcess + torch.log(torch.minimum(x, level + bar * spread)
                                                         / base), lexcess)
        self.tail_count = self.tail_count + count.to(torch.int64)
        w = c.loss_tail_window
        half = count & (self.tail_count % w == 0)
        held = torch.where(half, 0.5 * (held + w), held)
        self.tail = held, exceed, excess, lexceed, lexcess = [held] + [
            torch.where(half, v * 0.5, v) for v in (exceed, excess, lexceed, lexcess)]
        rate = exceed / (held + (self.tail_count % w).to(torch.float64))
        k = torch.log(rate / c.loss_tail_rate)
        zp = u + excess / exceed * k
        # the Pareto tail's z_p' where it explains the excursions decisively better and is
        # further out (LossTail.quantile)
        b, scale = lexcess / lexceed, level / spread + u
        pareto = ((lexceed >= c.loss_tail_min) & (base > 0) & (b > 0)
                  & (lexceed * (torch.log(excess / exceed / (scale * b)) - b)
                     > -math.log(c.loss_tail_rate)))
        grow = torch.expm1(torch.clamp(b * k, max=_EXP_MAX))
        zp = torch.where(pareto, torch.maximum(zp, u + scale * grow), zp)
        zp = torch.where(rate > c.loss_tail_rate, zp, u)
        fitted = torch.where(exceed >= c.loss_tail_min, torch.clamp(zp, min=c.loss_z), c.loss_z)
        self.tail_bar = torch.where(past | half, fitted, bar)

    def __call__(self, grad_norm: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        """The gate for this step (0-d bool); then fold the step into the histories unless
        it is flagged. Call once per step, in order."""
        g = grad_norm.detach().to(self.device, torch.float64).reshape(())
        x = loss.detach().to(self.device, torch.float64).reshape(())
        glimit = self._grad_limit()
        # the grad rule's quiet arming (GradSpike.update): a finite step judged while the rule is
        # off, armed and past grad_arm_after counts as quiet unless past the grad bar; the host
        # does not judge a non-finite step, which leaves the count alone. The step that completes
        # the count is judged with the rule on, as on the host (before the test)
        judged = (~self.grad_on & self.armed() & (self.ema.count >= self.config.grad_arm_after)
                  & torch.isfinite(g) & torch.isfinite(x))
        quiet = torch.where(grad_spike(g, glimit), 0, self.grad_quiet + 1)
        self.grad_quiet = torch.where(judged, quiet, self.grad_quiet)
        self.grad_on = self.grad_on | (judged & (self.grad_quiet >= self.config.grad_quiet_need))
        gate = self._test(g, x, glimit, self.after_skip)
        # the host counts a step that reached the rules: finite loss and grad norm
        self._tail_add(torch.where(torch.isfinite(g), x, math.nan))
        ok = (g > 0) & torch.isfinite(g)
        # NaN where the host's log_value gives NaN: never kept
        self.spread.add(torch.where(ok, torch.log(g), math.nan), flagged=gate)
        self.median.update(g, flagged=gate)
        self.ema.update(x, flagged=gate)
        self.loss_spread.add(x, flagged=gate)
        self.level.update(x, flagged=gate)
        return gate

    def state_dict(self) -> dict[str, Any]:
        """JSON-ready; a host read (for checkpoints, not the step)."""
        return {"median": self.median.state_dict(), "spread": self.spread.state_dict(),
                "ema": self.ema.state_dict(), "level": self.level.state_dict(),
                "loss_spread": self.loss_spread.state_dict(),
                "grad_quiet": int(self.grad_quiet), "grad_on": bool(self.grad_on),
                "skip_run": self.skip_run,
                "tail": [float(v) for v in self.tail[:3]] + [int(self.tail_count)]
                + [float(self.tail_bar)] + [float(v) for v in self.tail[3:]]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in ("median", "spread", "ema", "level", "loss_spread"):
            getattr(self, name).load_state_dict(state[name])
        c = self.config
        # a state saved before quiet arming: its grad rule was on from max(arm_after,
        # grad_arm_after) kept updates, and a resumed run keeps it on
        on = state.get("grad_on", int(self.ema.count) >= max(c.arm_after, c.grad_arm_after))
        self.grad_quiet = torch.tensor(int(state.get("grad_quiet", 0)), device=self.device)
        self.grad_on = torch.tensor(bool(on), device=self.device)
        self.skip_run = int(state.get("skip_run", 0))
        tail = state.get("tail")  # None: a state saved before the loss tail
        f64 = {"dtype": torch.float64, "device": self.device}
        # [held, exceed, excess, count, bar, lexceed, lexcess]; a state saved before the Pareto
        # fit has the first five
        sums = (tail or [0.0] * 3)[:3] + ((tail or [])[5:7] or [0.0, 0.0])
        self.tail = [torch.tensor(float(v), **f64) for v in sums]
        self.tail_count = torch.tensor(int(tail[3]) if tail else 0, dtype=torch.int64,
                                       device=self.device)
        self.tail_bar = torch.tensor(float(tail[4]) if tail else self.config.loss_z, **f64)

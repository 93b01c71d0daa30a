"""The framework-free parts of the integrations: GuardedOptimizer's deferred halt,
Guard.last_skipped, the held LR scheduler, SpikeguardLoss against float64 math, the logger's
numbers, and that importing the integration modules imports neither framework."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import spikeguard as sg
from spikeguard.integrations._common import HeldScheduler, build_guard, logger_metrics
from spikeguard.integrations.hf import SpikeguardLoss


def tiny_run(**kw):
    torch.manual_seed(0)
    model = sg.GPT(sg.GPTConfig.tiny(seq_len=16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    parts = build_guard(model, opt, sg.GuardConfig(), sinks=None, out_dir=None,
                        framework="test", **kw)
    sched = HeldScheduler(torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1)),
                          parts.guard, parts.optimizer)
    data = sg.TokenStream.from_corpus("pydoc", batch_size=2, seq_len=16, seed=0)
    return model, opt, parts, sched, data


def one_step(model, parts, sched, data, *, nan=False):
    x, y = next(data)
    out = model.loss(model(x), y)
    out.loss.backward()
    if nan:
        next(model.parameters()).grad.view(-1)[0] = float("nan")
    parts.guard.accumulate(out)
    parts.optimizer.step()
    sched.step()


def test_deferred_halt_holds_the_schedule_and_is_raised_on_the_next_step():
    model, opt, parts, sched, data = tiny_run()
    one_step(model, parts, sched, data)
    assert parts.guard.last_skipped is False and sched.scheduler.last_epoch == 1
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    one_step(model, parts, sched, data, nan=True)  # does not raise: deferred
    halt = parts.optimizer.halted
    assert isinstance(halt, sg.TrainingHalted) and halt.report.step == 1
    assert parts.guard.last_skipped is True
    assert sched.scheduler.last_epoch == 1 and sched.held_steps == 1
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 / 2)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    x, y = next(data)
    model.loss(model(x), y).loss.backward()
    with pytest.raises(sg.TrainingHalted) as again:
        parts.optimizer.step()
    assert again.value is halt


def test_undeferred_guarded_optimizer_raises_at_once():
    torch.manual_seed(0)
    model = sg.GPT(sg.GPTConfig.tiny(seq_len=16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = sg.Guard(model, opt, config=sg.GuardConfig(read_lag=0))
    guarded = sg.GuardedOptimizer(opt, guard)
    x = torch.randint(0, 256, (2, 16))
    out = model.loss(model(x), x)
    out.loss.backward()
    next(model.parameters()).grad.view(-1)[0] = float("inf")
    guard.accumulate(out)
    with pytest.raises(sg.TrainingHalted):
        guarded.step()
    assert guarded.halted is None and guard.last_skipped is True


def test_held_scheduler_forwards_the_rest():
    model, _opt, parts, sched, data = tiny_run()
    assert sched.last_epoch == 0 and sched.base_lrs == [1e-3]
    assert sched.optimizer is parts.optimizer
    one_step(model, parts, sched, data)
    assert sched.get_last_lr() == [pytest.approx(1e-3 / 2)]
    state = sched.state_dict()
    assert state == sched.scheduler.state_dict() and state["last_epoch"] == 1
    sched.load_state_dict({**state, "last_epoch": 5})
    assert sched.scheduler.last_epoch == 5
    parts.guard.last_skipped = True  # an epoch schedule is not held by one withheld update
    epoch = HeldScheduler(sched.scheduler, parts.guard, parts.optimizer, hold=False)
    epoch.step()
    assert sched.scheduler.last_epoch == 6


def test_build_guard_refuses_what_a_framework_loop_cannot_do():
    model = sg.GPT(sg.GPTConfig.tiny(seq_len=16))
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="read_lag=1"):
        build_guard(model, opt, sg.GuardConfig(read_lag=1), sinks=None, out_dir=None,
                    framework="X")
    with pytest.raises(ValueError, match="tier2='rollback'"):
        build_guard(model, opt, sg.GuardConfig(tier2="rollback"), sinks=None, out_dir=None,
                    framework="X")
    guarded = sg.GuardedOptimizer(opt, sg.Guard(model, opt))
    with pytest.raises(ValueError, match="plain optimizer"):
        build_guard(model, guarded, None, sinks=None, out_dir=None, framework="X")


def reference(logits, labels, z=1e-4):
    """float64: mean over counted tokens of CE + z * logZ^2, mean CE, mean log Z."""
    lg, lb = logits[:, :-1].double(), labels[:, 1:]
    keep = lb != -100
    lse = torch.logsumexp(lg, -1)[keep]
    ce = F.cross_entropy(lg[keep], lb[keep], reduction="sum")
    return ce + z * (lse ** 2).sum(), ce / keep.sum(), lse.mean()


def test_spikeguard_loss_against_float64():
    torch.manual_seed(1)
    logits = (3 * torch.randn(2, 9, 50)).requires_grad_()
    labels = torch.randint(0, 50, (2, 9))
    labels[0, 4:] = -100
    model = sg.GPT(sg.GPTConfig.tiny(seq_len=16))
    guard = sg.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loss_fn = SpikeguardLoss()
    loss_fn.guard = guard
    total, ce, log_z = reference(logits.detach(), labels)
    n = int((labels[:, 1:] != -100).sum())
    loss = loss_fn({"logits": logits}, labels)  # no num_items_in_batch: the local mean
    assert loss.item() == pytest.approx((total / n).item(), rel=1e-6)
    loss = loss_fn({"logits": logits}, labels, num_items_in_batch=torch.tensor(3 * n))
    assert loss.item() == pytest.approx((total / (3 * n)).item(), rel=1e-6)
    micro_ce, micro_z = guard.micro[0][:2]  # (loss, log Z, per-sequence stats)
    assert micro_ce.item() == pytest.approx(ce.item(), rel=1e-6)
    assert micro_z.item() == pytest.approx(log_z.item(), rel=1e-6)
    with torch.no_grad():  # evaluation: nothing reaches the guard
        loss_fn({"logits": logits}, labels)
    assert len(guard.micro) == 2
    with pytest.raises(ValueError, match="labels"):
        loss_fn({"logits": logits}, None)


def test_logger_metrics_keep_the_known_numbers():
    rec = {"loss": 2.5, "grad_norm": float("nan"), "log_z": 3.0, "loss_ema_ratio": None,
           "nan_frac": 0.25, "skipped": True, "tier": 3}
    got = logger_metrics(rec, skips=4)
    assert got["spikeguard/loss"] == 2.5 and math.isnan(got["spikeguard/grad_norm"])
    assert "spikeguard/loss_ema_ratio" not in got
    assert got["spikeguard/skipped"] == 1.0 and got["spikeguard/tier"] == 3.0
    assert got["spikeguard/skips"] == 4.0


def test_importing_the_integrations_imports_neither_framework():
    code = ("import sys, spikeguard.integrations.hf, spikeguard.integrations.lightning, "
            "spikeguard.integrations.olmo_core;"
            "print(sorted(m for m in ('transformers', 'lightning', 'accelerate', 'olmo_core') "
            "if m in sys.modules))")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PYTHONPATH": str(Path(__file__).parents[1] / "src")}, check=True)
    assert got.stdout.strip() == "[]"

"""The warnings for silent misuse (guard/misuse.py): a foreign GradScaler, a rollback without
data=, a loop that does not follow step_index after a rollback, an LR the guard cannot read, a
micro-batch loss of the wrong reduction, a scheduler stepped by the loop beside the guard, a
gradient clipped before the guard measured it. Each is a GuardMisuseWarning; the right use of each
runs without one (pytest turns any warning into an error)."""

from __future__ import annotations

import math

import pytest
import torch

import spikeguard as sg
from spikeguard.guard import GuardMisuseWarning
from spikeguard.sinks import read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: threads only contend


def _parts(steps=30, **guard_kw):
    torch.manual_seed(0)
    model = sg.GPT(sg.GPTConfig.tiny(seq_len=16))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = sg.TokenStream.from_corpus("pydoc", batch_size=4, seq_len=16, seed=0)
    # arm_quiet=2 (here and in the detectors below): the grad rule on 2 quiet updates after
    # arm_after (step 6), before the poisoned batches (from step 8 or at 11); these tests are
    # about the warnings and the reasons, and the default 20 would need runs 3x as long
    det = sg.DetectorConfig.for_run(steps, arm_after=5, grad_z=0.01, max_consecutive_skips=2,
                                    arm_quiet=2)
    cfg = sg.GuardConfig(detector=det, read_lag=0, weights_check=False,
                         **guard_kw.pop("config", {}))
    return model, opt, data, cfg


def test_a_foreign_grad_scaler_is_named_with_its_scale_and_the_norm():
    model, opt, data, cfg = _parts()
    guard = sg.Guard(model, opt, config=cfg, data=data)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    x, y = next(data)
    out = model.loss(model(x), y)
    scaler.scale(out.loss).backward()  # the loop's own scaler, left in place
    with pytest.warns(GuardMisuseWarning, match=r"GradScaler .*scale 65536.*off by about"):
        (v,) = guard.step(out)
    assert v.evidence["grad_norm"] > 1e3
    del scaler


def test_a_large_norm_without_a_scaler_and_a_disabled_scaler_say_nothing():
    model, opt, data, cfg = _parts()
    guard = sg.Guard(model, opt, config=cfg, data=data)
    idle = torch.amp.GradScaler("cpu", enabled=False)  # nanoGPT's under bf16: never scales
    x, y = next(data)
    out = model.loss(model(x), y)
    idle.scale(out.loss * 1e6).backward()  # a real spike: a norm far above 1e3
    (v,) = guard.step(out)
    assert v.evidence["grad_norm"] > 1e3 and guard.watch._scanned


def test_rollback_without_data_warns_at_construction(tmp_path):
    model, opt, _, cfg = _parts(config={"tier2": "rollback"})
    ckpt = sg.CheckpointManager(tmp_path / "ck", every=2)
    with pytest.warns(GuardMisuseWarning, match=r"without Guard\(data=\.\.\.\)"):
        sg.Guard(model, opt, config=cfg, checkpoints=ckpt)


def _batch(model, data, poisoned):
    x, y = next(data)
    if poisoned:  # a run of NUL bytes: a skip storm, then Tier 2 rolls back
        x, y = torch.zeros_like(x), torch.zeros_like(y)
    out = model.loss(model(x), y)
    out.loss.backward()
    return out


def test_a_loop_that_counts_its_own_steps_is_told_after_a_rollback(tmp_path):
    # (a loop driven by guard.step_index rolls back without a warning: tests/test_guard.py)
    model, opt, data, cfg = _parts(config={"tier2": "rollback"})
    guard = sg.Guard(model, opt, config=cfg, data=data,
                     checkpoints=sg.CheckpointManager(tmp_path / "ck", every=4))
    rolled = None
    with pytest.warns(GuardMisuseWarning, match=r"rolled back at step 10 to step 5.*skips "
                                                     "the 6 replayed steps"):
        for it in range(12):  # nanoGPT's habit: its own counter, never guard.step_index
            (v,) = guard.step(_batch(model, data, poisoned=it >= 8))
            if v.action is sg.Action.ROLLBACK:
                rolled = it
    assert rolled == 10 and guard.step_index == 6  # 12 iterations, 6 steps: it ends early


class _NoLR(torch.optim.Optimizer):
    """SGD at 0.1 whose param groups carry no 'lr' (a container's view of its optimizers)."""

    def __init__(self, params):
        super().__init__(params, defaults={})

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-0.1)


def test_an_lr_it_cannot_read_is_recorded_null_with_one_warning(tmp_path):
    model, _, data, cfg = _parts()
    guard = sg.Guard(model, _NoLR(model.parameters()), config=cfg, data=data,
                     sinks=[sg.JsonlSink(tmp_path / "m.jsonl")])
    with pytest.warns(GuardMisuseWarning, match=r"_NoLR has param_groups\[0\]\['lr'\] = "
                                                     "None.*lr is null") as seen:
        for _ in range(3):
            guard.step(_batch(model, data, poisoned=False))
    assert len([w for w in seen if w.category is GuardMisuseWarning]) == 1
    guard.close()
    assert [r["lr"] for r in read_metrics(tmp_path / "m.jsonl")] == [None] * 3


def test_a_tensor_lr_on_the_cpu_is_read_without_a_warning(tmp_path):
    model, _, data, cfg = _parts()
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(2e-3))
    guard = sg.Guard(model, opt, config=cfg, data=data, sinks=[sg.JsonlSink(tmp_path / "m")])
    guard.step(_batch(model, data, poisoned=False))
    guard.close()
    assert read_metrics(tmp_path / "m")[0]["lr"] == pytest.approx(2e-3)


def test_a_summed_micro_batch_loss_is_told_and_the_mean_is_not():
    model, opt, data, cfg = _parts()
    guard = sg.Guard(model, opt, config=cfg, data=data)
    x, y = next(data)
    summed = sg.cross_entropy(model.logits(model(x)), y, reduction="sum")
    (summed.loss / y.numel()).backward()
    with pytest.warns(GuardMisuseWarning, match=r"reduction 'sum'.*own mean"):
        guard.accumulate(summed)
    guard.micro.clear()
    opt.zero_grad()
    w = model._scaled_output_weight()
    share = sg.linear_cross_entropy(model(x), w, y, normalizer=4 * y.numel())  # 1 of 4
    assert share.reduction == "normalized"
    assert sg.linear_cross_entropy(model(x), w, y, reduction="sum").reduction == "sum"
    mean = model.loss(model(x), y)
    assert mean.reduction == "mean"
    mean.loss.backward()
    (v,) = guard.step(mean)  # the micro-batch's own mean: no warning
    assert math.isclose(v.evidence["loss"], mean.ce.item(), rel_tol=1e-6)


def test_a_scheduler_the_loop_steps_too_is_told_and_one_owner_is_not():
    model, opt, data, cfg = _parts()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    guard = sg.Guard(model, opt, config=cfg, data=data, scheduler=sched)
    for _ in range(3):  # the guard alone steps it: once per applied update
        guard.step(_batch(model, data, poisoned=False))
    assert sched.last_epoch == 3
    with pytest.warns(GuardMisuseWarning, match=r"moved 2 steps \(last_epoch 3 -> 5\).*"
                                                     r"drop your scheduler.step\(\)"):
        for _ in range(3):
            guard.step(_batch(model, data, poisoned=False))
            sched.step()  # the loop's own, kept beside Guard(scheduler=)
    assert sched.last_epoch == 9  # twice as fast: what the warning is about


def test_a_gradient_clipped_before_the_guard_is_told_and_a_clip_by_the_guard_is_not():
    model, opt, data, cfg = _parts()
    guard = sg.Guard(model, opt, config=cfg, data=data)
    for _ in range(6):  # the guard clips at 1.0 after measuring: the norms it sees all differ
        (v,) = guard.step(_batch(model, data, poisoned=False))
    assert not guard.watch._warned_clipped
    norms = []
    with pytest.warns(GuardMisuseWarning, match=r"was 0.5 at 5 steps in a row.*clipped "
                                                     "before guard.step"):
        for _ in range(5):
            x, y = next(data)
            out = model.loss(model(x), y)
            out.loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
            (v,) = guard.step(out)
            assert v.evidence["grad_norm"] == pytest.approx(0.5, rel=1e-5)
    assert min(norms) > 0.5  # every one of them was clipped: the guard saw none of them


def test_a_record_whose_weights_check_could_not_run_says_why(tmp_path):
    model, opt, data, _ = _parts()
    det = sg.DetectorConfig.for_run(30, arm_after=5, grad_z=0.01, arm_quiet=2)
    guard = sg.Guard(model, opt, config=sg.GuardConfig(detector=det, read_lag=0), data=data)
    for i in range(12):  # no rerun=: the step that is skipped cannot be checked, and says so
        (v,) = guard.step(_batch(model, data, poisoned=i == 11))
    assert v.action is sg.Action.SKIP
    (why,) = [r for r in v.reasons if r.startswith("weights")]
    assert why.startswith("weights: not checked (no rerun= was passed: pass guard.step(out, "
                          "rerun=fn)")


def test_a_stochastic_forward_the_guard_did_not_see_is_unknown_never_transient():
    """Dropout on, and the forward called as ``model.forward(x)`` (no module call: no hook, no
    guard.autocast): the guard cannot set the RNG state again, so a re-run would draw other
    masks. It does not re-run: the skip's cause is unknown and the reason says why."""
    import dataclasses

    from spikeguard.guard.micro import stochastic

    torch.manual_seed(0)
    model = sg.GPT(dataclasses.replace(sg.GPTConfig.tiny(seq_len=16), dropout=0.1))
    assert stochastic(model) is not None and stochastic(model.eval()) is None
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = sg.TokenStream.from_corpus("pydoc", batch_size=4, seq_len=16, seed=0)
    det = sg.DetectorConfig.for_run(30, arm_after=5, grad_z=0.01, arm_quiet=2)
    guard = sg.Guard(model, opt, config=sg.GuardConfig(detector=det, read_lag=0), data=data)

    def forward_backward(x, y):
        out = model.loss(model.forward(x), y)
        guard.backward(out)
        return out

    for i in range(12):
        x, y = next(data)
        if i == 11:
            x, y = torch.zeros_like(x), torch.zeros_like(y)
        out = forward_backward(x, y)
        (v,) = guard.step(out, rerun=lambda x=x, y=y: forward_backward(x, y))
    assert v.action is sg.Action.SKIP
    assert not any(r.startswith("rerun:") for r in v.reasons)  # no re-run, so no guess
    (why,) = [r for r in v.reasons if r.startswith("weights")]
    assert why.startswith("weights: not checked (the forward is stochastic (dropout in drop) "
                          "and did not run through the guard's model")

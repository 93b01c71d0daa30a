"""The Guard inside Lightning: a tiny LightningModule (the reference GPT, tiny preset) trained on
CPU on the Python docs' bytes; an outlier batch is skipped with params, optimizer state and LR
schedule untouched, a NaN stops the Trainer (trainer.should_stop) with a report, then raises."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest
import torch

import spikeguard as sg
from spikeguard.data import load_corpus
from spikeguard.integrations import lightning as sg_lightning
from spikeguard.integrations._common import METRICS
from spikeguard.sinks import read_metrics

from .state_compare import same, same_moments

L = pytest.importorskip("lightning.pytorch")

SEQ, BATCH, STEPS, OUTLIER = 32, 4, 24, 14
LR, WARMUP = 3e-3, 4


def lr_lambda(step: int) -> float:
    """Linear warmup then linear decay: a different LR at every step."""
    return (step + 1) / WARMUP if step < WARMUP else max(0.1, 1 - (step - WARMUP) / STEPS)


def batches(steps: int, outlier: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Consecutive byte windows of the corpus; the batch of ``outlier`` is all NUL bytes."""
    tokens = torch.from_numpy(load_corpus("pydoc").train[:steps * BATCH * SEQ + 1]
                              .astype(np.int64))
    out = []
    for t in range(steps):
        i = t * BATCH * SEQ
        x = tokens[i:i + BATCH * SEQ].view(BATCH, SEQ)
        y = tokens[i + 1:i + BATCH * SEQ + 1].view(BATCH, SEQ)
        if t == outlier:
            x, y = torch.zeros_like(x), torch.zeros_like(y)
        out.append((x, y))
    return out


class LitGPT(L.LightningModule):
    def __init__(self, guard_cb, *, nan_step: int | None = None, tokens: bool = False):
        super().__init__()
        self.tokens = tokens  # hand the guard the input ids
        torch.manual_seed(0)
        self.net = sg.GPT(sg.GPTConfig.tiny(seq_len=SEQ))
        self.guard_cb, self.nan_step = guard_cb, nan_step
        self.snaps: dict[str, dict[int, tuple]] = {"before": {}, "after": {}}
        self.net.blocks[1].mlp.register_forward_hook(self._overflow)

    def _overflow(self, module, args, output):
        if self.global_step == self.nan_step:  # an activation overflowed
            return output * float("nan")
        return output

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.net.loss(self.net(x), y)
        self.guard_cb.accumulate(out, tokens=x if self.tokens else None)
        return out.loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
        self.adamw, self.sched = opt, sched
        return self.guard_cb.configure_optimizers(self, opt, sched)

    def _snap(self):
        params = {n: p.detach().clone() for n, p in self.named_parameters()}
        moments = {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                   for i, s in enumerate(self.adamw.state.values())}
        return params, moments, self.sched.last_epoch, self.adamw.param_groups[0]["lr"]

    def on_train_batch_start(self, batch, batch_idx):
        self.snaps["before"][self.global_step] = self._snap()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.snaps["after"][self.global_step - 1] = self._snap()


def make_trainer(tmp_path, guard_cb, steps=STEPS, outlier=None, **trainer_kw):
    logger = L.loggers.CSVLogger(tmp_path, name="run", version=0)
    kw = dict(max_steps=steps, accelerator="cpu", devices=1, logger=logger,
              log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, callbacks=[guard_cb])
    kw.update(trainer_kw)
    trainer = L.Trainer(**kw)
    return trainer, torch.utils.data.DataLoader(batches(steps, outlier), batch_size=None)


def guard_config(steps=STEPS):
    # the flat 3x-median grad rule (grad_z near 0): these test the framework's skip, not the bar
    return sg.GuardConfig(detector=sg.DetectorConfig.for_run(steps, arm_after=5, grad_z=0.01))


def logged_rows(tmp_path):
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as f:
        return [r for r in csv.DictReader(f) if r.get("spikeguard/loss")]


class HookCount(L.Callback):
    """How often Lightning's closure ran its hooks (once per step, skip or not)."""

    def __init__(self):
        self.backward = self.before_step = 0

    def on_after_backward(self, trainer, pl_module):
        self.backward += 1

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.before_step += 1


def test_outlier_batch_is_skipped_and_nothing_moves(tmp_path):
    # the outlier 20 steps past OUTLIER: the grad rule turns on only after arm_after (5) and
    # arm_quiet (20) quiet updates, and the skip here is that rule's
    steps, bad = STEPS + 20, OUTLIER + 20
    guard_cb = sg_lightning.SpikeguardCallback(config=guard_config(steps))
    hooks = HookCount()
    module = LitGPT(guard_cb)
    trainer, loader = make_trainer(tmp_path, guard_cb, steps=steps, outlier=bad)
    trainer.callbacks.append(hooks)
    trainer.fit(module, loader)
    # the skip's re-run is training_step and backward only: no callback hook ran twice
    assert hooks.backward == hooks.before_step == steps
    out = tmp_path / "run" / "version_0"
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(steps))
    assert [r["step"] for r in records if r["skipped"]] == [bad]
    assert records[bad]["rerun"] is not None  # the skip was re-run (attribution)
    # each micro-batch's closure holds its batch: a kept one cleared the weights, so "data"
    assert records[bad]["weights_check"]["weights"] is False
    assert records[bad]["cause"] == "data"
    assert records[bad]["reasons"][0] == "grad_norm > 3x median"
    window = guard_config(steps).detector.median_window
    prior = sorted(r["grad_norm"] for r in records[bad - window:bad])
    assert records[bad]["grad_norm"] > 3 * (prior[(window - 1) // 2] + prior[window // 2]) / 2
    # the guard reads the signals through the optimizer's step hooks: each applied update
    # moved the weights, the withheld one reads 0 (the update-ratio rule sees this framework too)
    ratios = [r.get("update_ratio") for r in records]
    assert ratios[bad] == 0 and all(v > 0 for i, v in enumerate(ratios) if i != bad)
    # the skipped step: params, AdamW moments and step count, schedule position, all unchanged
    p0, m0, pos0, lr0 = module.snaps["before"][bad]
    p1, m1, pos1, lr1 = module.snaps["after"][bad]
    assert same(p0, p1) and same_moments(m0, m1) and pos1 == pos0 and lr1 == lr0
    q0, n0, qpos0, _ = module.snaps["before"][bad - 1]
    q1, n1, qpos1, _ = module.snaps["after"][bad - 1]
    assert not same(q0, q1) and not same_moments(n0, n1) and qpos1 == qpos0 + 1
    applied = 0
    for r in records:
        assert r["lr"] == pytest.approx(LR * lr_lambda(applied), rel=1e-12)
        applied += not r["skipped"]
    assert module.sched.last_epoch == applied == steps - 1 == guard_cb.guard.applied
    assert trainer.global_step == steps  # Lightning counted every optimizer call
    # the five metrics went through Lightning's logger (CSVLogger), equal to the guard's record
    rows = logged_rows(tmp_path)
    assert len(rows) == steps
    for row, r in zip(rows, records):
        for key in METRICS:  # loss_ema_ratio is NaN at step 0 (no EMA yet)
            assert float(row[f"spikeguard/{key}"]) == pytest.approx(r[key], rel=1e-6, nan_ok=True)
    assert float(rows[bad]["spikeguard/loss_ema_ratio"]) > 1.0  # the NUL batch's loss jumped
    # the EMA of the one loss before step 1 is that loss
    assert records[1]["loss_ema_ratio"] == pytest.approx(records[1]["loss"] / records[0]["loss"])
    assert float(rows[bad]["spikeguard/skipped"]) == 1.0
    assert float(rows[-1]["spikeguard/skips"]) == 1.0
    assert guard_cb.halted is None and not (out / "report.json").exists()


def test_the_input_ids_reach_the_guard(tmp_path):
    """accumulate(out, tokens=x): the NUL batch at OUTLIER is skipped for its ids, and nothing
    moves; without the ids no step names them."""
    seen = {}
    for tokens in (True, False):
        guard_cb = sg_lightning.SpikeguardCallback(config=guard_config())
        module = LitGPT(guard_cb, tokens=tokens)
        trainer, loader = make_trainer(tmp_path / str(tokens), guard_cb, outlier=OUTLIER)
        trainer.fit(module, loader)
        seen[tokens] = read_metrics(tmp_path / str(tokens) / "run" / "version_0" /
                                    "metrics.jsonl"), module
    records, module = seen[True]
    assert [r["step"] for r in records if r["skipped"]] == [OUTLIER]
    assert records[OUTLIER]["cause"] == "data"
    assert any(r.startswith("tokens: ") for r in records[OUTLIER]["reasons"])
    p0, m0, pos0, _ = module.snaps["before"][OUTLIER]
    p1, m1, pos1, _ = module.snaps["after"][OUTLIER]
    assert same(p0, p1) and same_moments(m0, m1) and pos1 == pos0
    assert not any(r.startswith("tokens") for rec in seen[False][0] for r in rec["reasons"])


def test_nan_stops_the_trainer_with_a_report_then_raises(tmp_path):
    nan_step = 9
    guard_cb = sg_lightning.SpikeguardCallback(config=guard_config())
    module = LitGPT(guard_cb, nan_step=nan_step)
    trainer, loader = make_trainer(tmp_path, guard_cb)
    with pytest.raises(sg.TrainingHalted) as exc:
        trainer.fit(module, loader)
    report = exc.value.report
    assert report.step == nan_step
    # the closure's re-run names the module whose output went non-finite first
    assert report.traced and report.first_forward == "net.blocks.1.mlp"
    assert "net.blocks.1.mlp.fc.weight" in report.nonfinite_params
    assert trainer.should_stop and trainer.global_step == nan_step + 1
    out = tmp_path / "run" / "version_0"
    saved = json.loads((out / "report.json").read_text())
    assert saved["step"] == nan_step and saved["reasons"] == list(report.reasons)
    assert f"HALT at step {nan_step}" in (out / "report.txt").read_text()
    p0, m0, pos0, _ = module.snaps["before"][nan_step]
    p1, m1, pos1, _ = module.snaps["after"][nan_step]
    assert same(p0, p1) and same_moments(m0, m1) and pos1 == pos0
    assert all(torch.isfinite(p).all() for p in module.parameters())
    records = read_metrics(out / "metrics.jsonl")
    assert records[-1]["step"] == nan_step and records[-1]["action"] == "halt"
    assert math.isnan(records[-1]["loss"])


def test_refuses_lightning_clipping(tmp_path):
    guard_cb = sg_lightning.SpikeguardCallback(config=guard_config())
    trainer, loader = make_trainer(tmp_path, guard_cb, steps=2, gradient_clip_val=1.0)
    with pytest.raises(ValueError, match=r"gradient_clip_val=1.0.*GuardConfig\(clip"):
        trainer.fit(LitGPT(guard_cb), loader)


def test_checkpoint_carries_the_detector(tmp_path):
    guard_cb = sg_lightning.SpikeguardCallback(config=guard_config(8))
    trainer, loader = make_trainer(tmp_path, guard_cb, steps=6)
    trainer.fit(LitGPT(guard_cb), loader)
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    state = guard_cb.guard.state_dict()
    resumed_cb = sg_lightning.SpikeguardCallback(config=guard_config(8))
    trainer, loader = make_trainer(tmp_path / "b", resumed_cb, steps=6)
    trainer.fit(LitGPT(resumed_cb), loader, ckpt_path=tmp_path / "a.ckpt")
    assert resumed_cb.guard.step_index == state["step_index"] == 6
    assert resumed_cb.guard.detector.state_dict() == state["detector"]


def test_a_resume_in_the_same_folder_keeps_one_record_per_step(tmp_path):
    guard_cb = sg_lightning.SpikeguardCallback(config=guard_config(8), out_dir=tmp_path)
    trainer, loader = make_trainer(tmp_path, guard_cb, steps=4)
    trainer.fit(LitGPT(guard_cb), loader)
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    trainer, loader = make_trainer(tmp_path, guard_cb, steps=6)
    trainer.fit(LitGPT(guard_cb), loader)  # the run went on past its checkpoint, then died
    resumed_cb = sg_lightning.SpikeguardCallback(config=guard_config(8), out_dir=tmp_path)
    trainer, loader = make_trainer(tmp_path, resumed_cb, steps=6)
    trainer.fit(LitGPT(resumed_cb), loader, ckpt_path=tmp_path / "a.ckpt")
    steps = [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")]
    assert steps == list(range(6))  # steps 4 and 5 ran again and were written once


def test_a_checkpoint_without_the_guard_state_still_continues_the_numbering(tmp_path):
    guard_cb = sg_lightning.SpikeguardCallback(config=guard_config(8), out_dir=tmp_path / "a")
    trainer, loader = make_trainer(tmp_path, guard_cb, steps=4)
    trainer.fit(LitGPT(guard_cb), loader)
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    ckpt = torch.load(tmp_path / "a.ckpt", weights_only=False)
    ckpt["callbacks"] = {}  # a guard added to a run that had none
    torch.save(ckpt, tmp_path / "b.ckpt")
    fresh = sg_lightning.SpikeguardCallback(config=guard_config(8), out_dir=tmp_path / "b")
    trainer, loader = make_trainer(tmp_path, fresh, steps=6)
    trainer.fit(LitGPT(fresh), loader, ckpt_path=tmp_path / "b.ckpt")
    assert [r["step"] for r in read_metrics(tmp_path / "b" / "metrics.jsonl")] == [4, 5]

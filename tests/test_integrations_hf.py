"""The Guard inside HF Trainer: a tiny GPT-2 built from a config (nothing downloaded) trained on
CPU on the Python docs' bytes; an outlier batch is skipped with params, optimizer state and LR
schedule untouched, a NaN stops the Trainer with a report and then raises."""

from __future__ import annotations

import copy
import json
import math
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import spikeguard as sg
from spikeguard.data import load_corpus
from spikeguard.integrations import hf as sg_hf
from spikeguard.integrations._common import METRICS, HeldScheduler, input_ids
from spikeguard.sinks import read_metrics

from ._hf_llama import CORRUPT, corrupt_embeddings, llama, poison_mlp, readme_loop
from .state_compare import same, same_moments

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytestmark = [
    pytest.mark.usefixtures("one_thread"),  # tiny models: threads only contend
    # GPT-2 keeps its query and key weights transposed in one Conv1D, which the logit bound
    # does not read: it warns once, naming the class (tests/test_layout.py tests the warning)
    pytest.mark.filterwarnings("ignore:the attention-logit bound found no attention it can read "
                               "in GPT2LMHeadModel:UserWarning"),
]

SEQ, BATCH, STEPS, OUTLIER = 32, 4, 24, 14
LR, WARMUP = 3e-3, 4


class ByteDataset(torch.utils.data.Dataset):
    """Sequences of the corpus' bytes, in order; the batch of ``outlier_step`` is a run of NUL
    bytes (a corrupt shard: a byte the text never holds), or only its ``rows``, as inputs 0xFF
    with NUL targets."""

    def __init__(self, n: int, outlier_step: int | None = None, rows: range | None = None,
                 ga: int = 1) -> None:
        tokens = load_corpus("pydoc").train
        self.seqs = [torch.from_numpy(tokens[i * SEQ:(i + 1) * SEQ].astype(np.int64))
                     for i in range(n)]
        self.labels = {}
        if outlier_step is not None:
            first = outlier_step * BATCH * ga
            for i in rows if rows is not None else range(BATCH * ga):
                self.seqs[first + i] = torch.zeros(SEQ, dtype=torch.int64)
                if rows is not None:  # a few rows: inputs 0xFF, targets NUL (README loop's)
                    self.labels[first + i] = self.seqs[first + i]
                    self.seqs[first + i] = torch.full((SEQ,), 0xFF, dtype=torch.int64)

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.seqs[i], "labels": self.labels.get(i, self.seqs[i]).clone()}


def lr_lambda(step: int) -> float:
    """Linear warmup then linear decay: a different LR at every step."""
    return (step + 1) / WARMUP if step < WARMUP else max(0.1, 1 - (step - WARMUP) / STEPS)


def make_trainer(tmp_path, *, steps=STEPS, outlier=None, callbacks=(), ga=1, model=None,
                 rows=None, **arg_overrides):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256,
                                  n_positions=SEQ, bos_token_id=0, eos_token_id=0,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = model if model is not None else transformers.GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    kw = dict(output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=BATCH,
              max_grad_norm=0.0, logging_steps=1, report_to="none", save_strategy="no",
              use_cpu=True, disable_tqdm=True, logging_nan_inf_filter=False,
              train_sampling_strategy="sequential", dataloader_num_workers=0, seed=0,
              gradient_accumulation_steps=ga)
    kw.update(arg_overrides)
    args = transformers.TrainingArguments(**kw)
    return transformers.Trainer(model=model, args=args,
                                train_dataset=ByteDataset(steps * BATCH * ga, outlier, rows, ga),
                                optimizers=(opt, sched), compute_loss_func=sg_hf.SpikeguardLoss(),
                                callbacks=list(callbacks))


def guard_config(steps=STEPS, **kw):
    # the flat 3x-median grad rule (grad_z near 0): these test the framework's skip, not the bar
    return sg.GuardConfig(detector=sg.DetectorConfig.for_run(steps, arm_after=5, grad_z=0.01),
                          **kw)


class Snapshots(transformers.TrainerCallback):
    """Params, optimizer state and LR schedule position before and after every step."""

    def __init__(self):
        self.before, self.after, self.trainer = {}, {}, None

    def _snap(self, state):
        t = self.trainer
        opt = t.optimizer.optimizer.optimizer  # Accelerated -> Guarded -> AdamW
        params = {n: p.detach().clone() for n, p in t.model.named_parameters()}
        moments = {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                   for i, s in enumerate(opt.state.values())}
        sched = t.lr_scheduler
        return params, moments, sched.scheduler.last_epoch, opt.param_groups[0]["lr"]

    def on_step_begin(self, args, state, control, **kw):
        self.before[state.global_step] = self._snap(state)

    def on_step_end(self, args, state, control, **kw):
        self.after[state.global_step - 1] = self._snap(state)


def test_outlier_batch_is_skipped_and_nothing_moves(tmp_path):
    # the outlier 20 steps past OUTLIER: the grad rule turns on only after arm_after (5) and
    # arm_quiet (20) quiet updates, and this test is about that rule's skip
    steps, bad = STEPS + 20, OUTLIER + 20
    snaps = Snapshots()
    trainer = make_trainer(tmp_path, steps=steps, outlier=bad, callbacks=[snaps],
                           logging_steps=4)
    snaps.trainer = trainer
    callback = sg_hf.guard_trainer(trainer, config=guard_config(steps))
    assert isinstance(trainer.lr_scheduler, HeldScheduler)
    trainer.train()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(steps))
    assert [r["step"] for r in records if r["skipped"]] == [bad]
    assert records[bad]["action"] == "skip"
    # why: its grad norm is over 3x the median of the norms of the window before it
    window = guard_config(steps).detector.median_window
    prior = sorted(r["grad_norm"] for r in records[bad - window:bad])
    median = (prior[(window - 1) // 2] + prior[window // 2]) / 2
    assert records[bad]["grad_norm"] > 3 * median
    assert records[bad]["reasons"][0].startswith("grad_norm")
    # the guard reads the signals through the optimizer's step hooks: each applied update
    # moved the weights, the withheld one reads 0 (the update-ratio rule sees this framework too)
    ratios = [r.get("update_ratio") for r in records]
    assert ratios[bad] == 0 and all(v > 0 for i, v in enumerate(ratios) if i != bad)
    # the skipped step: params, AdamW moments and step count, schedule position, all unchanged
    p0, m0, pos0, lr0 = snaps.before[bad]
    p1, m1, pos1, lr1 = snaps.after[bad]
    assert same(p0, p1) and same_moments(m0, m1)
    assert pos1 == pos0 and lr1 == lr0
    # a normal step moves all three (the comparison above is not vacuous)
    q0, n0, qpos0, _ = snaps.before[bad - 1]
    q1, n1, qpos1, _ = snaps.after[bad - 1]
    assert not same(q0, q1) and not same_moments(n0, n1) and qpos1 == qpos0 + 1
    # the schedule position is the count of applied updates: step t used lr_lambda(applied)
    applied = 0
    for r in records:
        assert r["lr"] == pytest.approx(LR * lr_lambda(applied), rel=1e-12)
        applied += not r["skipped"]
    assert trainer.lr_scheduler.scheduler.last_epoch == applied == steps - 1
    assert trainer.lr_scheduler.held_steps == 1 and callback.guard.applied == applied
    # the five metrics reached the Trainer's log at every 4th step, and at the skip (a forced
    # entry), equal to the guard's record of that step
    logged = {h["step"] - 1: h for h in trainer.state.log_history if "spikeguard/loss" in h}
    assert sorted(logged) == sorted({*range(3, steps, 4), bad})
    for t, h in logged.items():
        for key in METRICS:
            assert h[f"spikeguard/{key}"] == pytest.approx(records[t][key], rel=1e-12)
        assert h["spikeguard/skipped"] == float(t == bad)
    assert logged[bad]["spikeguard/loss_ema_ratio"] > 1.0  # the NUL batch's loss jumped
    assert logged[steps - 1]["spikeguard/skips"] == 1.0
    assert callback.halted is None and callback.report_path is None


def test_nan_stops_the_trainer_with_a_report_then_raises(tmp_path):
    nan_step = 9
    snaps = Snapshots()
    trainer = make_trainer(tmp_path, callbacks=[snaps])
    snaps.trainer = trainer
    mlp = trainer.model.transformer.h[1].mlp

    def poison(module, args, output):
        if trainer.state.global_step == nan_step:
            return torch.full_like(output, float("nan"))
        return output

    mlp.register_forward_hook(poison)
    callback = sg_hf.guard_trainer(trainer, config=guard_config())
    with pytest.raises(sg.TrainingHalted) as exc:
        trainer.train()
    report = exc.value.report
    assert report.step == nan_step and any("non-finite" in r or "nan" in r.lower()
                                           for r in report.reasons)
    # the re-run of the batch names the module whose output went non-finite first
    assert report.traced and report.first_forward == "transformer.h.1.mlp"
    # the Trainer stopped its own way, right after the halted step
    assert trainer.control.should_training_stop
    assert trainer.state.global_step == nan_step + 1
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["step"] == nan_step and saved["reasons"] == list(report.reasons)
    assert "HALT at step 9" in (tmp_path / "report.txt").read_text()
    assert callback.report_path == tmp_path / "report.json"
    # the NaN never reached the weights or the optimizer, nor the schedule
    p0, m0, pos0, _ = snaps.before[nan_step]
    p1, m1, pos1, _ = snaps.after[nan_step]
    assert same(p0, p1) and same_moments(m0, m1) and pos1 == pos0
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert records[-1]["step"] == nan_step and records[-1]["action"] == "halt"
    assert math.isnan(records[-1]["loss"])
    last = [h for h in trainer.state.log_history if "spikeguard/loss" in h][-1]
    assert math.isnan(last["spikeguard/loss"]) and last["spikeguard/tier"] == 3.0


def test_gradient_accumulation_is_one_guard_step_of_the_whole_batch(tmp_path):
    trainer = make_trainer(tmp_path, steps=2, ga=2)
    reference = copy.deepcopy(trainer.model)
    callback = sg_hf.guard_trainer(trainer, config=guard_config())
    trainer.train()
    assert callback.guard.step_index == trainer.state.global_step == 2
    # update 0 is the mean over both micro-batches' tokens: CE + 1e-4 * logZ^2, in float64
    ids = torch.stack([trainer.train_dataset[i]["input_ids"] for i in range(2 * BATCH)])
    logits = reference(input_ids=ids).logits.double()
    lse = torch.logsumexp(logits[:, :-1], -1)
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, 256), ids[:, 1:].reshape(-1))
    (ce + 1e-4 * (lse ** 2).mean()).backward()
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in reference.parameters()))
    first = read_metrics(tmp_path / "metrics.jsonl")[0]
    assert first["grad_norm"] == pytest.approx(norm.item(), rel=1e-4)
    assert first["loss"] == pytest.approx(ce.item(), rel=1e-5)
    assert first["log_z"] == pytest.approx(lse.mean().item(), rel=1e-5)


def test_a_resume_continues_the_guard_steps_with_one_record_each(tmp_path):
    trainer = make_trainer(tmp_path, steps=6, save_strategy="steps", save_steps=4)
    callback = sg_hf.guard_trainer(trainer, config=guard_config(6))
    trainer.train()
    saved = tmp_path / "checkpoint-4" / sg_hf.GUARD_STATE
    assert json.loads(saved.read_text())["step_index"] == 4
    del callback
    shutil.rmtree(tmp_path / "checkpoint-6", ignore_errors=True)  # the run died after step 5
    again = make_trainer(tmp_path, steps=6, save_strategy="steps", save_steps=4)
    resumed = sg_hf.guard_trainer(again, config=guard_config(6))
    again.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    steps = [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")]
    assert steps == list(range(6))  # steps 4 and 5 ran again, once each; none restarted at 0
    assert resumed.guard.step_index == again.state.global_step == 6


def test_refuses_what_would_hide_a_spike(tmp_path):
    trainer = make_trainer(tmp_path, max_grad_norm=1.0)
    with pytest.raises(ValueError, match=r"max_grad_norm=1.0 .* max_grad_norm=0"):
        sg_hf.guard_trainer(trainer)
    trainer = make_trainer(tmp_path)
    trainer.compute_loss_func = None
    with pytest.raises(ValueError, match="compute_loss_func=SpikeguardLoss"):
        sg_hf.guard_trainer(trainer)
    trainer = make_trainer(tmp_path)
    with pytest.raises(ValueError, match="read_lag=1"):
        sg_hf.guard_trainer(trainer, config=sg.GuardConfig(read_lag=1))
    trainer = make_trainer(tmp_path, logging_nan_inf_filter=True)
    with pytest.warns(UserWarning, match="logging_nan_inf_filter=True"):
        sg_hf.guard_trainer(trainer)


def test_metrics_reach_tensorboard(tmp_path):
    """The guard's numbers reach the Trainer's reporters (TensorBoard here), not only its
    log_history: the callback adds them to the logs before any reporter sees them."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps = 6
    trainer = make_trainer(tmp_path, steps=steps, report_to="tensorboard")
    sg_hf.guard_trainer(trainer, config=guard_config(steps))
    trainer.train()
    records = read_metrics(tmp_path / "metrics.jsonl")
    (found,) = tmp_path.rglob("events.out.tfevents*")  # under output_dir/runs/<date>
    events = EventAccumulator(str(found.parent)).Reload()
    for key in METRICS:
        scalars = events.Scalars(f"train/spikeguard/{key}")
        assert [s.step for s in scalars] == list(range(1, steps + 1))
        for s, r in zip(scalars, records):  # TensorBoard stores float32
            assert s.value == pytest.approx(r[key], rel=1e-6, nan_ok=True)


# -- a Llama from a small config in README's loop ---------------------------------------------
def _acted(records):
    return {r["step"]: r for r in records if r["action"] != "continue"}


def test_llama_in_the_readme_loop_clean_takes_no_action_and_an_outlier_is_skipped(tmp_path,
                                                                                 one_thread):
    # the outlier at step 34 of 40: past arm_after (5) and the grad rule's arm_quiet (20) quiet
    # updates after it, so the skip is the grad rule's, as before quiet arming
    clean = readme_loop(tmp_path / "clean", steps=40)
    assert _acted(read_metrics(tmp_path / "clean" / "metrics.jsonl")) == {}
    run = readme_loop(tmp_path / "bad", steps=40, bad=34)
    records = read_metrics(tmp_path / "bad" / "metrics.jsonl")
    (rec,) = _acted(records).values()
    assert rec["step"] == 34 and rec["action"] == "skip" and rec["cause"] == "data"
    assert rec["reasons"][0] == "grad_norm > 3x median"
    # the re-run reproduced the step bit for bit, and a kept batch cleared the weights first
    assert rec["rerun"] == {"loss": rec["loss"], "grad_norm": rec["grad_norm"]}
    assert rec["weights_check"]["weights"] is False
    assert same(run["before"][0], run["after"][0])
    assert same_moments(run["before"][1], run["after"][1])
    # the steps before it are the clean run's, bit for bit (the guard changed nothing there)
    clean_records = read_metrics(tmp_path / "clean" / "metrics.jsonl")
    assert [r["loss"] for r in records[:34]] == [r["loss"] for r in clean_records[:34]]
    del clean


def test_llama_in_the_readme_loop_halts_on_nan_naming_the_module(tmp_path, one_thread):
    with pytest.raises(sg.TrainingHalted) as exc:
        readme_loop(tmp_path, nan_at=9)
    report = exc.value.report
    assert report.step == 9 and report.traced
    assert report.first_forward == "model.layers.1.mlp"
    assert all(n.startswith(("model.layers.", "model.norm", "lm_head", "model.embed"))
               for n in report.nonfinite_params) and report.nonfinite_params


def test_llama_a_corrupt_sample_is_quarantined_not_a_halt_under_drop_sequences(tmp_path):
    """One sequence of step 12 (row 3) has inf embeddings: the loss and every gradient are
    non-finite, but only that row's loss is. With drop_sequences the guard quarantines it,
    re-runs the step without it and applies that update (no halt); the record and
    quarantine.jsonl name the batch and the row. Without drop_sequences it halts, and a NaN no
    row explains (every row's MLP output) halts under drop_sequences too."""
    run = readme_loop(tmp_path / "drop", corrupt=(12, 3), drop_sequences=True)
    records = read_metrics(tmp_path / "drop" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(20))
    (rec,) = _acted(records).values()
    assert rec["step"] == 12 and rec["action"] == "drop" and rec["skipped"] is False
    assert rec["kept_rows"] == [7, 8] and math.isfinite(rec["kept_grad_norm"])
    assert any("applied without them instead of a halt" in r for r in rec["reasons"])
    assert any("batch 12 rank 0 row 3" in r for r in rec["reasons"])
    (q,) = [json.loads(line) for line in
            (tmp_path / "drop" / "quarantine.jsonl").read_text().splitlines()]
    assert (q["step"], q["stream_index"], q["row"], q["z"]) == (12, 12, 3, "Infinity")
    assert not same(run["before"][0], run["after"][0])  # the other 7 rows' update applied
    assert all(torch.isfinite(p).all() for p in run["model"].parameters())
    with pytest.raises(sg.TrainingHalted) as exc:
        readme_loop(tmp_path / "halt", corrupt=(12, 3))
    assert exc.value.report.step == 12
    with pytest.raises(sg.TrainingHalted) as exc:
        readme_loop(tmp_path / "nan", nan_at=9, drop_sequences=True)
    assert exc.value.report.step == 9


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_llama_accumulation_with_dropout_names_the_rows_and_never_guesses_transient(
        tmp_path, one_thread, dropout):
    """k = 2 micro-batches of 4 rows, HF attention dropout (functional: no nn.Dropout) at 0.1,
    rows 5-7 of step 34's batch garbage (micro-batch 1, rows 1-3). The guard noted each
    forward's RNG state itself (no guard.autocast in the loop), so its re-run draws the same
    masks: the step reproduces and the cause is data; quarantine.jsonl names the stream batch,
    the rows in it, the micro-batch and the rows within that."""
    from spikeguard.guard.micro import stochastic

    # step 34 of 40 (was 14 of 20): past arm_after (5) and the grad rule's arm_quiet (20)
    run = readme_loop(tmp_path, steps=40, k=2, dropout=dropout, bad=34, bad_rows=slice(5, 8))
    assert (stochastic(run["model"]) is not None) == (dropout > 0)
    records = read_metrics(tmp_path / "metrics.jsonl")
    (rec,) = _acted(records).values()
    assert rec["step"] == 34 and rec["action"] == "skip"
    assert rec["reasons"][0] == "grad_norm > 3x median"
    assert rec["cause"] in ("data", "unknown") and rec["cause"] != "transient"
    assert rec["cause"] == "data"  # here the re-run could be faithful, so it is
    assert same(run["before"][0], run["after"][0])
    quarantined = [json.loads(line) for line in
                   (tmp_path / "quarantine.jsonl").read_text().splitlines()]
    assert [(q["step"], q["stream_index"], q["row"], q["micro_batch"], q["micro_row"])
            for q in quarantined] == [(34, 34, r, 1, r - 4) for r in (5, 6, 7)]


# -- the same Llama in HF Trainer -------------------------------------------------------------
def test_llama_in_hf_trainer_clean_takes_no_action_and_an_outlier_is_skipped(tmp_path,
                                                                            one_thread):
    # the outlier at step 34 of 38 (was 14 of 18): past arm_after (5) and the grad rule's
    # arm_quiet (20) quiet updates after it
    steps = 38
    trainer = make_trainer(tmp_path / "clean", steps=steps, model=llama())
    sg_hf.guard_trainer(trainer, config=guard_config(steps))
    trainer.train()
    assert _acted(read_metrics(tmp_path / "clean" / "metrics.jsonl")) == {}
    snaps = Snapshots()
    trainer = make_trainer(tmp_path / "bad", steps=steps, model=llama(), outlier=34,
                           callbacks=[snaps])
    snaps.trainer = trainer
    # the input-token check off: a batch it flags gets no weights check and no re-run, and
    # this test is of those (the check in HF Trainer: test_hf_trainer_passes_the_input_ids)
    sg_hf.guard_trainer(trainer, config=guard_config(steps, token_z=0))
    trainer.train()
    (rec,) = _acted(read_metrics(tmp_path / "bad" / "metrics.jsonl")).values()
    assert rec["step"] == 34 and rec["action"] == "skip"
    assert rec["reasons"][0] == "grad_norm > 3x median"
    # each micro-batch's closure holds its batch: the weights check and the re-run both ran
    assert rec["cause"] == "data" and rec["weights_check"]["weights"] is False
    p0, m0, pos0, _ = snaps.before[34]
    p1, m1, pos1, _ = snaps.after[34]
    assert same(p0, p1) and same_moments(m0, m1) and pos1 == pos0


def test_llama_in_hf_trainer_halts_on_nan_naming_the_module(tmp_path, one_thread):
    trainer = make_trainer(tmp_path, steps=12, model=llama())
    switch = {"on": False}
    poison_mlp(trainer.model, switch)

    class At(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            switch["on"] = state.global_step >= 9

    trainer.add_callback(At())
    sg_hf.guard_trainer(trainer, config=guard_config(12))
    with pytest.raises(sg.TrainingHalted) as exc:
        trainer.train()
    assert exc.value.report.step == 9 and exc.value.report.first_forward == "model.layers.1.mlp"
    assert json.loads((tmp_path / "report.json").read_text())["step"] == 9


def test_llama_in_hf_trainer_accumulation_with_dropout_is_never_transient(tmp_path,
                                                                         one_thread):
    """2 micro-batches a step, attention dropout 0.1 (functional, no nn.Dropout), step 34's
    micro-batches a run of NUL bytes: each micro-batch's closure re-runs under the RNG state its
    forward started from, so the step reproduces: cause data (before, the re-run drew other
    masks, and a guess said transient). A few corrupt rows are too few to flag on this model
    this early in the Trainer's schedule; README's loop test names such rows."""
    steps = 38  # the outlier at 34 (was 14 of 18): past arm_after (5) and arm_quiet (20)
    trainer = make_trainer(tmp_path, steps=steps, model=llama(dropout=0.1), ga=2, outlier=34)
    sg_hf.guard_trainer(trainer, config=guard_config(steps))
    trainer.train()
    (rec,) = _acted(read_metrics(tmp_path / "metrics.jsonl")).values()
    assert rec["step"] == 34 and rec["action"] == "skip"
    assert rec["reasons"][0] == "grad_norm > 3x median"
    assert rec["cause"] in ("data", "unknown") and rec["cause"] == "data"


def test_llama_in_hf_trainer_a_corrupt_sample_is_dropped_not_a_halt(tmp_path):
    """drop_sequences: row 2 of step 12 is a sequence whose embeddings go inf; the guard
    quarantines it, re-runs the step without it (the Trainer's inputs and labels, sliced by the
    closure) and applies that update: the Trainer trains on, no halt."""
    steps = 16
    trainer = make_trainer(tmp_path, steps=steps, model=llama())
    trainer.train_dataset.seqs[12 * BATCH + 2] = torch.full((SEQ,), CORRUPT, dtype=torch.int64)
    corrupt_embeddings(trainer.model)
    det = guard_config(steps).detector
    sg_hf.guard_trainer(trainer, config=sg.GuardConfig(
        detector=det, attribution=sg.AttributionConfig(drop_sequences=True)))
    trainer.train()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(steps))
    (rec,) = _acted(records).values()
    assert rec["step"] == 12 and rec["action"] == "drop" and rec["kept_rows"] == [3, 4]
    assert any("row 2 (micro-batch 0 row 2, z inf)" in r for r in rec["reasons"])
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_a_fresh_trainer_run_into_the_same_output_dir_starts_its_metrics_anew(tmp_path,
                                                                             one_thread):
    (tmp_path / "report.json").write_text("{}")  # an earlier run's halt report
    for _ in range(2):
        trainer = make_trainer(tmp_path, steps=4)
        sg_hf.guard_trainer(trainer, config=guard_config(4))
        trainer.train()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3]
    assert not (tmp_path / "report.json").exists()


def test_per_layer_signals_follow_the_blocks_of_hf_models(tmp_path):
    """The update ratio per layer groups by the model's blocks (model.layers.N in a Llama,
    transformer.h.N in GPT-2), not by the top-level child (``model`` and ``lm_head``)."""
    from spikeguard.measure.signals import layer_of

    assert layer_of("model.layers.3.self_attn.q_proj.weight") == "model.layers.3"
    assert layer_of("module.model.layers.0.mlp.experts.7.w1") == "module.model.layers.0"
    assert layer_of("transformer.h.1.mlp.c_fc.weight") == "transformer.h.1"
    assert layer_of("model.embed_tokens.weight") == "model.embed_tokens"
    assert layer_of("blocks.3.attn.qkv.weight") == "blocks.3" and layer_of("wte.weight") == "wte"
    readme_loop(tmp_path, steps=6)
    record = read_metrics(tmp_path / "metrics.jsonl")[-1]
    groups = sorted(k.split("/", 1)[1] for k in record if k.startswith("update_ratio/"))
    assert groups == ["lm_head", "model.embed_tokens", "model.layers.0", "model.layers.1",
                      "model.norm"]
    trainer = make_trainer(tmp_path / "gpt2", steps=4)
    sg_hf.guard_trainer(trainer, config=guard_config(4))
    trainer.train()
    record = read_metrics(tmp_path / "gpt2" / "metrics.jsonl")[-1]
    assert {"update_ratio/transformer.h.0", "update_ratio/transformer.h.1"} <= set(record)


class PaddedDataset(ByteDataset):
    """ByteDataset's rows with a tail of padding (id 0, attention 0, label -100) whose length
    varies from row to row, 0 to 3/4 of the row; the outlier batch as ByteDataset's (NUL)."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        item = super().__getitem__(i)
        pad = (i * 5) % (3 * SEQ // 4)
        mask = torch.ones(SEQ, dtype=torch.int64)
        if pad:
            mask[-pad:] = 0
            item["input_ids"][-pad:] = 0
            item["labels"][-pad:] = -100
        item["attention_mask"] = mask
        return item


def test_the_input_ids_of_a_model_call_with_padding_marked():
    ids = torch.tensor([[5, 6, 7], [8, 9, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    assert torch.equal(input_ids((), {"input_ids": ids, "attention_mask": mask}),
                       torch.tensor([[5, 6, 7], [8, 9, -1]]))
    assert input_ids((ids,), {}) is ids
    assert input_ids((), {"inputs_embeds": torch.zeros(2, 3, 4)}) is None


def test_hf_trainer_passes_the_input_ids(tmp_path):
    """Padded rows (a varying share of pad id 0) take no action; a batch of NUL bytes at step
    12 is skipped for its input ids (the reason says so), with params, moments and LR position
    untouched."""
    steps = 16
    trainer = make_trainer(tmp_path / "clean", steps=steps)
    trainer.train_dataset = PaddedDataset(steps * BATCH)
    sg_hf.guard_trainer(trainer, config=guard_config(steps))
    trainer.train()
    assert _acted(read_metrics(tmp_path / "clean" / "metrics.jsonl")) == {}
    snaps = Snapshots()
    trainer = make_trainer(tmp_path / "bad", steps=steps, callbacks=[snaps])
    trainer.train_dataset = PaddedDataset(steps * BATCH, outlier_step=12)
    snaps.trainer = trainer
    sg_hf.guard_trainer(trainer, config=guard_config(steps))
    trainer.train()
    (rec,) = _acted(read_metrics(tmp_path / "bad" / "metrics.jsonl")).values()
    assert rec["step"] == 12 and rec["action"] == "skip" and rec["cause"] == "data"
    assert any(r.startswith("tokens: ") for r in rec["reasons"])
    p0, m0, pos0, _ = snaps.before[12]
    p1, m1, pos1, _ = snaps.after[12]
    assert same(p0, p1) and same_moments(m0, m1) and pos1 == pos0

"""The guard inside OLMo-core's Trainer (spikeguard.integrations.olmo_core), on CPU in one
process with a one-layer llama-like Transformer of OLMo-core's own: an outlier batch is skipped
with params, moments and LR schedule exactly as they were; a NaN gradient halts naming the tensor
and raises out of fit() (a script's non-zero exit) with the report; a resume from the Trainer's
checkpoint continues the steps with one record each and the LR where it was."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import spikeguard as sg
from spikeguard.data import load_corpus
from spikeguard.sinks import read_metrics

olmo_core = pytest.importorskip(
    "olmo_core", reason="OLMo-core is not installed: scripts/install.sh installs it "
    "(pip install --no-deps ai2-olmo-core==3.0.0 and its small pure-Python dependencies)")

from olmo_core.data.data_loader import DataLoaderBase  # noqa: E402
from olmo_core.nn.transformer import TransformerConfig  # noqa: E402
from olmo_core.optim import AdamWConfig, CosWithWarmup  # noqa: E402
from olmo_core.train import Duration, TrainerConfig  # noqa: E402
from olmo_core.train.callbacks import Callback, CheckpointerCallback  # noqa: E402
from olmo_core.train.train_module import TransformerTrainModuleConfig  # noqa: E402

from spikeguard.integrations._olmo_chain import RunLedger  # noqa: E402
from spikeguard.integrations.olmo_core import SpikeguardCallback, next_config  # noqa: E402

# OLMo-core's attention has no attention_layout(), which the logit bound needs: it warns once,
# naming the class (tests/test_layout.py tests the warning)
pytestmark = pytest.mark.filterwarnings(
    "ignore:the attention-logit bound found no attention it can read in Transformer:UserWarning")

SEQ, ROWS, STEPS, OUTLIER = 32, 8, 12, 10


class ByteLoader(DataLoaderBase):
    """Consecutive windows of the corpus' bytes; batch ``outlier`` (1-based, as the Trainer's
    steps; or a range of them) is NUL bytes."""

    def __init__(self, work_dir, outlier=None):
        super().__init__(work_dir=work_dir, global_batch_size=ROWS * SEQ)
        self.tokens = load_corpus("pydoc").train
        self.outliers = set(outlier) if isinstance(outlier, (range, list)) else {outlier}

    @property
    def total_batches(self):
        return 1000

    def state_dict(self):
        return {"batches_processed": self.batches_processed, "epoch": self._epoch}

    def load_state_dict(self, state):
        self.batches_processed, self._epoch = state["batches_processed"], state["epoch"]

    def reshuffle(self, epoch=None, **kwargs):
        self._epoch = epoch or 1

    def _iter_batches(self):
        i = self.batches_processed
        while True:
            ids = self.tokens[i * ROWS * SEQ:(i + 1) * ROWS * SEQ].astype(np.int64)
            ids = torch.from_numpy(ids).view(ROWS, SEQ)
            yield {"input_ids": torch.zeros_like(ids) if i + 1 in self.outliers else ids}
            i += 1

    def get_mock_batch(self):
        return {"input_ids": torch.ones(ROWS, SEQ, dtype=torch.long)}

    def global_num_tokens_in_batch(self, batch):
        return batch["input_ids"].numel()


class Probe(Callback):
    """Params, moments and LR around each step; a NaN in one gradient at ``nan_at``; a crash
    (an error out of fit) before step ``crash_at``."""

    priority = 5

    def __init__(self, nan_at=None, crash_at=None, scale_at=()):
        self.nan_at, self.crash_at, self.before, self.after = nan_at, crash_at, {}, {}
        self.scale_at = scale_at

    def _snap(self):
        tm = self.trainer.train_module
        return ({k: v.detach().clone() for k, v in tm.model.state_dict().items()},
                {i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(tm.optim.state.values())})

    def pre_step(self, batch):
        if self.step == self.crash_at:
            raise RuntimeError("the node went away")
        self.before[self.step] = self._snap()

    def pre_optim_step(self):
        if self.step == self.nan_at:
            self.trainer.train_module.model.blocks["0"].feed_forward.w1.weight.grad.view(-1)[0] = \
                float("nan")
        if self.step in self.scale_at:
            for p in self.trainer.train_module.model.parameters():
                p.grad.mul_(1000.0)

    def post_train_batch(self):
        self.after[self.step] = self._snap()


def trainer_config(tmp_path, *, probe=None, steps=STEPS, save=None):
    callbacks = {"checkpointer": CheckpointerCallback(save_interval=save or 1000)}
    if probe is not None:
        callbacks["probe"] = probe
    return TrainerConfig(save_folder=str(tmp_path / "save"), save_overwrite=True,
                         max_duration=Duration.steps(steps), device="cpu",
                         metrics_collect_interval=1, callbacks=callbacks)


def make_trainer(tmp_path, *, outlier=None, probe=None, steps=STEPS, save=None, config=None,
                 storm=2, lr_scale=0.5, seed=0, detector=None, respond=True, keep=True,
                 max_rollbacks=3, token_z=0.0, **guard_kw):
    # token_z 0: the input-token check off, so the outliers here test the rules that read the
    # model, the weights check and the responses (the check: test_the_input_ids_reach_the_guard)
    torch.manual_seed(seed)
    model = TransformerConfig.llama_like(vocab_size=256, d_model=32, n_layers=1,
                                         n_heads=2).build(init_device="cpu")
    tm = TransformerTrainModuleConfig(
        rank_microbatch_size=ROWS // 2 * SEQ, max_sequence_length=SEQ,  # 2 micro-batches
        optim=AdamWConfig(lr=3e-3), scheduler=CosWithWarmup(warmup_steps=3),
        max_grad_norm=None).build(model, device=torch.device("cpu"))
    given = config is not None
    config = config or trainer_config(tmp_path, probe=probe, steps=steps, save=save)
    trainer = config.build(tm, ByteLoader(tmp_path / "work", outlier))
    if given and probe is not None:
        trainer.add_callback("probe", probe)
    det = detector or sg.DetectorConfig.for_run(steps, arm_after=5, grad_z=0.01,
                                                max_consecutive_skips=storm)
    cb = SpikeguardCallback(config=sg.GuardConfig(detector=det, rollback_lr_scale=lr_scale,
                                                  rollback_lr_keep=keep,
                                                  max_rollbacks=max_rollbacks, respond=respond,
                                                  token_z=token_z),
                            out_dir=guard_kw.pop(
        "out_dir", tmp_path), **guard_kw)
    trainer.add_callback("spikeguard", cb)
    return trainer, cb


def _same(a, b):
    (pa, sa), (pb, sb) = a, b
    return all(torch.equal(pa[k], pb[k]) for k in pa) and all(
        torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])


def test_the_input_ids_reach_the_guard(tmp_path):
    """model_forward hands the guard each micro-batch's input ids: the outlier batch (random
    bytes) is skipped for them at the default token_z, and nothing moves."""
    steps, at = STEPS + 20, OUTLIER + 20
    probe = Probe()
    trainer, _ = make_trainer(tmp_path, outlier=at, probe=probe, steps=steps,
                               token_z=sg.GuardConfig().token_z)
    trainer.fit()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records if r["skipped"]] == [at]
    bad = records[at - 1]
    assert bad["cause"] == "data" and any(r.startswith("tokens: ") for r in bad["reasons"])
    assert _same(probe.before[at], probe.after[at])


def test_an_outlier_batch_is_skipped_and_nothing_moves(tmp_path, caplog):
    # the outlier 20 steps past OUTLIER: the grad rule turns on only after arm_after (5) and
    # arm_quiet (20) quiet updates, and the skip here is that rule's
    steps, at = STEPS + 20, OUTLIER + 20
    probe = Probe()
    trainer, cb = make_trainer(tmp_path, outlier=at, probe=probe, steps=steps)
    trainer.fit()
    records = read_metrics(tmp_path / "metrics.jsonl")
    # the Trainer's numbers; the skipped update is made up by one more step
    assert [r["step"] for r in records] == list(range(1, steps + 2))
    assert trainer.global_step == steps + 1
    assert [r["step"] for r in records if r["skipped"]] == [at]
    # the re-run closure from the train module: the skip is attributed, the weights checked
    bad = records[at - 1]
    assert bad["cause"] == "data" and "weights check" in "; ".join(bad["reasons"])
    assert bad["reasons"][0] == "grad_norm > 3x median"
    # the skip in OLMo-core's console, a warning of one of its own loggers
    assert [r.getMessage()[:25] for r in caplog.records
            if r.name == "olmo_core.train.spikeguard"] == [f"spikeguard: step {at}: skip"]
    assert _same(probe.before[at], probe.after[at])
    assert not _same(probe.before[at - 1], probe.after[at - 1])
    lrs = [r["lr"] for r in records]
    # held: the step after the skip gets the skipped step's LR, the schedule one step behind
    assert lrs[at] == lrs[at - 1] != lrs[at - 2]
    assert cb.schedule.held_steps == 1 and cb.guard.applied == steps
    assert all(r["log_z"] > 0 for r in records)  # from the logits of the loss's own pass
    # the signals read the update through the optimizer's step hooks (steps are 1-based here)
    ratios = [r.get("update_ratio") for r in records]
    assert ratios[at - 1] == 0
    assert all(v > 0 for i, v in enumerate(ratios) if i != at - 1), ratios
    assert trainer.train_module.optim is cb.parts.optimizer.optimizer  # the plain one is back
    # diagnose replays the run with its own thresholds and checkpoint interval (config.json)
    from spikeguard.diagnose import diagnose

    d = diagnose(tmp_path / "metrics.jsonl")
    assert d.replay.config == cb.guard.config.detector and d.ckpt_every == 1000
    assert at in [v.step for v in d.replay.flagged if v.action is sg.Action.SKIP]


def test_a_nan_gradient_halts_naming_the_tensor_and_raises_out_of_fit(tmp_path):
    trainer, cb = make_trainer(tmp_path, probe=Probe(nan_at=4))
    with pytest.raises(sg.TrainingHalted) as halt:
        trainer.fit()
    assert "blocks.0.feed_forward.w1.weight" in str(halt.value)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["step"] == 4 and cb.report_path == tmp_path / "report.json"
    # the step re-run through the train module with hooks (a NaN planted in a gradient: the
    # forward and backward of the re-run stay finite, so no module is named)
    assert report["traced"] is True and report["first_forward"] is None
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert records[-1]["step"] == 4 and records[-1]["action"] == "halt"


def test_a_resume_continues_the_steps_and_the_lr(tmp_path):
    clean, _ = make_trainer(tmp_path / "clean", steps=6)
    clean.fit()
    want = read_metrics(tmp_path / "clean" / "metrics.jsonl")
    crashed, _ = make_trainer(tmp_path, steps=6, save=3, probe=Probe(crash_at=5))
    with pytest.raises(RuntimeError, match="went away"):
        crashed.fit()
    resumed, cb = make_trainer(tmp_path, steps=6, save=3)
    resumed.fit()  # loads the checkpoint of step 3 from the save folder
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 7))
    assert [r["lr"] for r in records] == [r["lr"] for r in want]
    assert [r["loss"] for r in records] == [r["loss"] for r in want]  # bit-identical run
    assert cb.guard.applied == 6


def ckpt_folders(root):
    """Every OLMo-core checkpoint folder under ``root`` (each launch's save folder)."""
    return {str(p) for p in root.rglob("step*") if p.is_dir() and p.name[4:].isdigit()}


def held_out_loss(trainer):
    """Cross-entropy of the trained model on fixed held-out windows, in float64."""
    val = load_corpus("pydoc").val
    x = torch.from_numpy(val[:8 * (SEQ + 1)].astype(np.int64)).view(8, SEQ + 1)
    model = trainer.train_module.model
    with torch.no_grad():
        logits = model(x[:, :-1]).double()
    return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()))


def launches(tmp_path, config, *, bad=None, probe=None, lr_scale=0.5, **guard):
    """The cross-job recipe: run ``next_config(config)`` until a launch ends without stopping
    for a relaunch (each launch a new Trainer and callback, as a new job would build them)."""
    # arm_quiet=1: the grad rule turns on after arm_after (5) and one quiet update, as early as
    # it did before quiet arming, ahead of the faults at steps 7-14; these tests are about the
    # relaunches, and faults 20 steps later would double the runs and move every checkpoint.
    # (arm_quiet also sets the skip storm's calm, never reached here: each storm ends the launch)
    det = sg.DetectorConfig.for_run(STEPS2, arm_after=5, grad_z=0.01, max_consecutive_skips=1,
                                    arm_quiet=1)
    ran, found = [], []
    while True:
        now = next_config(config)
        trainer, cb = make_trainer(tmp_path, steps=STEPS2, outlier=bad, config=now, detector=det,
                                   cancel_on_tier2=True, out_dir=now.save_folder, probe=probe,
                                   lr_scale=lr_scale, **guard)
        try:
            trainer.fit()
        finally:
            found.append(ckpt_folders(tmp_path))
            ran.append((now, trainer, cb))
        if cb.record.tier2 is None:
            return ran, found


STEPS2 = 20


def test_two_tier2s_relaunch_twice_keep_every_checkpoint_and_end_near_clean(tmp_path):
    clean, _ = make_trainer(tmp_path / "clean", steps=STEPS2, config=trainer_config(
        tmp_path / "clean", steps=STEPS2, save=4))
    clean.fit()
    bad = [7, 8, 13, 14]  # two pairs of NUL batches: two skip storms (Tier 2)
    config = trainer_config(tmp_path / "run", steps=STEPS2, save=4)  # OLMo-core keeps 3
    # replayed at the scheduled LR: this run's LR decays to its floor by step 20, and a half-LR
    # replay of 8 of its 20 steps would leave it behind for that reason alone (the ramp: below)
    ran, found = launches(tmp_path / "run", config, bad=bad, lr_scale=1.0)
    assert len(ran) == 3  # the run and two relaunches
    # no launch deleted a checkpoint an earlier one left (the first run's healthy ones above all)
    for earlier in found:
        assert earlier <= found[-1], sorted(earlier - found[-1])
    first, second = (RunLedger.read(r[0].save_folder) for r in ran[1:])
    root = tmp_path / "run" / "save"
    (one,), (_, two) = first.incidents, second.incidents
    assert (one.detection, two.detection) == (8, 14)  # each at its storm's second skip
    assert first.launch["load_path"] == str((root / "step4").resolve())  # at or before onset - 2
    assert first.launch["steps_to_skip"] == [[one.onset, 9]]
    assert second.launch["steps_to_skip"] == [[one.onset, 9], [two.onset, 15]]
    # the second rolls back to the relaunch's own step 8 (healthy), not to the canceled run's
    assert second.launch["load_path"].endswith("relaunch1/step8")
    assert [i.restored for i in second.incidents] == [4, 8]
    records = read_metrics(Path(ran[-1][0].save_folder) / "metrics.jsonl")
    left_out = (9 - one.onset) + (15 - two.onset)
    assert records[-1]["step"] == STEPS2 + left_out  # the steps left out are made up
    assert not any(r["skipped"] for r in records)
    lrs = {r["step"]: r["lr"] for r in records}
    want = {r["step"]: r["lr"] for r in read_metrics(tmp_path / "clean" / "metrics.jsonl")}
    # the schedule held over the steps left out, to its end
    assert lrs[9] == pytest.approx(want[9 - (9 - one.onset)])
    assert lrs[STEPS2 + left_out] == pytest.approx(want[STEPS2])
    got, ref = held_out_loss(ran[-1][1]), held_out_loss(clean)
    assert abs(got - ref) <= 0.02 * ref, (got, ref)


def test_a_fault_that_returns_on_replay_halts_with_its_reason(tmp_path):
    # the gradients x1000 at steps 11-14: not the data. Later than arm_after (5) + arm_quiet
    # (1: launches) so that the checkpoint the relaunch restores (step 8) has the grad rule on:
    # from step 4's, the replay's first judged update is the fault itself, which restarts the
    # quiet count, and the fault would come back unseen. Without rollback_lr_keep a relaunch
    # would replay it at the same LR: the chain halts at once
    probe = Probe(scale_at=range(11, 15))
    config = trainer_config(tmp_path / "run", steps=STEPS2, save=4)
    with pytest.raises(sg.TrainingHalted, match="came back on replay"):
        launches(tmp_path / "run", config, probe=probe, keep=False)
    relaunch = tmp_path / "run" / "save-relaunch1"
    assert "not the data" in (relaunch / "report.txt").read_text()
    first = {r["step"]: r["lr"] for r in read_metrics(tmp_path / "run" / "save" /
                                                          "metrics.jsonl")}
    again = {r["step"]: r["lr"] for r in read_metrics(relaunch / "metrics.jsonl")}
    assert again[9] == pytest.approx(0.5 * first[9])  # the replay ramps up from half the LR


def test_a_fault_that_returns_on_replay_is_relaunched_at_a_kept_lower_lr(tmp_path):
    # the default (rollback_lr_keep): a Tier 2 that came back on the replay (the x1000 gradients
    # of steps 11-14 at 13, after the first relaunch left out 11-12) is relaunched again, from
    # 0.25x the LR, kept there for good, as the guard's own rollback does
    probe = Probe(scale_at=range(11, 15))
    config = trainer_config(tmp_path / "run", steps=STEPS2, save=4)
    ran, _ = launches(tmp_path / "run", config, probe=probe)
    assert len(ran) == 3
    root = tmp_path / "run"
    one, two = (RunLedger.read(root / f"save-relaunch{n}") for n in (1, 2))
    assert one.launch["lr_ramp"][2:] == [0.5, 1.0]  # the first ramps back to the schedule
    assert two.launch["lr_ramp"][2:] == [0.25, 0.25]  # the second stays at its start
    clean, _ = make_trainer(tmp_path / "clean", steps=STEPS2, config=trainer_config(
        tmp_path / "clean", steps=STEPS2, save=4))
    clean.fit()
    want = {r["step"]: r["lr"] for r in read_metrics(tmp_path / "clean" / "metrics.jsonl")}
    again = read_metrics(root / "save-relaunch2" / "metrics.jsonl")
    start, end = two.launch["lr_ramp"][:2]
    # against the clean run's LR at the same schedule position (the steps left out hold it)
    left = {r["step"]: sum(max(0, min(r["step"], b) - a) for a, b in two.launch["steps_to_skip"])
            for r in again}
    ratios = {r["step"]: r["lr"] / want[r["step"] - left[r["step"]]] for r in again
              if r["step"] >= start}
    assert ratios[start] == pytest.approx(0.25)
    after = [v for s, v in ratios.items() if s > end]
    assert len(after) >= 5 and all(v == pytest.approx(0.25) for v in after), ratios
    assert again[-1]["step"] == STEPS2 + sum(b - a for a, b in two.launch["steps_to_skip"])


def test_the_relaunch_chain_stops_at_a_recurrence_it_cannot_cure_or_at_its_budget(tmp_path):
    from spikeguard.integrations._incidents import Incident

    run = RunLedger(folder=tmp_path, lr_scale=0.5, lr_keep=True, max_rollbacks=2,
                    incidents=[Incident(onset=11, detection=12, restored=8, skipped=2)])
    assert run.stopped(13) is None  # came back, but a relaunch keeps the LR lower
    run.lr_keep = False
    assert run.stopped(13) == "came back"
    assert run.stopped(30) is None  # a new anomaly, after the replay: the data's
    run.lr_keep, run.lr_scale = True, 1.0  # a replay at the same LR cures nothing
    assert run.stopped(13) == "came back"
    run.lr_scale = 0.5
    run.incidents.append(Incident(onset=13, detection=14, restored=8, skipped=2))
    assert run.stopped(30).startswith("rollback budget of 2 exhausted")
    run.write()
    assert RunLedger.read(tmp_path).max_rollbacks == 2 and RunLedger.read(tmp_path).lr_keep

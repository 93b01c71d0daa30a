"""The guard inside OLMo-core's Trainer (spikeguard.integrations.olmo_core), on CPU in one
process with a one-layer llama-like Transformer of OLMo-core's own: an outlier batch is skipped
with params, moments and LR schedule exactly as they were; a NaN gradient halts naming the tensor
and raises out of fit() (a script's non-zero exit) with the report; a resume from the Trainer's
checkpoint continues the steps with one record each and the LR where it was."""

from __future__ import annotations

import json

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

from spikeguard.integrations.olmo_core import SpikeguardCallback, relaunch_config  # noqa: E402

SEQ, ROWS, STEPS, OUTLIER = 32, 8, 12, 10


class ByteLoader(DataLoaderBase):
    """Consecutive windows of the corpus' bytes; batch ``outlier`` (1-based, as the Trainer's
    steps; or a range of them) is NUL bytes."""

    def __init__(self, work_dir, outlier=None):
        super().__init__(work_dir=work_dir, global_batch_size=ROWS * SEQ)
        self.tokens = load_corpus("pydoc").train
        self.outliers = set(outlier) if isinstance(outlier, range) else {outlier}

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

    def __init__(self, nan_at=None, crash_at=None):
        self.nan_at, self.crash_at, self.before, self.after = nan_at, crash_at, {}, {}

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
                 storm=2, **guard_kw):
    torch.manual_seed(0)
    model = TransformerConfig.llama_like(vocab_size=256, d_model=32, n_layers=1,
                                         n_heads=2).build(init_device="cpu")
    tm = TransformerTrainModuleConfig(
        rank_microbatch_size=ROWS // 2 * SEQ, max_sequence_length=SEQ,  # 2 micro-batches
        optim=AdamWConfig(lr=3e-3), scheduler=CosWithWarmup(warmup_steps=3),
        max_grad_norm=None).build(model, device=torch.device("cpu"))
    config = config or trainer_config(tmp_path, probe=probe, steps=steps, save=save)
    trainer = config.build(tm, ByteLoader(tmp_path / "work", outlier))
    det = sg.DetectorConfig.for_run(steps, arm_after=5, grad_z=0.01, max_consecutive_skips=storm)
    cb = SpikeguardCallback(config=sg.GuardConfig(detector=det), out_dir=guard_kw.pop(
        "out_dir", tmp_path), **guard_kw)
    trainer.add_callback("spikeguard", cb)
    return trainer, cb


def _same(a, b):
    (pa, sa), (pb, sb) = a, b
    return all(torch.equal(pa[k], pb[k]) for k in pa) and all(
        torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])


def test_an_outlier_batch_is_skipped_and_nothing_moves(tmp_path):
    probe = Probe()
    trainer, cb = make_trainer(tmp_path, outlier=OUTLIER, probe=probe)
    trainer.fit()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # the Trainer's numbers
    assert [r["step"] for r in records if r["skipped"]] == [OUTLIER]
    assert _same(probe.before[OUTLIER], probe.after[OUTLIER])
    assert not _same(probe.before[OUTLIER - 1], probe.after[OUTLIER - 1])
    lrs = [r["lr"] for r in records]
    # held: the step after the skip gets the skipped step's LR, the schedule one step behind
    assert lrs[OUTLIER] == lrs[OUTLIER - 1] != lrs[OUTLIER - 2]
    assert cb.schedule.held_steps == 1 and cb.guard.applied == STEPS - 1
    assert all(r["log_z"] > 0 for r in records)  # from the logits of the loss's own pass
    # the signals read the update through the optimizer's step hooks (steps are 1-based here)
    ratios = [r.get("update_ratio") for r in records]
    assert ratios[OUTLIER - 1] == 0
    assert all(v > 0 for i, v in enumerate(ratios) if i != OUTLIER - 1), ratios
    assert trainer.train_module.optim is cb.parts.optimizer.optimizer  # the plain one is back


def test_a_nan_gradient_halts_naming_the_tensor_and_raises_out_of_fit(tmp_path):
    trainer, cb = make_trainer(tmp_path, probe=Probe(nan_at=4))
    with pytest.raises(sg.TrainingHalted) as halt:
        trainer.fit()
    assert "blocks.0.feed_forward.w1.weight" in str(halt.value)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["step"] == 4 and cb.report_path == tmp_path / "report.json"
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


def test_a_tier2_cancel_and_relaunch_leaves_the_anomaly_out(tmp_path):
    # (against a clean run: benchmarks/olmo_rollback.py, 0.81% at 80 steps; too long for CI)
    steps, bad = 16, range(9, 11)  # two NUL batches in a row: a skip storm (Tier 2)
    config = trainer_config(tmp_path / "run", steps=steps, save=4)
    run, cb = make_trainer(tmp_path / "run", steps=steps, outlier=bad, config=config,
                           storm=1, cancel_on_tier2=True)
    run.fit()  # canceled at the detection
    summary = cb.tier2_summary
    assert summary is not None and run.global_step == summary["step"] < steps
    again = relaunch_config(config, summary, save_folder=tmp_path / "again")
    target = max(s for s in range(4, steps, 4) if s <= summary["onset_step"] - 2)
    assert again.load_path == str(tmp_path / "run" / "save" / f"step{target}")
    relaunched, cb2 = make_trainer(tmp_path / "again", steps=steps, outlier=bad, config=again,
                                   storm=1)
    relaunched.fit()
    records = read_metrics(tmp_path / "again" / "metrics.jsonl")
    skipped = set(range(summary["onset_step"], summary["step"] + 1))
    assert [r["step"] for r in records] == [t for t in range(target + 1, steps + 1)
                                            if t not in skipped]  # the Trainer left them out
    assert not any(r["skipped"] for r in records) and cb2.tier2_summary is None
    first = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["loss"] for r in records[:2]] == [r["loss"] for r in first[target:target + 2]]

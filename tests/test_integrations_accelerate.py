"""The Guard inside an ``accelerate`` loop (spikeguard.integrations.accelerate): the tiny Llama
of tests/_hf_llama.py on 2 processes that ``accelerate launch`` starts (its torchrun launcher,
gloo on CPU, DDP), with the prepared model, optimizer, dataloader and scheduler and
``accelerator.accumulate``; fp16 with accelerate's GradScaler where there is a GPU."""

from __future__ import annotations

import functools
import json
import math
import os
import socket
import subprocess
import sys

import pytest
import torch

import spikeguard as sg
from spikeguard.sinks import read_metrics
from tests.conftest import ROOT, checkout_env

pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

from spikeguard.integrations.accelerate import guard_accelerator  # noqa: E402

from ._accelerate_worker import BAD  # noqa: E402


@pytest.fixture
def fresh_state():
    """accelerate keeps one AcceleratorState per process: start and leave this test without."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """tests/_accelerate_worker.py on 2 ranks, launched as ``accelerate launch`` launches
    them; every phase's records and what each rank saw."""
    out = tmp_path_factory.mktemp("accelerate")
    env = checkout_env() | {"OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
           "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(_free_port()), str(ROOT / "tests" / "_accelerate_worker.py"),
           str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = [{p["name"]: p for p in json.loads((out / f"rank{r}.json").read_text())}
             for r in (0, 1)]
    records = {name: read_metrics(out / name / "metrics.jsonl") for name in ranks[0]}
    return ranks, records


def _acted(records):
    return {r["step"]: r for r in records if r["action"] != "continue"}


def test_two_ranks_clean_takes_no_action(launched):
    ranks, records = launched
    assert all(r["clean"]["world"] == 2 for r in ranks)
    assert [r["step"] for r in records["clean"]] == list(range(14))
    assert _acted(records["clean"]) == {}
    # the guard stepped accelerate's scheduler once an update: num_processes steps each
    assert all(r["clean"]["applied"] == 14 and r["clean"]["last_epoch"] == 28 for r in ranks)


@pytest.mark.parametrize("phase", ["outlier", "accumulate"])
def test_two_ranks_an_outlier_is_skipped_untouched_cause_data(launched, phase):
    """``accumulate``: 2 micro-batches a step under ``accelerator.accumulate`` (DDP's no_sync on
    the first) with attention dropout 0.1: the re-run replays both micro-batches under their
    RNG states, so the step reproduces and the cause is data, never transient."""
    ranks, records = launched
    (rec,) = _acted(records[phase]).values()
    assert rec["step"] == BAD and rec["action"] == "skip" and rec["cause"] == "data"
    assert rec["reasons"][0] == "grad_norm > 3x median"
    assert rec["rerun"] == {"loss": rec["loss"], "grad_norm": rec["grad_norm"]}
    for r in ranks:  # every rank: weights and moments bit-identical, the schedule held
        assert r[phase]["untouched"] and r[phase]["held"]
        assert r[phase]["applied"] == 13 and r[phase]["last_epoch"] == 26


def test_two_ranks_a_nan_halts_naming_the_module(launched):
    ranks, records = launched
    for r in ranks:
        assert r["nan"]["halt"] == {"step": 8, "first_forward": "module.model.layers.1.mlp"}
    assert records["nan"][-1]["step"] == 8 and records["nan"][-1]["action"] == "halt"
    assert math.isnan(records["nan"][-1]["loss"])


def test_two_ranks_a_corrupt_sample_is_dropped_not_a_halt(launched):
    """drop_sequences: rank 1's row 1 of step 10 has inf embeddings; every rank re-runs the step
    without it (the row quarantined on rank 1, all rows kept on rank 0) and applies that
    update: no halt, finite weights, the update applied on both ranks."""
    ranks, records = launched
    (rec,) = _acted(records["corrupt"]).values()
    assert rec["step"] == BAD and rec["action"] == "drop" and rec["kept_rows"] == [7, 8]
    assert any("rank 1 row 1 (micro-batch 0 row 1, z inf)" in r for r in rec["reasons"])
    for r in ranks:
        assert "halt" not in r["corrupt"] and r["corrupt"]["finite"]
        assert not r["corrupt"]["untouched"] and r["corrupt"]["applied"] == 14


def test_refuses_an_optimizer_accelerate_did_not_prepare(tmp_path, fresh_state):
    from accelerate import Accelerator

    from ._hf_llama import llama

    accelerator = Accelerator(cpu=True)
    model = llama()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match=r"optimizer accelerator.prepare returned"):
        guard_accelerator(accelerator, model, opt)


def test_fp16_adopts_accelerates_grad_scaler(tmp_path, one_thread, fresh_state):
    """fp16: accelerator.backward scales with accelerate's GradScaler, which the guard adopts (no
    foreign-scaler warning: pytest would fail on it); the guard measures unscaled gradients, an
    overflow is the scaler's own Tier 0 skip (the scale halves), and a data outlier is still
    skipped with cause data. On CUDA accelerate builds the GradScaler itself; on CPU it builds
    none (no fp16 autocast there), so the test hands it torch's CPU GradScaler: the forward
    stays fp32, the scaling, unscaling and overflow are the same code."""
    from accelerate import Accelerator

    from ._hf_llama import BATCH, SEQ, garbage, llama

    os.environ.pop("ACCELERATE_MIXED_PRECISION", None)
    cuda = torch.cuda.is_available()
    accelerator = Accelerator(mixed_precision="fp16", cpu=not cuda)
    if not cuda:
        accelerator.scaler = torch.amp.GradScaler("cpu")
    assert accelerator.scaler is not None
    model = llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95))
    model, optimizer = accelerator.prepare(model, optimizer)
    # arm_quiet=2: the grad rule on 2 quiet updates after arm_after (5), before the outlier at
    # 14 (this test is about the scaler, not arming). With the default 20 it stays off here
    # for long: in a 40-step run a grad-only spike at step 22 kept it off past an outlier at
    # step 34, which the loss rule skipped instead
    det = sg.DetectorConfig.for_run(20, arm_after=5, grad_z=0.01, arm_quiet=2)
    guard = guard_accelerator(accelerator, model, optimizer, out_dir=tmp_path,
                              config=sg.GuardConfig(detector=det, read_lag=0))
    assert guard.precision.scaler is accelerator.scaler
    data = sg.TokenStream.from_corpus("pydoc", batch_size=BATCH, seq_len=SEQ, seed=0)

    def forward_backward(x, y, keep=None):
        o = sg.cross_entropy(model(input_ids=x).logits.float(), y)
        accelerator.backward(o.loss)
        return o

    scales = []
    for t in range(20):
        x, y = (v.to(accelerator.device) for v in next(data))
        if t == 14:
            garbage(x, y, slice(None))
        o = forward_backward(x, y)
        if t == 8:  # an overflow: the gradients are inf in fp16
            for p in model.parameters():
                p.grad.fill_(float("inf"))
        guard.step(o, rerun=functools.partial(forward_backward, x, y))
        scales.append(accelerator.scaler.get_scale())
    guard.close()
    records = read_metrics(tmp_path / "metrics.jsonl")
    acted = _acted(records)
    assert acted[8]["tier"] == 0 and acted[8]["action"] == "skip"
    assert scales[8] == scales[7] / 2
    assert acted[14]["action"] == "skip" and acted[14]["cause"] == "data"
    assert acted[14]["reasons"][0] == "grad_norm > 3x median"
    assert set(acted) == {8, 14}
    assert all(r["grad_norm"] < 1e3 for r in records if r["step"] not in (8,))


def test_the_example_loop_runs_one_guard_step_per_accumulated_batch(tmp_path, one_thread,
                                                                     fresh_state):
    from examples.accelerate_loop import main

    guard = main(steps=6, out=str(tmp_path), accumulate=2)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(6)) and guard.step_index == 6
    assert all(r["action"] == "continue" for r in records)

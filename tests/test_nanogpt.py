"""examples/nanogpt.py, nanoGPT's loop shape with the guard in 8 marked lines, on the default
corpus: an outlier batch is skipped with params, moments, step count and LR schedule exactly as
they were; a NaN gradient halts naming the tensor with a non-zero exit; a resume from its
checkpoint continues the steps with one record each."""

from __future__ import annotations

import pytest
import torch
from examples.nanogpt import main

import spikeguard as sg
from spikeguard.sinks import read_metrics

# nanoGPT's attention (one c_attn Linear, heads split in forward) is not one the logit bound
# reads: it warns once, naming the class (tests/test_layout.py tests the warning)
pytestmark = pytest.mark.filterwarnings(
    "ignore:the attention-logit bound found no attention it can read:UserWarning")

TINY = dict(n_layer=1, n_head=2, n_embd=32, block_size=32, batch_size=4,
            gradient_accumulation_steps=2, eval_iters=1, eval_interval=100, log_interval=1000,
            warmup_iters=2, lr_decay_iters=20, max_iters=12)
POISON = 36
"""The outlier iteration, the last: for_run(36) arms after 10 kept updates, and the grad rule
(the skip's reason) only once arm_quiet (20) updates after that stayed inside its bar."""


def _state(model, opt):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            [{k: v.clone() for k, v in s.items()} for s in opt.state.values()])


def _same(a, b):
    (pa, sa), (pb, sb) = a, b
    return (pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)
            and len(sa) == len(sb)
            and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
                    for x, y in zip(sa, sb)))


def test_an_outlier_batch_is_skipped_and_changes_nothing(tmp_path):
    run = {**TINY, "max_iters": POISON, "lr_decay_iters": 40}  # the LR still moves at POISON
    model, opt, guard, _ = main(**run, out_dir=str(tmp_path / "a"), poison_iter=POISON)
    clean = main(**{**run, "max_iters": POISON - 1}, out_dir=str(tmp_path / "b"))
    assert _same(_state(model, opt), _state(clean[0], clean[1]))  # the last step changed nothing
    records = read_metrics(tmp_path / "a" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(POISON + 1))
    assert [r["step"] for r in records if r["skipped"]] == [POISON]
    assert records[POISON]["reasons"][0] == "grad_norm > 3x median"
    # the schedule counts applied updates: the next update gets the skipped step's LR
    assert guard.applied == clean[2].applied == POISON
    assert records[POISON]["lr"] != records[POISON - 1]["lr"]
    assert all(r["log_z"] > 0 for r in records)  # log Z from the model's one cross-entropy


def test_a_nan_gradient_halts_naming_the_tensor_with_a_non_zero_exit(tmp_path):
    # the script does not catch TrainingHalted: it leaves main() and the process exits 1
    with pytest.raises(sg.TrainingHalted) as halt:
        main(**{**TINY, "max_iters": 6}, nan_iter=3, out_dir=str(tmp_path))
    assert "transformer.h.0.mlp.c_fc.weight" in str(halt.value)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert records[-1]["step"] == 3 and records[-1]["action"] == "halt"


def test_a_resume_continues_the_steps_with_one_record_each(tmp_path):
    out = str(tmp_path)
    # saves at iter 8 and runs on to 12, as a run that crashed after its last save would
    main(**{**TINY, "eval_interval": 8}, out_dir=out)
    _, _, guard, iter_num = main(**{**TINY, "eval_interval": 8}, out_dir=out,
                                 init_from="resume")
    steps = [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")]
    assert steps == list(range(13)) and iter_num == 13 and guard.applied == 13


def test_unknown_config_keys_are_refused():
    with pytest.raises(ValueError, match="unknown config keys"):
        main(max_itres=3)

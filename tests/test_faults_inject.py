"""The injector's storm, nan-data and overflow faults: what each does to the step it hits, and
nothing else (train.faults)."""

import json

import pytest
import torch

from spikeguard.guard import GuardConfig
from spikeguard.model import GPT, GPTConfig
from spikeguard.train import TrainConfig, parse_fault, train
from spikeguard.train.faults import Injector


def _model():
    torch.manual_seed(0)
    return GPT(GPTConfig.tiny())


def _batch(model, b=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(0, model.cfg.vocab_size, (b, model.cfg.seq_len + 1), generator=g)
    return w[:, :-1], w[:, 1:]


def test_the_new_specs_parse_and_bad_ones_are_refused_with_the_forms():
    assert parse_fault("storm@10:5").length == 5
    assert parse_fault("storm@10:3:repeat").args == ("3", "repeat")
    assert parse_fault("nan-data@7").kind == "nan-data"
    assert parse_fault("nan-data@7:2").args == ("2",)
    assert parse_fault("nan@7").kind == "nan"  # not swallowed by nan-data
    assert parse_fault("overflow@9").length == 1
    assert parse_fault("gap@10:5").length == 5
    for bad in ("storm@10", "storm@10:0", "storm@10:2:x", "nan-data@7:a", "nan-data@7:1:2",
                "overflow@9:2", "gap@10", "gap@10:0", "gap@10:2:repeat", "gap@10:2!"):
        with pytest.raises(ValueError, match="storm@S:N.*nan-data@S.*overflow@S"):
            parse_fault(bad)


def test_overflow_needs_fp16_mixed_and_says_so():
    with pytest.raises(ValueError, match="--precision fp16-mixed"):
        TrainConfig(inject=("overflow@5",))
    TrainConfig(inject=("overflow@5",), precision="fp16-mixed")


def test_a_storm_replaces_n_consecutive_batches_each_with_new_garbage():
    model = _model()
    inj = Injector(("storm@5:3",), rank=0, only_rank=None, vocab_size=256, seed=0)
    x, y = _batch(model)
    seen, garbage = [], []
    for t in range(3, 10):
        xt, yt = inj.begin(t, model, x, y)
        assert torch.equal(yt, y)  # the inputs are garbage, as with outlier@S
        seen.append(not torch.equal(xt, x))
        if seen[-1]:
            assert not any(torch.equal(xt, g) for g in garbage)  # each batch drawn anew
            garbage.append(xt)
    assert seen == [False, False, True, True, True, False, False]


def test_a_skipped_storm_is_bit_for_bit_a_clean_run_without_the_storms_batches(tmp_path):
    """What a skip costs is the batches the storm replaced, nothing else: the guarded storm run
    (its three updates withheld, then made up) equals an unguarded clean run whose stream never
    yields those three batches (gap@S:N), loss for loss and in the held-out loss."""
    def run(inject, guard):
        return train(TrainConfig(model="tiny", steps=100, batch_size=8, inject=(inject,),
                                 guard=guard, out=str(tmp_path / inject[:3]), progress=False,
                                 plot=False), echo=False)

    storm = run("storm@60:3", GuardConfig())
    gap = run("gap@60:3", GuardConfig(respond=False))
    assert storm.applied == gap.applied == 100 and storm.made_up == 3 and gap.made_up == 0
    assert storm.losses[:60] == gap.losses[:60]
    assert all(x > 1.2 * gap.losses[59] for x in storm.losses[60:63])  # the garbage batches
    assert storm.losses[63:] == gap.losses[60:]
    assert storm.val_loss == gap.val_loss
    ranks = json.loads((tmp_path / "sto" / "ranks" / "rank0.json").read_text())
    assert ranks["skipped"] == [60, 61, 62]


def test_nan_data_poisons_that_row_on_every_re_run_and_nothing_else():
    model = _model()
    inj = Injector(("nan-data@5:2",), rank=0, only_rank=None, vocab_size=256, seed=0)
    x, y = _batch(model)
    inj.begin(4, model, x, y)
    assert torch.isfinite(model(x)).all()  # before its step: clean
    xt, yt = inj.begin(5, model, x, y)
    assert torch.equal(xt, x) and torch.equal(yt, y)  # the tokens are real data
    for _ in range(2):  # the step and its re-run: the same rows non-finite
        logits = model(x)
        finite = torch.isfinite(logits).flatten(1).all(dim=1)
        assert finite.tolist() == [True, True, False, True]
    assert torch.isfinite(model(x[[0, 1, 3]])).all()  # a re-run without the row is clean
    assert not torch.isfinite(model(x[[2]])).any()    # the row alone reproduces it
    loss = model.loss(model(x), y).ce
    assert not torch.isfinite(loss)
    inj.begin(7, model, x, y)  # the fault is over two steps later
    assert torch.isfinite(model(x)).all()


def test_nan_data_names_a_row_the_batch_has():
    model = _model()
    inj = Injector(("nan-data@1:9",), rank=0, only_rank=None, vocab_size=256, seed=0)
    x, y = _batch(model)
    with pytest.raises(ValueError, match="rows 0..3"):
        inj.begin(1, model, x, y)


def _grads_after(model, inj, t, x, y, dtype):
    model.zero_grad()
    inj.begin(t, model, x, y)
    with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
        loss = model.loss(model(x), y).loss
    (loss * 1024).backward()  # a loss scale, as GradScaler multiplies
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def test_overflow_overflows_the_fp16_backward_of_its_step_only():
    model = _model()
    inj = Injector(("overflow@3",), rank=0, only_rank=None, vocab_size=256, seed=0)
    x, y = _batch(model)
    before = _grads_after(model, inj, 2, x, y, torch.float16)
    assert torch.isfinite(before).all()
    at = _grads_after(model, inj, 3, x, y, torch.float16)
    assert torch.isinf(at).any() or torch.isnan(at).any()
    assert torch.isfinite(_grads_after(model, inj, 4, x, y, torch.float16)).all()


def test_overflow_refuses_a_model_that_does_not_compute_in_fp16():
    model = _model()
    inj = Injector(("overflow@3",), rank=0, only_rank=None, vocab_size=256, seed=0)
    x, y = _batch(model)
    with pytest.raises(ValueError, match="fp16-mixed"):
        _grads_after(model, inj, 3, x, y, None)


def test_overflow_through_train_makes_the_scaler_skip_and_halve_at_that_step(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(TrainConfig(model="tiny", steps=24, batch_size=4, lr=1e-3, eval_batches=1,
                          precision="fp16-mixed", inject=("overflow@20",), out=str(tmp_path),
                          guard=GuardConfig(respond=False), progress=False, plot=False),
              echo=False)
    finally:
        torch.set_num_threads(threads)
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    scale = {r["step"]: r["grad_scale"] for r in recs}
    halved = [t for t in range(1, 24) if scale[t] == scale[t - 1] / 2]
    assert halved == [20]
    finite = {r["step"]: isinstance(r["grad_norm"], float) for r in recs}
    assert [t for t, ok in finite.items() if not ok] == [20]


def test_lr_ramp_multiplies_the_lr_by_a_rising_factor_that_stays_at_mult():
    assert parse_fault("lr-ramp@10:50:100").kind == "lr-ramp"  # not swallowed by lr
    with pytest.raises(ValueError, match="lr-ramp@S:MULT:LEN"):
        parse_fault("lr-ramp@10:50")
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    inj = Injector(("lr-ramp@2:16:4",), rank=0, only_rank=None, vocab_size=256, seed=0)
    x, y = _batch(model)
    used = []
    for t in range(8):
        inj.begin(t, model, x, y)
        inj.before_step(opt)
        used.append(opt.param_groups[0]["lr"])
        inj.after_step(opt)
        assert opt.param_groups[0]["lr"] == 0.1  # put back after each step
    expected = [0.1, 0.1] + [0.1 * 16 ** min(1.0, (t - 1) / 4) for t in range(2, 8)]
    assert used == pytest.approx(expected, rel=1e-12)
    assert used[-1] == pytest.approx(1.6) and used[3] == pytest.approx(0.4)


def test_a_logit_drift_ended_by_a_rollback_keeps_the_scale_the_restored_weights_trained_under():
    # logit-drift@5:0.1 scales the head's input by 1 + 0.1 (t - 5) from step 5. A rollback that
    # restores the weights of step 10 (training goes back to step 11) ends the growth, and the
    # input stays at 1.5x, the scale those weights last trained under; a later rollback to step
    # 3 (before the drift) leaves it at 1x. A resumed injector keeps it.
    x = y = torch.zeros(1, 4, dtype=torch.long)
    one = torch.ones(3)

    def scale(inj, model, t):
        inj.begin(t, model, x, y)
        return float(model.ln_f(one)[0])

    def head():
        model = torch.nn.Module()
        model.ln_f = torch.nn.Identity()
        return model

    model, inj = head(), Injector(["logit-drift@5:0.1"], rank=0, only_rank=None, vocab_size=8,
                                  seed=0)
    assert [scale(inj, model, t) for t in range(0, 16)] == pytest.approx(
        [1.0] * 5 + [1 + 0.1 * k for k in range(11)])
    assert [scale(inj, model, t) for t in range(11, 20)] == pytest.approx([1.5] * 9)
    # a new process: a new model, no hook yet, the injector's state from the checkpoint
    again = Injector(["logit-drift@5:0.1"], rank=0, only_rank=None, vocab_size=8, seed=0)
    again.load_state_dict(json.loads(json.dumps(inj.state_dict())))
    assert scale(again, head(), 20) == pytest.approx(1.5)
    assert [scale(inj, model, t) for t in range(4, 8)] == pytest.approx([1.0] * 4)

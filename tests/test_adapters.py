"""The adapter surface (docs/adapters.md): guard.decide() for a framework that steps the
optimizer itself, the data protocol and its checked error, start_at (the step numbers continue
a framework's own), and the guard's state as a torch.distributed.checkpoint Stateful."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

import spikeguard as sg
from spikeguard.guard.adapter import DataSource, RowDropSource
from spikeguard.sinks import read_metrics
from tests.guard_harness import snapshot, unchanged

STEPS = 12
OUTLIER = 9


def _run(tmp_path=None, *, seed=0, name="m.jsonl"):
    torch.manual_seed(seed)
    model = sg.GPT(sg.GPTConfig.tiny(seq_len=16))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = sg.TokenStream.from_corpus("pydoc", batch_size=4, seq_len=16, seed=seed)
    # arm_quiet=2: the grad rule turns on 2 quiet updates after arm_after (step 6), before the
    # outlier at step 9; these tests are about decide() and the adapters, not the arming, and
    # a run long enough for the default 20 quiet updates would be 3x slower
    det = sg.DetectorConfig.for_run(STEPS, arm_after=5, grad_z=0.01, arm_quiet=2)
    cfg = sg.GuardConfig(detector=det, read_lag=0, weights_check=False)
    sinks = [sg.JsonlSink(tmp_path / name)] if tmp_path is not None else None
    guard = sg.Guard(model, opt, config=cfg, data=data, sinks=sinks)
    return model, opt, data, guard


def _batch(model, data, guard):
    x, y = next(data)
    if guard.step_index == OUTLIER:  # a run of NUL bytes, which the text never holds
        x, y = torch.zeros_like(x), torch.zeros_like(y)
    out = model.loss(model(x), y)
    out.loss.backward()
    return out


def test_decide_then_the_framework_steps_is_bit_identical_to_guard_step(tmp_path):
    model_a, opt_a, data_a, guard_a = _run(tmp_path, name="a.jsonl")
    model_b, opt_b, data_b, guard_b = _run(tmp_path, name="b.jsonl")
    sched = torch.optim.lr_scheduler.LambdaLR(opt_b, lambda s: 1.0 / (1 + s))
    sched_a = torch.optim.lr_scheduler.LambdaLR(opt_a, lambda s: 1.0 / (1 + s))
    guard_a.updater.scheduler = sched_a  # the guard steps it per applied update
    decisions = []
    for _ in range(STEPS):
        (va,) = guard_a.step(_batch(model_a, data_a, guard_a))
        before = snapshot(model_b, opt_b)
        d = guard_b.decide(_batch(model_b, data_b, guard_b))
        decisions.append(d)
        assert d.step == va.step and d.apply == (not va.skip) and d.skip == va.skip
        if d.apply:  # the framework's own step and schedule
            opt_b.step()
            sched.step()
        else:
            assert unchanged(before, snapshot(model_b, opt_b))
        opt_b.zero_grad(set_to_none=True)
        for pa, pb in zip(model_a.parameters(), model_b.parameters()):
            assert torch.equal(pa, pb)
    assert [d.apply for d in decisions].count(False) == 1 and not decisions[OUTLIER].apply
    assert decisions[OUTLIER].action is sg.Action.SKIP
    assert sched.last_epoch == sched_a.last_epoch == STEPS - 1
    assert opt_b.state[next(model_b.parameters())]["step"] == STEPS - 1
    guard_a.close(), guard_b.close()
    # the plain guards read the signals; guard.step()'s records carry the update it applied
    # (the withheld one reads 0), decide()'s none: the framework steps after the step is read
    ratios = [r.get("update_ratio") for r in read_metrics(tmp_path / "a.jsonl")]
    assert ratios[OUTLIER] == 0 and all(v > 0 for i, v in enumerate(ratios) if i != OUTLIER)
    assert all("update_ratio" not in r for r in read_metrics(tmp_path / "b.jsonl"))


def test_decide_refuses_what_would_step_twice_or_late():
    model = sg.GPT(sg.GPTConfig.tiny(seq_len=16))
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    guard = sg.Guard(model, opt, scheduler=sched)
    x = torch.randint(0, 256, (2, 16))
    model.loss(model(x), x).loss.backward()
    with pytest.raises(ValueError, match="scheduler=None"):
        guard.decide(model.loss(model(x), x))
    lagged = sg.Guard(model, opt, config=sg.GuardConfig(read_lag=1))
    with pytest.raises(ValueError, match="read_lag=0"):
        lagged.decide(model.loss(model(x), x))


class _Loader:
    """A loader with a position and state but no skip."""

    position = 0

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def test_data_without_a_member_is_refused_naming_it():
    model = sg.GPT(sg.GPTConfig.tiny(seq_len=16))
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(TypeError, match=r"_Loader lacks skip \(skip\(start, stop\)"):
        sg.Guard(model, opt, data=_Loader())
    with pytest.raises(TypeError, match="position .*skip .*state_dict .*load_state_dict"):
        sg.Guard(model, opt, data=iter([1, 2]))
    stream = sg.TokenStream.from_corpus("pydoc", batch_size=2, seq_len=16)
    assert isinstance(stream, RowDropSource) and isinstance(stream.loader(), DataSource)
    assert not isinstance(stream.loader(), RowDropSource)  # no drop: a rollback skips ranges
    assert not isinstance(_Loader(), DataSource)


def _train(model, data, guard, steps):
    for _ in range(steps):
        guard.step(_batch(model, data, guard))


def test_start_at_continues_the_numbering_and_drops_the_records_that_run_again(tmp_path):
    model, _, data, guard = _run(tmp_path)
    _train(model, data, guard, 8)  # the crashed run got to step 7; the framework saved at 5
    guard.close()
    model, _, data, guard = _run(tmp_path)
    guard.start_at(5)
    with pytest.raises(ValueError, match="int >= 0"):
        guard.start_at(-1)
    _train(model, data, guard, 3)
    guard.close()
    steps = [r["step"] for r in read_metrics(tmp_path / "m.jsonl")]
    assert steps == list(range(8))
    with pytest.raises(ValueError, match="at step 8 after 3 steps"):
        guard.start_at(6)  # behind: only a rollback goes back
    guard.start_at(10)  # ahead: the framework skipped steps 8 and 9 itself
    assert guard.step_index == 10


def test_guard_state_round_trips_through_dcp_and_the_metrics_continue(tmp_path):
    model, _, data, guard = _run(tmp_path)
    _train(model, data, guard, 10)  # past the outlier: the detector has windows and a skip
    dcp.save({"spikeguard": guard.stateful(), "data": data}, checkpoint_id=tmp_path / "ck")
    _train(model, data, guard, 2)  # the steps a crash loses
    guard.close()
    saved = guard.state_dict()
    model2, _, data2, fresh = _run(tmp_path)
    state = {"spikeguard": fresh.stateful(), "data": data2}
    dcp.load(state, checkpoint_id=tmp_path / "ck")
    assert fresh.step_index == 10 and data2.position == 10
    assert fresh.detector.state_dict() != _run()[3].detector.state_dict()
    _train(model2, data2, fresh, 2)
    fresh.close()
    steps = [r["step"] for r in read_metrics(tmp_path / "m.jsonl")]
    assert steps == list(range(12))  # no step twice, none restarted at 0
    # the resumed guard's counters match the run that never stopped
    assert fresh.applied == saved["updater"]["applied"]
    assert fresh.records == saved["recorder"]["records"]
    with pytest.raises(ValueError, match="GuardState.state_dict"):
        fresh.stateful().load_state_dict({"detector": {}})
    assert json.loads(fresh.stateful().state_dict()["json"])["step_index"] == 12

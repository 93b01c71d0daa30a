"""The responses as policies: the tier's response is the policy's, and a new response is one file
and one config value (``responses/lower_lr.py``, ``GuardConfig.lower_lr``)."""

import json

import pytest
import torch

import spikeguard as sg
from spikeguard.guard import Guard, GuardConfig
from spikeguard.guard.lr_scale import LrScale, Stretch
from spikeguard.guard.responses import LowerLrConfig

STEPS, OUTLIER, N, SCALE = 84, 70, 7, 0.25


def _storm_run(tmp_path, lower_lr):
    """A small run with a batch of random bytes at step 70 (Tier 2: its log Z jumps past the
    median of the last 32 kept steps + 1). Returns the records and, per step, the LR the
    optimizer stepped with and the LR the schedule gave."""
    torch.manual_seed(0)
    cfg = sg.GPTConfig.tiny(n_layer=1, d_model=32, seq_len=32)
    model = sg.GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, sg.schedules.warmup_cosine(warmup_steps=10, total_steps=STEPS, min_ratio=0.1))
    data = sg.TokenStream.from_corpus("pydoc", batch_size=4, seq_len=cfg.seq_len, seed=0)
    guard = Guard(model, opt, scheduler=sched, data=data,
                  sinks=[sg.JsonlSink(tmp_path / "metrics.jsonl")],
                  config=GuardConfig(detector=sg.DetectorConfig.for_run(STEPS),
                                     lower_lr=lower_lr))
    lrs: dict[int, tuple[float, float]] = {}
    opt.register_step_pre_hook(lambda o, args, kwargs: lrs.__setitem__(
        guard._step, (o.param_groups[0]["lr"], sched.get_last_lr()[0])))
    gen = torch.Generator().manual_seed(1)
    while guard.step_index < STEPS:
        x, y = next(data)
        if guard.step_index == OUTLIER:
            x = torch.randint(0, cfg.vocab_size, x.shape, generator=gen)
            with torch.no_grad():
                y = model.logits(model(x)).argmin(-1)
        out = model.loss(model(x), y)
        out.loss.backward()
        guard.step(out)
    guard.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return records, lrs


def test_lower_lr_lowers_the_lr_by_its_scale_for_exactly_n_steps_then_returns(tmp_path):
    (tmp_path / "off").mkdir()
    (tmp_path / "on").mkdir()
    off, off_lrs = _storm_run(tmp_path / "off", LowerLrConfig())
    on, on_lrs = _storm_run(tmp_path / "on", LowerLrConfig(steps=N, lr_multiple=SCALE))
    tier2 = [r["step"] for r in on if r["tier"] == 2]
    assert tier2 == [r["step"] for r in off if r["tier"] == 2] == [OUTLIER], tier2
    # off by default: no key, and every update at the scheduled LR
    assert not any("lr_lowered" in r for r in off)
    assert all(used == scheduled for used, scheduled in off_lrs.values())
    # on: the page's record says what was lowered, and the N steps after it ran at SCALE x
    assert on[OUTLIER]["action"] == off[OUTLIER]["action"] == "alert"
    assert on[OUTLIER]["lr_lowered"] == {"lr_multiple": SCALE, "first": OUTLIER + 1,
                                         "last": OUTLIER + N}
    ratio = {s: used / scheduled for s, (used, scheduled) in on_lrs.items()}
    assert sorted(s for s, r in ratio.items() if r != 1.0) == list(range(OUTLIER + 1,
                                                                        OUTLIER + N + 1))
    assert all(ratio[s] == SCALE for s in range(OUTLIER + 1, OUTLIER + N + 1))
    assert sorted(ratio) == list(range(STEPS)) and ratio[OUTLIER + N + 1] == 1.0
    # the record's lr is the rate the update used; up to the page the two runs are one run
    assert all(r["lr"] == on_lrs[r["step"]][0] for r in on)
    assert [r["loss"] for r in on[:OUTLIER + 2]] == [r["loss"] for r in off[:OUTLIER + 2]]
    assert on[OUTLIER + 2]["loss"] != off[OUTLIER + 2]["loss"]


def test_the_lr_multiplier_is_the_product_of_its_stretches_and_a_replay_replaces_a_replay():
    lr = LrScale()
    lr.add(Stretch(first=10, last=13, scale=0.5, ramp=True, kind="replay"))
    assert [lr.factor(s) for s in range(9, 15)] == [1.0, 0.5, 0.625, 0.75, 0.875, 1.0]
    lr.add(Stretch(first=12, last=None, scale=0.5, kind="reconfigure"))
    assert lr.factor(12) == 0.75 * 0.5 and lr.factor(1000) == 0.5
    lr.add(Stretch(first=20, last=21, scale=0.25, ramp=True, kind="replay"))
    assert lr.factor(11) == 1.0 and lr.factor(11) * lr.factor(20) == 0.25 * 0.5
    again = LrScale()
    again.load_state_dict(json.loads(json.dumps(lr.state_dict())))
    assert again.stretches == lr.stretches


def test_a_replay_ramp_that_settles_below_1_keeps_its_level_for_good():
    lr = LrScale()
    lr.add(Stretch(first=10, last=13, scale=0.25, ramp=True, kind="replay", settle=0.5))
    assert [lr.factor(s) for s in range(9, 16)] == [1.0, 0.25, 0.3125, 0.375, 0.4375, 0.5, 0.5]
    assert lr.factor(10_000) == 0.5
    again = LrScale()  # the state keeps it; a state written before ``settle`` settles at 1
    again.load_state_dict(json.loads(json.dumps(lr.state_dict())))
    assert again.stretches == lr.stretches
    old = [{k: v for k, v in s.items() if k != "settle"} for s in lr.state_dict()]
    again.load_state_dict(old)
    assert again.factor(14) == 1.0


def test_the_tier_2_response_is_the_policy_s_not_the_detector_s():
    from spikeguard.guard.responses.alert import Alert
    from spikeguard.guard.responses.halt import Halt
    from spikeguard.guard.responses.lower_lr import LowerLr
    from spikeguard.guard.responses.policy import Policy
    from spikeguard.guard.responses.rollback import Rollback

    alert = Policy(GuardConfig())
    assert [type(r) for r in alert.tiers[2]] == [Alert]
    assert [type(r) for r in alert.tiers[3]] == [Halt]
    both = Policy(GuardConfig(tier2="rollback", lower_lr=LowerLrConfig(steps=3)))
    assert [type(r) for r in both.tiers[2]] == [Rollback, LowerLr]


@pytest.mark.parametrize("kwargs,match", [({"steps": -1}, "steps"),
                                          ({"lr_multiple": 2.0}, "<= 1"),
                                          ({"lr_multiple": 0.0}, "lr_multiple")])
def test_a_bad_lower_lr_config_is_refused_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LowerLrConfig(**kwargs)

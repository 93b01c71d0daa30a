"""The detector on real runs nobody tuned it to, and across a resume.

- A plain loop as README writes it (``DetectorConfig.for_run(steps)``, no warmup given) with
  ``torch.optim.SGD(lr=0.1, momentum=0.9)`` instead of AdamW, on the tiny model and the real
  corpus: a healthy run whose log Z climbs 2-3 nats in its first 50 steps. The detector of
  52606dd paged it at step 32 (``log_z > median of last 32 + 1``). No page now: the log Z rules
  turn on only once log Z has stayed inside their bars for ``arm_quiet`` updates in a row.
- A detector saved mid-run and loaded into a fresh one judges the rest of the stream with the
  same thresholds (every limit and median in the evidence) as the uninterrupted one, cut before,
  inside and after the stretch where the loss rules are armed and the grad rule not yet (where
  the joint test uses the whole grad bar: a resumed run must skip the same garbage batch there).
"""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

import spikeguard as sg
from spikeguard.testing import scenarios as sc


def test_an_sgd_loop_as_readme_writes_it_gets_no_page():
    steps, seed = 100, 0
    torch.manual_seed(seed)
    cfg = sg.GPTConfig.tiny(z_loss=1e-4)
    model = sg.GPT(cfg)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-1, momentum=0.9)
    schedule = sg.schedules.warmup_cosine(warmup_steps=20, total_steps=steps, min_ratio=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    data = sg.TokenStream.from_corpus("pydoc", batch_size=8, seq_len=cfg.seq_len, seed=seed)
    guard = sg.Guard(model, optimizer, scheduler=scheduler, data=data,
                     config=sg.GuardConfig(detector=sg.DetectorConfig.for_run(steps), clip=1.0))
    verdicts, log_z = [], []
    while guard.step_index < steps:
        x, y = next(data)
        out = model.loss(model(x), y)
        out.loss.backward()
        log_z.append(float(out.log_z))
        verdicts += guard.step(out)
    verdicts += guard.close()
    assert len(verdicts) == steps
    # the run is what the rule used to page: log Z more than 1 above the median of the 32
    # before it, on a run whose loss fell all along
    jumps = [t for t in range(32, steps) if log_z[t] - sorted(log_z[t - 32:t])[15:17][0] > 1.0]
    assert jumps, "the run no longer climbs: this test no longer tests anything"
    assert verdicts[-1].evidence["loss"] < verdicts[0].evidence["loss"] - 1.0
    assert [v for v in verdicts if v.tier >= 2] == []


def _limits(v: sg.Verdict) -> dict:
    return {k: x for k, x in v.evidence.items() if x == x}  # NaN-free, for ==


def test_a_resumed_detectors_thresholds_equal_the_uninterrupted_ones():
    metrics = sc.clean_run(0, steps=3000).metrics + sc.data_anomaly(0).metrics[:3000]
    for i, m in enumerate(metrics):
        m.step = i
    config = sg.DetectorConfig.for_run(len(metrics), warmup_steps=20)
    # the grad rule counts its quiet updates from 50 and is on from 70 at the earliest
    assert (config.arm_after, config.grad_arm_after, config.arm_quiet) == (50, 20, 20)
    metrics[56].grad_norm *= 8.0  # a garbage batch before the grad rule arms: both move
    metrics[56].loss *= 1.3
    whole = sg.SpikeDetector(config)
    want = [whole.update(m) for m in metrics]
    assert want[56].skip and want[56].reasons[0] == "loss and grad_norm both past half their bars, grad rule not on"
    whole_state = sg.SpikeDetector(config)
    on_at = next(i for i, m in enumerate(metrics)
                 if (whole_state.update(m), whole_state.state_dict()["rules"]["grad_spike"]["on"])[1])
    assert 69 <= on_at < 200, on_at  # the cut at 60 falls inside its quiet count
    for cut in (40, 53, 60, 1500, 3100):
        first = sg.SpikeDetector(config)
        for m in metrics[:cut]:
            first.update(m)
        resumed = sg.SpikeDetector(config)
        resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))  # as a checkpoint
        got = [resumed.update(m) for m in metrics[cut:]]
        assert [(v.step, v.tier, v.action, v.reasons) for v in got] == \
            [(v.step, v.tier, v.action, v.reasons) for v in want[cut:]]
        assert [_limits(v) for v in got] == [_limits(v) for v in want[cut:]]


def test_a_version_6_state_loads_with_its_grad_rule_on():
    """A detector state saved before the grad rule's quiet count (version 6) still restores: its
    grad rule was on once arm_after and grad_arm_after kept updates had passed, and stays on; one
    saved before that point resumes counting from zero."""
    metrics = sc.clean_run(0, steps=400).metrics
    config = sg.DetectorConfig.for_run(400)
    for cut, on in ((200, True), (20, False)):
        d = sg.SpikeDetector(config)
        for m in metrics[:cut]:
            d.update(m)
        state = json.loads(json.dumps(d.state_dict()))
        state["version"] = 6
        del state["rules"]["grad_spike"]["quiet"], state["rules"]["grad_spike"]["on"]
        del state["rules"]["loss_spike"]["tail"]
        resumed = sg.SpikeDetector(config)
        resumed.load_state_dict(state)
        assert resumed.state_dict()["rules"]["grad_spike"]["on"] is on
        assert resumed.state_dict()["version"] == 10


def test_a_version_5_state_loads_with_its_log_z_rules_on():
    """A detector state saved before the quiet count (version 5) still restores: its log Z
    rules were on once arm_after and grad_arm_after kept updates had passed, and stay on."""
    metrics = sc.clean_run(0, steps=400).metrics
    config = sg.DetectorConfig.for_run(400)
    d = sg.SpikeDetector(config)
    for m in metrics[:200]:
        d.update(m)
    state = json.loads(json.dumps(d.state_dict()))
    state["version"] = 5
    for name in ("log_z_drift", "log_z_rise", "log_z_jump"):
        del state["rules"][name]["quiet"], state["rules"][name]["on"]
    resumed = sg.SpikeDetector(config)
    resumed.load_state_dict(state)
    assert all(resumed.state_dict()["rules"][name]["on"]
               for name in ("log_z_drift", "log_z_rise", "log_z_jump"))


def test_grad_arm_quiet_zero_turns_the_grad_rule_on_at_its_arming_point_spikes_or_not():
    """``grad_arm_quiet=0`` (what diagnose uses on another trainer's log): the grad rule is on
    from max(arm_after, grad_arm_after) kept updates, so a spike right there is skipped; with the
    default quiet count it is not (and restarts the count). A bad value names the field."""
    metrics = sc.clean_run(0, steps=200).metrics
    spike = 12
    metrics[spike].grad_norm *= 50.0
    for quiet, skipped in ((0, True), (None, False)):
        config = sg.DetectorConfig.for_run(200, arm_after=10, grad_arm_quiet=quiet)
        d = sg.SpikeDetector(config)
        verdicts = [d.update(m) for m in metrics[:spike + 1]]
        assert verdicts[spike].skip is skipped, quiet
    with pytest.raises(ValueError, match="grad_arm_quiet=-1 must be an int >= 0"):
        sg.DetectorConfig(grad_arm_quiet=-1)


def _falling(seed: int, sd: float, shift_at: int | None = None, shift: float = 0.0):
    """1,000 steps of a loss falling from 5 to 2 nats with Gaussian batch noise of ``sd`` nats
    (half as much again early on), and ``shift`` nats added from ``shift_at`` on."""
    rng = random.Random(seed)
    for t in range(1000):
        level = 2.0 + 3.0 * math.exp(-t / 60) + (shift if shift_at and t >= shift_at else 0.0)
        loss = level + sd * rng.gauss(0.0, 1.0) * (1.0 + 0.5 * math.exp(-t / 60))
        yield sg.StepMetrics(step=t, loss=loss, grad_norm=1.0 + 0.1 * rng.random())


def _elevated_pages(stream, **overrides) -> list:
    d = sg.SpikeDetector(sg.DetectorConfig.for_run(1000, **overrides))
    return [v for v in map(d.update, stream) if v.tier == 2
            and any(r.startswith("loss +0.1 nats for") for r in v.reasons)]


def test_the_slow_rule_sizes_its_levels_by_the_loss_noise():
    """A healthy loss whose batch noise is 1 nat wide: its short EMA (span 50) has a standard
    error of 0.1 nats, and the fixed 0.1-nat level paged 3 of 10 such runs. Sized to 6 of those
    errors, none is paged, and a sustained rise of 0.5 nats past that level still is, on every
    seed; a loss as quiet as a language model's (0.05 nats) keeps the fixed 0.1 nats."""
    fixed = sum(bool(_elevated_pages(_falling(s, 1.0), elevated_z=0)) for s in range(10))
    assert fixed >= 2
    for seed in range(10):
        assert not _elevated_pages(_falling(seed, 1.0)), seed
        level = 0.5 + 6.0 * 1.0 / math.sqrt(99)
        shifted = _elevated_pages(_falling(seed, 1.0, 400, level))
        assert shifted and 0.3 < shifted[0].evidence["loss_elevated_nats"] < 0.9, seed
        quiet = _elevated_pages(_falling(seed, 0.05, 400, 0.5))
        assert quiet and quiet[0].evidence["loss_elevated_nats"] == 0.1, seed

"""The guard never leaves a run worse than no guard: clean runs of ``spikeguard train`` never
halt or roll back, and a spike the weights caused is let through (the clipped update repairs it)
instead of being skipped into a storm. Each claim beside the unguarded arm on the same seed
(``GuardConfig(respond=False)``: the same defenses, every response off)."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import random

import pytest
import torch

import spikeguard as sg
from spikeguard.detector.gate import DeviceGate
from spikeguard.detector.rules import GradSpike, grad_limit, loss_limit
from spikeguard.diagnose import diagnose
from spikeguard.guard import GuardConfig
from spikeguard.sinks import read_metrics
from spikeguard.train import TrainConfig, train


def _falling(n, *, seed=0, start=2.0, end=0.5, noise=0.15):
    """A grad norm that falls geometrically from ``start`` to ``end`` over ``n`` steps with
    log-normal noise (sigma ``noise``), as after warmup, and a loss falling with it."""
    rng = random.Random(seed)
    return [sg.StepMetrics(step=t, loss=5.0 - 2.0 * t / n + rng.gauss(0.0, 0.05),
                           grad_norm=start * (end / start) ** (t / n) * math.exp(
                               rng.gauss(0.0, noise)))
            for t in range(n)]


def _judge(config, metrics, *, blamed=False, detector=None, gate=None):
    """The host detector and the device gate over ``metrics``; every skip verdict equals the
    gate's bit. ``blamed``: every skip is one the weights check blamed on its batch (the Guard
    then tells the gate, and the detector, that the next step gets the storm test). Returns
    the host verdicts."""
    detector = detector or sg.SpikeDetector(config)
    gate = gate or DeviceGate(config)
    verdicts = []
    for m in metrics:
        after = gate.after_skip
        bit = bool(gate(torch.tensor(m.grad_norm, dtype=torch.float64),
                        torch.tensor(m.loss, dtype=torch.float64)))
        v = detector.update(m, released=False, after_skip=after)  # as the Guard calls it
        assert bit == v.skip, m.step
        gate.resolved(blamed and v.skip)
        verdicts.append(v)
    return verdicts


def test_the_grad_bar_stays_tight_while_the_norm_falls_and_a_spike_at_20x_is_skipped():
    """Statistics that hold early in a run: the spread is of step-to-step differences, so a
    trend (the norm falling 4x over 40 steps) does not widen the bar. The old spread, of
    deviations from the lagging median, measured the trend and widened the bar to 30-7,500x
    the median on the tiny model. The planted spike is sized from the run: 20x the median the
    detector itself holds."""
    config = sg.DetectorConfig.for_run(200)
    metrics = _falling(60)
    verdicts = _judge(config, metrics)
    assert not any(v.skip for v in verdicts)
    median = verdicts[-1].evidence["grad_median"]
    spike = sg.StepMetrics(step=60, loss=metrics[-1].loss, grad_norm=20.0 * median)
    assert _judge(config, [*metrics, spike])[-1].skip
    # the bar itself, from the detector's own statistics: a few x the median, not hundreds
    d = sg.SpikeDetector(config)
    for m in metrics:
        d.update(m)
    grad = next(r for r in d._judge if isinstance(r, GradSpike))
    assert 3.0 <= grad_limit(grad.median.value, grad.spread.value, config) / grad.median.value < 5.0


def test_the_grad_rule_turns_on_after_its_quiet_count_and_a_spike_restarts_it():
    """``for_run(warmup_steps=w)`` has the grad rule count from w kept updates (the loss rules
    arm as before); it turns on once ``arm_quiet`` updates in a row stayed inside its bar, and
    a spike before that (a healthy run's grad norm spikes 5-160x as the LR peaks and for a few
    dozen updates after) is not skipped and restarts the count. Host and device agree on every
    step."""
    config = sg.DetectorConfig.for_run(160, warmup_steps=20)
    assert (config.grad_arm_after, config.arm_after, config.arm_quiet) == (20, 16, 20)
    assert sg.DetectorConfig.for_run(160, warmup_steps=50).grad_arm_after == 50
    assert sg.DetectorConfig.for_run(160).grad_arm_after == 0
    base = _falling(80)

    def spiked(steps):
        out = list(base)
        for t in steps:
            med = sorted(m.grad_norm for m in base[t - 20:t])[10]
            out[t] = sg.StepMetrics(step=t, loss=base[t].loss, grad_norm=50.0 * med)
        return out
    # quiet from 20: on at the 20th quiet update (step 39), so a spike at 45 is skipped
    assert _judge(config, spiked([45]))[45].skip
    # a spike at 30 (10 quiet updates in) is let through and restarts the count: the spike at
    # 45 (14 in) too; the rule is on from step 65 and skips the one at 70
    v = _judge(config, spiked([30, 45, 70]))
    assert [v[t].skip for t in (30, 45, 70)] == [False, False, True]
    garbage = sg.StepMetrics(step=30, loss=3.0 * base[30].loss, grad_norm=base[30].grad_norm)
    assert _judge(config, [*base[:30], garbage])[-1].skip  # the loss rules are armed


def test_the_weights_check_tests_its_reference_against_half_the_loss_bar():
    """A reference batch re-run under moved weights need not look as bad as a fresh outlier:
    its loss halfway to the loss rule's bar already says the weights are off, while its grad
    norm must still pass the full grad bar (a healthy old batch reaches 1.7x the median often
    enough to let a storm batch through)."""
    config = sg.DetectorConfig.for_run(200)
    gate = DeviceGate(config)
    for m in _falling(60):
        gate(torch.tensor(m.grad_norm, dtype=torch.float64), torch.tensor(m.loss, dtype=torch.float64))
    level, limit = float(gate.level.value), float(gate._loss_limit())
    median = float(gate.median.value)
    f64 = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    between = level + 0.75 * (limit - level)
    assert not gate.test(f64(median), f64(between)) and gate.reference_test(f64(median), f64(between))
    below = level + 0.25 * (limit - level)
    assert not gate.reference_test(f64(median), f64(below))
    assert not gate.reference_test(f64(1.7 * median), f64(level))  # the grad bar is not halved
    assert gate.reference_test(f64(40.0 * median), f64(level))


def test_an_elevated_reference_inside_the_bar_asks_the_next_oldest_which_decides():
    """The weights check's first reference past the midpoint of the median and the grad bar but
    inside the bar says neither weights nor batch: the next oldest kept batch is re-run and its
    own test decides. A first reference below the midpoint decides alone (one re-run)."""
    from types import SimpleNamespace

    from spikeguard.guard.weights import WeightsProbe

    config = sg.DetectorConfig.for_run(200)
    gate = DeviceGate(config)
    for m in _falling(60):
        gate(torch.tensor(m.grad_norm, dtype=torch.float64), torch.tensor(m.loss, dtype=torch.float64))
    median, bar = float(gate.median.value), float(gate._grad_limit())
    mid, level = math.sqrt(median * bar), float(gate.level.value)
    stats = SimpleNamespace(norm=torch.zeros(()))
    ran = []

    def ref(step, norm):
        return lambda: ran.append(step) or (level, 0.0, norm, stats)

    updater = SimpleNamespace(measure_rerun=lambda out: out, gate=gate)
    cases = [((0.9 * mid, 2.0 * bar), False, [1]),             # below the midpoint: alone
             ((0.5 * (mid + bar), 1.1 * bar), True, [1, 2]),   # elevated: the second fails
             ((0.5 * (mid + bar), 0.9 * bar), False, [1, 2]),  # elevated: the second passes
             ((1.1 * bar, 0.5 * median), True, [1])]           # past the bar: alone
    for (first, second), weights, runs in cases:
        probe = WeightsProbe(updater, None)
        probe.remember(1, ref(1, first))
        probe.remember(2, ref(2, second))
        ran.clear()
        check = probe.check()
        assert check.weights is weights and ran == runs, (first, second)
        assert (check.second is None) == (runs == [1])
        if check.second is not None:
            assert check.second["reference_step"] == 2 and check.second["grad_norm"] == second


def _run(tmp_path, name, **kw):
    out = tmp_path / name
    cfg = TrainConfig(model="tiny", batch_size=8, out=str(out), progress=False, plot=False,
                      eval_batches=4, **kw)
    result = train(cfg, echo=False)
    return result, read_metrics(out / "metrics.jsonl")


@pytest.mark.slow
@pytest.mark.parametrize("steps", [20, 60, 160])
@pytest.mark.parametrize("tier2", ["alert", "rollback"])
def test_clean_runs_never_halt_or_roll_back(tmp_path, one_thread, steps, tier2):
    for seed in (0, 1):
        result, records = _run(tmp_path, f"{seed}", steps=steps, seed=seed,
                               warmup_steps=min(20, steps // 2), guard=GuardConfig(tier2=tier2))
        assert result.halted is None and result.rollbacks == 0, (seed, result.halted)
        assert [r["step"] for r in records] == list(range(steps))
        assert not [r["step"] for r in records if r["action"] in ("halt", "rollback")]


@pytest.mark.slow
def test_a_weight_driven_spike_is_let_through_and_the_run_ends_as_unguarded(tmp_path, one_thread):
    """Seed 25 of the tiny model at batch 8, peak LR 3e-3: right after warmup one ordinary
    update moves the weights somewhere sharp and the next batches show 7-40x the median grad
    norm. Skipping them kept the weights there (the old guard skipped six in a row and halted on
    the storm). With ``spikeguard train``'s defaults the grad rule is not armed yet (it waits
    out the warmup's aftermath): the run is the unguarded one, bit for bit. Armed from the
    start (``grad_arm_after=1``, as a loop that gives for_run no warmup), the weights check
    re-runs a batch from 16 kept steps back under the same weights, finds it failing the gate
    too, and lets the clipped update through: cause "weights", an alert, no storm, no Tier 2.
    (Armed that early it also skips two ordinary batches with outlying gradients at steps
    32-33, and that alone moves the final loss by +0.8%: why the default waits.)"""
    bare, _ = _run(tmp_path, "bare", steps=300, seed=25, guard=GuardConfig(respond=False))
    default, records = _run(tmp_path, "default", steps=300, seed=25)
    assert default.val_loss == bare.val_loss and not any(r["skipped"] for r in records)
    # on at the first quiet update after arm_after (arm_quiet=1), as the grad rule was before
    # it counted its quiet updates
    armed = GuardConfig(detector=sg.DetectorConfig(grad_arm_after=1, arm_quiet=1))
    guarded, records = _run(tmp_path, "guard", steps=300, seed=25, guard=armed)
    assert guarded.halted is None and guarded.rollbacks == 0
    weights = [r for r in records if r.get("cause") == "weights"]
    assert weights, [(r["step"], r["action"]) for r in records if r["action"] != "continue"]
    for r in weights:
        assert r["action"] == "alert" and r["skipped"] is False
        check = r["weights_check"]
        assert check["weights"] is True and check["reference_step"] < r["step"]
        assert any(x.startswith("weights check:") for x in r["reasons"])
    skipped = [r["step"] for r in records if r["skipped"]]
    assert not any(b - a == 5 for a, b in zip(skipped, skipped[5:])), skipped  # no storm
    assert not [r["step"] for r in records if r["action"] in ("rollback", "halt")]


@pytest.mark.slow
@pytest.mark.parametrize("dropout, micro", [(0.1, 1), (0.0, 4), (0.1, 4)])
def test_the_re_run_of_a_bad_batch_says_data_with_dropout_and_accumulation(one_thread, dropout,
                                                                            micro):
    """A garbage batch at step 80 (its loss far above the run's), on every micro-batch: the
    guard's re-run replays
    every micro-batch under the RNG state its forward started from (dropout draws the same
    masks), so it reproduces the step bit for bit and the cause is "data"; the weights check
    (a batch 16 kept steps back) cleared the weights first."""
    import dataclasses

    import torch

    from spikeguard.guard import Guard

    torch.manual_seed(0)
    cfg = dataclasses.replace(sg.GPTConfig.tiny(), dropout=dropout)
    model = sg.GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), fused=True)
    data = sg.TokenStream.from_corpus("pydoc", batch_size=8, seq_len=cfg.seq_len, seed=0)
    # no warmup (a constant LR): the grad rule waits 40 updates, past the spikes a constant 3e-3
    # gives this model at steps 20-26; a re-run budget of 5%, since a batch of the corpus with an
    # outlying row (z 60) is skipped at step 40 with dropout on and would spend the 1% default
    guard = Guard(model, opt, config=GuardConfig(
        detector=sg.DetectorConfig.for_run(100, warmup_steps=0),
        attribution=sg.AttributionConfig(rerun_budget=0.05)))
    verdicts = []
    for t in range(90):
        x, y = next(data)
        if t == 80:  # garbage: inputs one repeated byte, targets random bytes
            x = torch.full_like(x, 0xFF)
            y = torch.randint(0, 256, y.shape, generator=torch.Generator().manual_seed(1))
        for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
            def rerun(xs=xs, ys=ys):
                with guard.autocast():
                    o = model.loss(model(xs), ys)
                guard.backward(o.loss / micro)
                return o

            with guard.autocast():
                out = model.loss(model(xs), ys)
            guard.backward(out.loss / micro)
            guard.accumulate(out, rerun=rerun)
        verdicts += guard.step()
    v = verdicts[80]
    assert v.skip and v.step == 80
    assert any(r.startswith("rerun: data") for r in v.reasons), v.reasons
    assert any(r.startswith("weights check:") and r.endswith("the batch") for r in v.reasons)


def test_a_loss_scaler_overflow_steps_the_schedule_as_a_plain_amp_loop_does(tmp_path, one_thread):
    """fp16: the scaler skips an overflowing step on its own; the guard adds nothing to that, so
    the LR schedule steps as in torch's AMP recipe (``scheduler.step()`` every iteration) and
    a run the guard never acts on is the unguarded run, bit for bit. Holding the schedule there
    instead shifted seed 2 of the detection benchmark's fp16 cell by one schedule step at step 27
    and ended it 4.3% above the unguarded arm."""
    kw = dict(steps=40, seed=0, precision="fp16-mixed", inject=["overflow@25"])
    bare, bare_records = _run(tmp_path, "bare", guard=GuardConfig(respond=False), **kw)
    guarded, records = _run(tmp_path, "guard", **kw)
    overflows = [r["step"] for r in records if r["skipped"]]
    assert 25 in overflows and all(r["tier"] == 0 for r in records if r["skipped"]), overflows
    assert [r["lr"] for r in records] == [r["lr"] for r in bare_records]
    assert guarded.val_loss == bare.val_loss
    assert guarded.applied == 40 - len(overflows)  # the overflows applied nothing


@pytest.mark.slow
def test_an_lr_fault_pages_at_the_faulty_update_and_rollback_replays_past_it(tmp_path, one_thread):
    """LR x50 for 5 steps at step 80: the update ratio of step 80's update (the signals' reading,
    every step) is 50x its median before the loss has moved (diagnose's replay of the unguarded
    log pages there). The guard sees the LR jump before the step: Tier 2 comes at step 80 itself,
    with the update withheld; under the default policy it pages and training goes on; under
    rollback too, with nothing to roll back (the weights are as they were), and the run ends
    below the unguarded run."""
    kw = dict(steps=120, seed=0, inject=["lr@80:50:5"])
    bare, bare_records = _run(tmp_path, "bare", guard=GuardConfig(respond=False), **kw)
    ratios = [r["update_ratio"] for r in bare_records[48:80]]
    assert bare_records[80]["update_ratio"] >= 20 * sorted(ratios)[16]  # the premise, measured
    assert bare_records[79]["loss"] < 1.2 * bare_records[78]["loss"]  # the loss had not moved
    # diagnose replays the log's update_ratio column through the same rule
    replayed = diagnose(tmp_path / "bare" / "metrics.jsonl").replay.flagged
    assert any(v.step == 80 and v.tier == 2 and v.reasons[0] == "update_ratio > 20x median"
               for v in replayed), [(v.step, v.tier, v.reasons[:1]) for v in replayed]
    alert, records = _run(tmp_path, "alert", **kw)
    first = next(r for r in records if r["tier"] >= 2)
    assert first["step"] == 80 and first["action"] == "alert", first
    assert first["skipped"] and any(x.startswith("lr jump") for x in first["reasons"])
    # the run goes on to its end; each update it withheld is made up by one more batch
    withheld = sum(bool(r["skipped"]) for r in records)
    assert alert.halted is None and alert.made_up == withheld
    assert [r["step"] for r in records] == list(range(120 + withheld))
    rolled, records = _run(tmp_path, "rollback", guard=GuardConfig(tier2="rollback"), **kw)
    first = next(r for r in records if r["tier"] >= 2)
    assert first["step"] == 80 and first["action"] == "alert" and first["skipped"], first
    assert "rollback_not_needed" in first
    assert rolled.halted is None and rolled.rollbacks == 0
    assert rolled.val_loss < bare.val_loss, (rolled.val_loss, bare.val_loss)


@pytest.mark.slow
def test_a_reproduced_gradient_spike_at_an_ordinary_loss_goes_through_and_above_it_is_skipped():
    """A batch whose gradient is 30x the median, which its re-run reproduces, with no outlier
    sequence: at a loss within the loss's own noise of the recent median (under it, or above it
    by less than one robust spread, the noise the loss bar is sized from) nothing in the batch
    is out of place, so attribution lets the clipped update through (cause unknown, an alert);
    the same spike at a loss more than a spread above the median stays skipped. The steps are
    chosen from the clean run itself: after 150, the first whose loss is under the median of
    the 32 before it, the first above it by under half a spread, and the first above it by
    over two spreads (the spread as the detector takes it: 1.4826 / sqrt(2) x the median
    step-to-step difference)."""
    from tests.guard_harness import Fault, guarded_run

    clean = guarded_run(steps=200)
    losses = [clean.losses[t] for t in range(200)]

    def z(t):
        return (losses[t] - statistics_median(losses, t)) / spread(losses, t)
    below = next(t for t in range(150, 190) if z(t) <= -0.3)
    within = next(t for t in range(150, 190) if 0.05 <= z(t) <= 0.5)
    above = next(t for t in range(150, 190) if z(t) >= 2.0)
    for step, released in ((below, True), (within, True), (above, False)):
        run = guarded_run(steps=step + 5, faults=[Fault("sharp", step, mult=30.0)],
                          watch=(step,))
        v = next(v for v in run.verdicts if v.step == step)
        ev = v.evidence
        assert ev["grad_norm"] >= 20 * ev["grad_median"] and ev["loss_flag"] is False, ev
        # the premise, from the detector's own numbers
        assert (ev["loss"] <= ev["loss_median"] + ev["loss_spread"]) is released, (step, ev)
        if step == within:
            assert ev["loss"] > ev["loss_median"], ev
        assert any(r.startswith("rerun: data") for r in v.reasons), v.reasons
        if released:
            assert not v.skip and v.action is sg.Action.ALERT, v
            assert any(r.startswith("released:") for r in v.reasons)
            assert not _same(*run.around[step])  # the update was applied
        else:
            assert v.skip and v.action is sg.Action.SKIP, v
            assert _same(*run.around[step])  # withheld: weights and moments as they were


@pytest.mark.slow
def test_a_quarantined_sequence_keeps_an_ordinary_spike_skipped_only_when_it_causes_it():
    """At an ordinary loss, a reproduced gradient spike in a batch whose top row scores past the
    quarantine bar (z > 5, as the top row of about one clean batch in eight does): when every
    row's gradient is 30x, the batch without that row still fails the gate, the row does not
    explain the spike, is named but not quarantined, and the clipped update goes through; when
    that row's gradient alone is 100x, the batch without it passes, the row is quarantined and
    the step stays skipped. The step is chosen from the
    clean run: the first after 150 whose loss is under the median of the 32 before it and whose
    top row scores over 6."""
    from tests.guard_harness import Fault, guarded_run

    clean = guarded_run(steps=200)
    losses = [clean.losses[t] for t in range(200)]
    step = next(t for t in range(150, 190) if clean.top_z[t][1] > 6
                and losses[t] <= 0.98 * statistics_median(losses, t))
    row = clean.top_z[step][0]
    for fault, released in ((Fault("sharp", step, mult=30.0), True),
                            (Fault("sharp-row", step, mult=100.0, row=row), False)):
        run = guarded_run(steps=200, stop_at=step + 5, faults=[fault], watch=(step,))
        assert run.top_z[step] == clean.top_z[step]  # the same batch, the same weights
        v = next(v for v in run.verdicts if v.step == step)
        ev = v.evidence
        assert ev["grad_norm"] >= 5 * ev["grad_median"] and ev["loss_flag"] is False, ev
        assert ev["loss"] <= ev["loss_median"]
        assert any(r.startswith("rerun: data") for r in v.reasons), v.reasons
        named = [r for r in v.reasons if f"row {row} (micro-batch 0 row {row}" in r]
        held = [q for s, _, q in run.guard.attribution.skips if s == step]
        if released:  # the row is named, not quarantined: no line in quarantine.jsonl
            assert len(named) == 1 and named[0].startswith("not quarantined: 1 sequence(s)")
            assert "the 7/8 other rows still fail the gate" in named[0], named
            assert named[0].endswith("they do not explain it") and held == [[]], (named, held)
            assert not v.skip and v.action is sg.Action.ALERT, v
            assert any(r.startswith("released:") for r in v.reasons)
            assert not _same(*run.around[step])  # the update was applied
        else:
            assert len(named) == 1 and named[0].startswith("quarantined 1 sequence(s)"), named
            i = v.reasons.index(named[0])
            assert v.reasons[i + 1].startswith("the 7/8 other rows pass the gate")
            assert v.reasons[i + 1].endswith("the quarantined explain it"), v.reasons
            assert held == [[(step, 0, row)]], held
            assert v.skip and v.action is sg.Action.SKIP, v
            assert _same(*run.around[step])  # withheld: weights and moments as they were


def statistics_median(losses, t, window=32):
    import statistics

    return statistics.median(losses[t - window:t])


def spread(losses, t, window=32):
    """The loss rule's spread over the ``window`` losses before t, computed apart: 1.4826 /
    sqrt(2) x the median absolute step-to-step difference."""
    import math
    import statistics

    w = losses[t - window:t]
    return 1.4826 / math.sqrt(2) * statistics.median(abs(b - a) for a, b in zip(w, w[1:]))


def _same(a, b):
    from tests.guard_harness import unchanged

    return unchanged(a, b)


@pytest.mark.slow
def test_a_garbage_batch_before_the_grad_rule_arms_is_skipped(tmp_path, one_thread):
    """Between the loss rules' arming and the grad rule's, a batch far out on both the grad
    norm and the loss is a bad batch, not the grad norm's turbulence after warmup (which comes
    on fine batches, at an ordinary loss). Tiny model, batch 8, peak LR 3e-3, warmup 40 given
    to the detector (as ``spikeguard train`` gives it): the loss rules arm at 30 kept updates,
    the grad rule counts its quiet updates from 40 and is on at step 59 on this run. Batch 57
    is random bytes: its grad norm over 6x the median, its loss 1.25x the median, under the
    loss rule's +40% floor and under the loss/EMA alert, so no rule but the joint test with the
    whole grad bar sees it. It is skipped (Tier 1, cause data); the same run without it has no
    flag at all. (``spikeguard train`` also hands the guard the ids, and the input-token check
    flags the batch too: its reason is the last one, left out of the detector's below.)"""
    steps, warmup, early = 300, 40, 57
    config = sg.DetectorConfig.for_run(steps, warmup_steps=warmup)
    _, clean = _run(tmp_path, "clean", steps=steps, seed=0, warmup_steps=warmup)
    assert not [r["step"] for r in clean if r["action"] != "continue" or r["skipped"]]
    detector = sg.SpikeDetector(config)
    for q in clean:  # where the clean run's grad rule turns on
        detector.update(sg.StepMetrics(step=q["step"], loss=q["loss"], grad_norm=q["grad_norm"],
                                       log_z=q["log_z"]), released=False)
        if detector.state_dict()["rules"]["grad_spike"]["on"]:
            break
    assert config.arm_after < early < q["step"], q["step"]
    _, records = _run(tmp_path, "garbage", steps=steps, seed=0, warmup_steps=warmup,
                      inject=(f"outlier@{early}",))
    flagged = [(r["step"], r["action"], r["skipped"]) for r in records
               if r["action"] != "continue" or r["skipped"]]
    assert flagged == [(early, "skip", True)], flagged
    assert records[early]["reasons"][0] == "loss and grad_norm both past half their bars, grad rule not on"
    assert records[early]["cause"] == "data"
    # the premises, from the detector's own numbers at those steps (a replay of the records)
    detector = sg.SpikeDetector(config)
    verdicts = [detector.update(sg.StepMetrics(step=q["step"], loss=q["loss"],
                                               grad_norm=q["grad_norm"], log_z=q["log_z"]),
                                released=not q["skipped"] and q["action"] != "continue")
                for q in records[:early + 1]]
    assert verdicts[early].reasons == tuple(x for x in records[early]["reasons"] if not
                                            x.startswith(("weights check", "rerun", "quarantined",
                                                          "tokens:")))
    ev = verdicts[early].evidence
    assert ev["grad_norm"] > 6.0 * ev["grad_median"], ev
    assert 1.2 * ev["loss_median"] < ev["loss"] < ev["loss_limit"], ev  # under the loss bar
    assert ev["loss_limit"] == pytest.approx((1 + config.loss_min_rise) * ev["loss_median"])
    assert ev["loss_ema_ratio"] < config.alert_ratio, ev  # no alert from loss / EMA either


def _storm_setup(config):
    """A healthy falling run, a fresh garbage batch far past both bars, and a later batch of
    the storm sized from the run: 2.5x the grad median and 40% of the loss bar's rise, inside
    the grad bar and inside the joint test."""
    metrics = _falling(60, noise=0.05)
    probe = sg.SpikeDetector(config)
    for m in metrics:
        probe.update(m, released=False)
    ls = probe._rules["loss_spike"]
    level = ls.level.value
    limit = loss_limit(level, ls.spread.value, config)
    storm = sg.StepMetrics(step=60, loss=level * 1.6, grad_norm=20.0 * probe.grad_median)
    faded = sg.StepMetrics(step=61, loss=level + 0.4 * (limit - level),
                           grad_norm=2.5 * probe.grad_median)
    assert faded.grad_norm < probe._grad.limit and faded.loss < level + 0.5 * (limit - level)
    return metrics, storm, faded


def test_a_storm_batch_inside_both_bars_after_a_blamed_skip_is_skipped_on_host_and_device():
    """A storm's later batch meets weights its first batches began to fit (zoo, tiny, seed 1,
    a storm of random token ids 2 steps after arming: its third batch at 5.7x the grad median
    under a 5.8x bar, +19% loss under the joint test). Right after a skip whose batch the
    weights check blamed it is skipped, by the host detector and the device gate alike; not on
    its own, not after a flag the check did not blame on the batch, not with the test off; a
    detector and a gate restored between the two steps decide the same."""
    config = sg.DetectorConfig.for_run(200)
    metrics, storm, faded = _storm_setup(config)
    alone = _judge(config, [*metrics, dataclasses.replace(faded, step=60)], blamed=True)[-1]
    assert not alone.skip
    *_, first, second = _judge(config, [*metrics, storm, faded], blamed=True)
    assert first.skip and second.skip
    assert any(r.startswith("loss and grad_norm up right after a skipped garbage batch")
               for r in second.reasons)
    # the flag was not blamed on the batch (released, or the weights at fault): no storm test
    assert not _judge(config, [*metrics, storm, faded], blamed=False)[-1].skip
    off = dataclasses.replace(config, storm_loss_frac=0.0)
    assert not _judge(off, [*metrics, storm, faded], blamed=True)[-1].skip
    # resumed between the two: the same decision from the saved states
    detector, gate = sg.SpikeDetector(config), DeviceGate(config)
    _judge(config, [*metrics, storm], blamed=True, detector=detector, gate=gate)
    detector2, gate2 = sg.SpikeDetector(config), DeviceGate(config)
    detector2.load_state_dict(json.loads(json.dumps(detector.state_dict())))
    gate2.load_state_dict(json.loads(json.dumps(gate.state_dict())))
    assert gate2.after_skip and gate2.skip_run == 1
    assert _judge(config, [faded], blamed=True, detector=detector2, gate=gate2)[-1].skip


def test_the_storm_test_never_chains_past_the_skip_storm_bound_nor_on_a_weak_reference():
    """The storm test cannot hold the weights by itself: after max_consecutive_skips blamed
    skips in a row it is off (the skip-storm rule's turn), and the weights check of a step
    judged with it holds the reference batch to the same lowered bars, so weights that make
    any batch look like that (a natural instability) are found at fault and the update goes
    through instead of chaining into the next step."""
    config = sg.DetectorConfig.for_run(200)
    metrics, storm, faded = _storm_setup(config)
    n = config.max_consecutive_skips
    later = [dataclasses.replace(faded, step=61 + i) for i in range(n + 1)]
    verdicts = _judge(config, [*metrics, storm, *later], blamed=True)[60:]
    # the fresh batch, then n - 1 storm-test skips; the next one is judged without the test
    assert [v.skip for v in verdicts] == [True] * n + [False, False]
    gate = DeviceGate(config)
    _judge(config, [*metrics, storm], blamed=True, gate=gate)
    f64 = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    # a reference like the faded batch: passes the ordinary reference test, fails the storm one
    ref = (f64(faded.grad_norm), f64(faded.loss))
    assert bool(gate.reference_test(*ref))
    gate.resolved(False)
    assert not gate.after_skip and not bool(gate.reference_test(*ref))


def test_the_weights_at_fault_twice_with_the_loss_up_is_tier_2_dated_at_the_first():
    """A flag whose update the weights check let through (an old batch failed under the same
    weights) with the loss up, twice within loss_window updates, is Tier 2 at the second,
    dated at the first: damaged weights, not a batch. Not for a grad-only flag (the post-warmup
    turbulence the clipped update repairs), not blind, not far apart; once per cluster; a
    detector restored between the two fires the same."""
    config = sg.DetectorConfig.for_run(200)
    metrics = _falling(60, noise=0.05)
    base = sg.SpikeDetector(config)
    for m in metrics:
        base.update(m, released=False)
    level = base._rules["loss_spike"].level.value
    bad = lambda t: sg.StepMetrics(step=t, loss=level * 1.8,  # noqa: E731
                                   grad_norm=10.0 * base.grad_median)
    spike = lambda t: sg.StepMetrics(step=t, loss=level,  # noqa: E731
                                     grad_norm=10.0 * base.grad_median)
    healthy = [dataclasses.replace(m, step=61 + i) for i, m in enumerate(metrics[-12:])]

    def run(stream, *, blind=False, flagged=lambda m: m.grad_norm > 5 * base.grad_median):
        d = copy.deepcopy(base)
        return [d.update(m, released=flagged(m), blind=blind) for m in stream]

    twice = run([bad(60), *healthy[:3], bad(64)])
    assert twice[0].tier == 1 and twice[0].action is sg.Action.ALERT
    assert twice[-1].tier == 2 and twice[-1].onset_step == 60
    assert any(r.startswith("the weights at fault twice") for r in twice[-1].reasons)
    # a third in the same cluster does not fire again
    assert all(v.tier < 2 for v in run([bad(60), bad(61), *healthy[:3], bad(65)])[2:])
    assert max(v.tier for v in run([spike(60), *healthy[:3], spike(64)])) < 2  # grad alone
    assert max(v.tier for v in run([bad(60), *healthy[:3], bad(64)], blind=True)) < 2
    gap = [dataclasses.replace(m, step=61 + i) for i, m in enumerate(metrics[-12:] * 3)]
    far = run([bad(60), *gap, bad(97)])
    assert not any(v.skip for v in far[1:-1]) and max(v.tier for v in far) < 2
    # restored between the two: the same event
    d = copy.deepcopy(base)
    for m in [bad(60), *healthy[:3]]:
        d.update(m, released=m.grad_norm > 5 * base.grad_median)
    d2 = sg.SpikeDetector(config)
    d2.load_state_dict(json.loads(json.dumps(d.state_dict())))
    assert d2.update(bad(64), released=True).tier == 2


def test_a_passing_reference_does_not_clear_weights_a_recent_page_or_flag_named():
    """Within loss_window steps after a Tier 2 page for log Z (or a flag blamed on the weights
    with the loss up; not a grad-norm flag alone), a reference that passes leaves the step to
    the weights (released, ``suspect`` says why);
    not before the page, not past the window, not after a rollback went back past it, and not
    for a step whose grad norm is past the grad bar's multiple of the reference's (its batch)."""
    from types import SimpleNamespace

    from spikeguard.detector.detector import Verdict
    from spikeguard.guard.weights import WeightsCheck, WeightsProbe, weights_reason

    config = sg.DetectorConfig.for_run(200)
    gate = SimpleNamespace(grad_multiple=lambda: 4.0, reference_test=None,
                           reference_elevated=None)
    probe = WeightsProbe(SimpleNamespace(measure_rerun=None, gate=gate), None, detector=sg.SpikeDetector(config))
    passed = WeightsCheck(weights=False, reference_step=3, grad_norm=1.0, loss=2.0)

    def verdict(step, tier, *reasons, loss_flag=False):
        return Verdict(step, tier, sg.Action.ALERT, reasons, step, {"loss_flag": loss_flag},
                       False)

    assert probe._suspected(50, passed, 2.0) is passed  # nothing named the weights yet
    # a skip storm's page (with a log Z context reason) does not name them
    probe.judged(40, verdict(40, 2, "skips > 5 consecutive", "log_z > median + 0.5"), None)
    assert probe.suspect is None
    page = f"log_z > median of last {config.log_z_jump_window} + {config.log_z_jump:g}"
    probe.judged(40, verdict(40, 2, page, "grad_norm > 3x median"), None)
    got = probe._suspected(50, passed, 2.0)
    assert got.weights is True and got.suspect == f"step 40: {page}"
    assert "but the weights are the suspect" in weights_reason(got.record())
    assert weights_reason(got.record()).endswith(": the weights")
    assert probe._suspected(50, passed, 4.5).weights is False  # outsized: its batch
    assert probe._suspected(40 + config.loss_window + 1, passed, 2.0).weights is False
    assert probe._suspected(40, passed, 2.0).weights is False  # the page's own step
    probe.judged(30, verdict(30, 0), None)  # a rollback went back past step 40
    assert probe.suspect is None
    # a grad-norm flag alone blamed on the weights: the clipped update repairs it (a warmup's end)
    probe.judged(31, verdict(31, 1, "grad_norm > 3x median"), "weights")
    assert probe.suspect is None
    probe.judged(31, verdict(31, 1, "loss > median + 6 spreads", loss_flag=True), "weights")
    assert probe._suspected(33, passed, 2.0).suspect == (
        "step 31: a flag blamed on the weights, the loss up")
    failed = WeightsCheck(weights=True, reference_step=3, grad_norm=5.0, loss=2.0)
    assert probe._suspected(33, failed, 2.0) is failed
    # under tier2="rollback" the page rolls the weights back: a passing reference clears them
    rollback = WeightsProbe(SimpleNamespace(measure_rerun=None, gate=gate), None,
                            detector=sg.SpikeDetector(config), suspect=False)
    rollback.judged(31, verdict(31, 1, "loss > median + 6 spreads", loss_flag=True), "weights")
    assert rollback._suspected(33, passed, 2.0) is passed


def test_the_output_logit_proxy_under_the_default_policy_is_not_skipped_into_a_worse_run():
    """The zoo's output-logit proxy (tiny, no z-loss, LR 1.0), seed 5, default policy: a flag
    at step 75 blamed on the weights, then at 76 a fresh batch whose reference passed. Skipped
    as the batch's, that one step left the run at 1.078x its unguarded run's held-out loss
    (3.174 against 2.944 on an EPYC); released as the weights', the run equals it."""
    from benchmarks.zoo import _job
    from benchmarks.zoo_run import run_one

    records: list = []
    guarded = run_one(_job("natural", "natural/output-logit", "output-logit", 5, "alert"), records)
    unguarded = run_one(_job("natural", "natural/output-logit", "output-logit", 5, "unguarded"))
    released = [r for r in records if (r.get("weights_check") or {}).get("suspect")]
    assert released and all(r["action"] != "skip" for r in released)
    assert guarded["val_loss"] <= 1.005 * unguarded["val_loss"]

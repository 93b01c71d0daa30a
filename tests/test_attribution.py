"""Attribution of skipped steps end to end on the reference GPT (CPU, GPTConfig.tiny()).

References: the planted row itself (the harness knows where it wrote the garbage), the step's own
loss and grad norm (a re-run on CPU reproduces them bit for bit), a clean run with the same seed,
a run with re-runs off (a re-run must change nothing), numpy's median for the robust z-score.
"""

import math

import numpy as np
import pytest
import torch

import spikeguard as sg
from spikeguard.guard import AttributionConfig, GuardConfig
from spikeguard.guard.attribution import Attribution, kept_weight, outliers, robust_z
from spikeguard.sinks import read_metrics
from spikeguard.train.faults import Injector

from .attribution_harness import attributed_run

STEPS, BATCH = 300, 16
GARBAGE = (150, 5)     # (batch index = step, row) of the planted sequence
GRAD = (225, 10.0)     # a one-time gradient multiply (not the data)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def clean(tmp_path_factory, one_thread_module):
    return attributed_run(steps=STEPS, batch=BATCH, out=tmp_path_factory.mktemp("clean"))


@pytest.fixture(scope="module")
def dropped(tmp_path_factory, one_thread_module):
    return attributed_run(steps=STEPS, batch=BATCH, out=tmp_path_factory.mktemp("drop"),
                          garbage=(GARBAGE,), grad_mult=GRAD, drop=True)


def _by_step(run):
    return {r["step"]: r for r in run.records()}


# ---------------------------------------------------------------- the must-show run
@pytest.mark.slow
def test_the_quarantine_names_exactly_the_planted_sequence(dropped):
    q = dropped.quarantine()
    assert [(r["step"], r["stream_index"], r["rank"], r["row"]) for r in q] == \
        [(GARBAGE[0], GARBAGE[0], 0, GARBAGE[1])]
    assert q[0]["z"] > 5 and set(q[0]) == {"step", "stream_index", "micro_batch", "micro_row",
                                            "rank", "row", "loss", "log_z", "z"}
    assert q[0]["micro_batch"] == 0 and q[0]["micro_row"] == q[0]["row"]  # one micro-batch
    rec = _by_step(dropped)[GARBAGE[0]]
    # what happened: the batch without the planted row was applied (a drop), not a skip
    assert rec["action"] == "drop" and rec["cause"] == "data" and rec["quarantined"] == 1
    # deterministic CPU kernels: the re-run reproduces the step bit for bit
    assert rec["rerun"] == {"loss": rec["loss"], "grad_norm": rec["grad_norm"]}
    assert any(r.startswith("rerun: data") for r in rec["reasons"])


@pytest.mark.slow
def test_a_one_time_gradient_multiply_is_reported_transient(dropped):
    rec = _by_step(dropped)[GRAD[0]]
    assert rec["action"] == "skip" and rec["skipped"] and rec["cause"] == "transient"
    # the re-run measures the gradient without the multiply: 10x smaller
    assert rec["rerun"]["grad_norm"] == pytest.approx(rec["grad_norm"] / GRAD[1], rel=1e-5)
    assert "quarantined" not in rec and all(r["step"] != GRAD[0] for r in dropped.quarantine())
    assert any(r.startswith("rerun: transient") for r in rec["reasons"])


@pytest.mark.slow
def test_dropping_the_sequence_keeps_15_of_16_and_ends_within_2pct_of_clean(dropped, clean):
    assert [v.step for v in clean.verdicts if v.skip] == []
    rec = _by_step(dropped)[GARBAGE[0]]
    assert rec["kept_rows"] == [BATCH - 1, BATCH] and rec["skipped"] is False
    assert rec["action"] == "drop"
    drop = next(v for v in dropped.verdicts if v.step == GARBAGE[0])
    assert not drop.skip  # the verdict the loop sees says the update went through too
    assert dropped.guard.applied == STEPS - 1  # only the transient step was withheld
    assert abs(dropped.final_loss() / clean.final_loss() - 1) < 0.02
    assert dropped.guard.attribution.reruns == 2  # steps 150 (verify, drop) and 225 (verify)


# ---------------------------------------------------------------- shorter runs
SHORT, AT, ROW = 60, 33, 3  # a row of 0xFF at step 33 of this run: grad norm ~6x its median


@pytest.mark.parametrize("read_lag", [0, 1])
def test_re_runs_change_nothing_unless_they_drop(tmp_path, read_lag):
    kw = dict(steps=SHORT, batch=8, garbage=((AT, ROW),), kind="repeat", read_lag=read_lag)
    on = attributed_run(out=tmp_path / "on", **kw)
    off = attributed_run(out=tmp_path / "off", rerun=False, **kw)
    rec_on, rec_off = _by_step(on)[AT], _by_step(off)[AT]
    assert rec_on["cause"] == "data" and rec_on["skipped"] and rec_off["cause"] == "unknown"
    # the same sequence is named with or without a re-run (without one the cause is unknown)
    assert [(r["stream_index"], r["row"]) for r in on.quarantine()] == [(AT, ROW)]
    assert on.quarantine() == off.quarantine()
    for p, q in zip(on.model.parameters(), off.model.parameters()):
        assert torch.equal(p, q)
    assert on.losses == off.losses


def test_read_lag_1_attributes_and_drops_as_read_lag_0(tmp_path):
    # under read_lag 1 the drop's update lands after the next step's backward: the guard re-runs
    # that step at the new weights, so the two runs are the same run
    runs = [attributed_run(steps=SHORT, batch=8, garbage=((AT, ROW),), kind="repeat", drop=True,
                           read_lag=lag, out=tmp_path / str(lag)) for lag in (0, 1)]
    a, b = (r.records() for r in runs)
    assert _by_step(runs[0])[AT]["kept_rows"] == [7, 8] and not _by_step(runs[0])[AT]["skipped"]
    assert a == b and runs[0].quarantine() == runs[1].quarantine()
    for p, q in zip(runs[0].model.parameters(), runs[1].model.parameters()):
        assert torch.equal(p, q)
    assert runs[0].guard.applied == runs[1].guard.applied == SHORT


def test_the_budget_bounds_re_runs_and_the_state_round_trips(tmp_path):
    # with no allowance, 1% of 34 or 39 steps rounds up to one re-run: the skip at 33 is re-run,
    # the one at 38 not
    run = attributed_run(steps=SHORT, batch=8, garbage=((AT, ROW), (38, 1)), kind="repeat",
                         out=tmp_path, attribution=AttributionConfig(rerun_allowance=0))
    recs = _by_step(run)
    assert recs[AT]["cause"] == "data" and recs[38]["skipped"] and recs[38]["cause"] == "unknown"
    assert [(r["step"], r["row"]) for r in run.quarantine()][:2] == [(AT, ROW), (38, 1)]
    att = run.guard.attribution  # later skips of this small run are not re-run either
    assert att.reruns == 1 and [(s, c) for s, c, _ in att.skips][:2] == [(AT, "data"), (38, "unknown")]
    assert all(c == "unknown" for _, c, _ in list(att.skips)[1:])
    fresh = Attribution(AttributionConfig())
    fresh.load_state_dict(att.state_dict())
    assert fresh.state_dict() == att.state_dict()
    fresh.reruns = 5
    fresh.load_state_dict(att.state_dict())  # a rollback restores older state: spent stays spent
    assert fresh.reruns == 5


def test_the_allowance_re_runs_skips_beyond_the_share(tmp_path):
    # one re-run beyond the share: the skip at 38 is re-run too, and the data reproduced it
    run = attributed_run(steps=SHORT, batch=8, garbage=((AT, ROW), (38, 1)), kind="repeat",
                         out=tmp_path, attribution=AttributionConfig(rerun_allowance=1))
    att = run.guard.attribution
    assert att.reruns == 2 and [(s, c) for s, c, _ in att.skips] == [(AT, "data"), (38, "data")]
    assert _by_step(run)[38]["rerun"]["grad_norm"] == _by_step(run)[38]["grad_norm"]
    # the allowance is spent once, whenever the skips come: 3 beyond 1 per 100 steps so far
    three = Attribution(AttributionConfig(rerun_allowance=3))
    for step, spent, allowed in ((0, 3, True), (0, 4, False), (99, 4, False), (100, 4, True),
                                 (100, 5, False), (1000, 13, True), (1000, 14, False)):
        three.reruns = spent
        assert three._allowed(step) is allowed, (step, spent)


@pytest.mark.slow
def test_a_rollback_replays_its_range_without_only_the_quarantined_sequences(tmp_path):
    bad = ((AT, 2), (AT + 1, 2))  # two in a row: a storm under max_consecutive_skips=1
    run = attributed_run(steps=SHORT, batch=8, garbage=bad, kind="repeat", drop=True,
                         tier2="rollback", every=10, out=tmp_path,
                         detector={"max_consecutive_skips": 1},
                         attribution=AttributionConfig(drop_sequences=True, rerun_budget=0.5))
    assert run.halted is None and run.guard.rollbacks == 1
    rb = next(r for r in run.records() if r["action"] == "rollback")
    assert rb["skip_range"] is None and rb["summary"]["skips"]["transient"] == []
    dropped = {int(i): rows for i, rows in rb["dropped_sequences"].items()}
    assert dropped == {AT: [2], AT + 1: [2]}
    assert rb["summary"]["skips"]["data"] == sorted(dropped)
    assert run.stream.dropped == dropped
    for i in dropped:  # the replayed batches hold the 7 other rows
        x, _ = run.stream.batch(i)
        assert x.shape[0] == 7 and run.stream.rows_of(i) == [0, 1, 3, 4, 5, 6, 7]
    replayed = [r for r in run.records()[run.records().index(rb) + 1:] if r["step"] in dropped]
    assert replayed and all(r["action"] == "continue" for r in replayed)


# ---------------------------------------------------------------- the pieces
def test_robust_z_equals_numpy_median_and_mad():
    x = [2.1, 2.4, 1.9, 2.2, 2.0, 7.5, 2.3, float("nan")]
    finite = np.array(x[:-1])
    med = np.median(finite)
    mad = np.median(np.abs(finite - med))
    want = (finite - med) / (1.4826 * mad)
    z = robust_z(x)
    np.testing.assert_allclose(z[:-1], want, rtol=1e-12)
    assert z[-1] == math.inf
    # MAD 0: the mean absolute deviation scales instead; all equal: every score is 0
    z = robust_z([1.0, 1.0, 1.0, 1.0, 3.0])
    assert z[-1] == pytest.approx(2.0 / (1.2533 * 0.4)) and z[0] == 0.0
    assert robust_z([4.0] * 5) == [0.0] * 5


def test_outliers_stand_out_above_on_loss_or_log_z_and_need_four_rows():
    rows = [{"loss": 2.0 + 0.1 * i, "log_z": 3.0 - 0.05 * i, "row": i} for i in range(8)]
    rows[3]["loss"] = 9.0   # high loss
    rows[6]["log_z"] = 8.0  # high log Z
    rows[1]["loss"] = -5.0  # far below: cannot drive a spike, not quarantined
    got = outliers(rows, 5.0)
    assert [r["row"] for r in got] == [3, 6] and all(r["z"] > 5 for r in got)
    assert outliers(rows[:3], 5.0) == []


def test_kept_weight_makes_the_ranks_average_the_global_token_mean():
    tokens = {(0, 0): 10, (0, 1): 10, (0, 2): 30, (1, 0): 20, (1, 1): 20, (1, 2): 5}
    rows = [{"rank": r, "pos": i, "tokens": float(n)} for (r, i), n in tokens.items()]
    gone = [rows[5], rows[0]]
    kept = {k: n for k, n in tokens.items() if k not in ((1, 2), (0, 0))}
    for rank in (0, 1):
        mine = sum(n for (r, _), n in kept.items() if r == rank)
        # the average over 2 ranks of weight_r * (rank r's token mean) is the global token mean
        assert kept_weight(rows, gone, rank) / 2 == pytest.approx(mine / sum(kept.values()))
    one = [r for r in rows if r["rank"] == 0]
    assert kept_weight(one, [one[1]], 0) == 1.0  # one rank: exact, no rescaling
    assert kept_weight(rows, gone, 3) == 1.0  # a rank without rows (a pipeline stage)


def test_config_refuses_bad_values_and_its_flags_are_generated():
    import argparse

    from spikeguard._config_cli import add_config_args, config_from_args

    for bad in (dict(rerun_budget=0.0), dict(quarantine_z=-1.0), dict(rerun_rtol=float("nan"))):
        with pytest.raises(ValueError, match="AttributionConfig"):
            AttributionConfig(**bad)
    with pytest.raises(ValueError, match="drop_sequences"):
        AttributionConfig(drop_sequences=1)
    p = argparse.ArgumentParser()
    add_config_args(p, GuardConfig)
    cfg = config_from_args(GuardConfig, p.parse_args(["--drop-sequences", "--quarantine-z", "4",
                                                      "--no-rerun", "--rerun-budget", "0.02"]))
    assert cfg.attribution == AttributionConfig(drop_sequences=True, quarantine_z=4.0,
                                                rerun=False, rerun_budget=0.02)


def test_token_stream_drops_rows_and_keeps_them_dropped_across_state():
    s = sg.TokenStream.from_corpus("pydoc", batch_size=4, seq_len=16, seed=3)
    full_x, full_y = s.batch(7)
    s.drop(7, [2])
    s.drop(7, [0, 2])
    x, y = s.batch(7)
    assert s.rows_of(7) == [1, 3] and torch.equal(x, full_x[[1, 3]])
    assert torch.equal(y, full_y[[1, 3]]) and torch.equal(s.batch(8)[0], s.batch(8)[0])
    t = sg.TokenStream.from_corpus("pydoc", batch_size=4, seq_len=16, seed=3)
    t.load_state_dict(s.state_dict())
    assert t.dropped == {7: [0, 2]} and torch.equal(t.batch(7)[0], x)
    s.drop(9, [0, 1, 2, 3])  # every row: the batch is skipped
    s.position = 9
    assert s.next_index() == 10 and (9, 9) in s.skip_ranges
    for bad in ((7, [4]), (-1, [0]), (7, [True])):
        with pytest.raises(ValueError, match="drop"):
            s.drop(*bad)


def test_injected_sequence_and_gradient_faults():
    inj = Injector(("seq@3:2", "grad@4:10"), rank=0, only_rank=None, vocab_size=256, seed=0)
    model = sg.GPT(sg.GPTConfig.tiny())
    x = torch.randint(0, 256, (4, 9), generator=torch.Generator().manual_seed(0))
    xi, yi = inj.begin(3, model, x[:, :-1], x[:, 1:])
    changed = [r for r in range(4) if not torch.equal(xi[r], x[r, :-1])]
    assert changed == [2] and torch.equal(xi[2, 1:], yi[2, :-1])  # one window, shifted
    assert torch.equal(yi[[0, 1, 3]], x[[0, 1, 3], 1:])
    model.loss(model(x[:, :-1]), x[:, 1:]).loss.backward()
    before = [p.grad.clone() for p in model.parameters()]
    inj.begin(4, model, x[:, :-1], x[:, 1:])
    inj.after_backward(model)
    for b, p in zip(before, model.parameters()):
        assert torch.equal(p.grad, b * 10)


def test_train_writes_the_quarantine_and_diagnose_shows_it_with_its_spike(tmp_path, capsys):
    # spikeguard train end to end: the injected sequence goes to quarantine.jsonl beside the
    # metrics, and spikeguard diagnose prints it under its spike
    import dataclasses
    import json

    from spikeguard.cli import main
    from spikeguard.train import TrainConfig, train

    cfg = TrainConfig(steps=60, model="tiny", batch_size=8, eval_batches=1, progress=False,
                      plot=False, out=str(tmp_path), inject=("seq@45:3:repeat",))
    # the flat 3x-median grad rule (grad_z 1): a 60-step run's early spread would otherwise
    # widen the bar past one repeated-byte row (see attribution_harness); it counts towards its
    # arming from the warmup's end (step 20) and turns on after arm_quiet=2 quiet updates: with
    # the default 20 the post-warmup spikes keep it off past step 45 (the test is about the
    # quarantine and diagnose, not the arming, and a later fault needs a longer run)
    cfg = dataclasses.replace(cfg, guard=dataclasses.replace(
        cfg.guard, attribution=AttributionConfig(rerun_budget=0.1),
        detector=sg.DetectorConfig(grad_z=1.0, grad_arm_after=20, arm_quiet=2)))
    train(cfg, echo=False)
    lines = [json.loads(x) for x in (tmp_path / "quarantine.jsonl").read_text().splitlines()]
    assert [(q["stream_index"], q["rank"], q["row"]) for q in lines if q["step"] == 45] == \
        [(45, 0, 3)]
    rec = {r["step"]: r for r in read_metrics(tmp_path / "metrics.jsonl")}[45]
    assert rec["action"] == "skip" and rec["cause"] == "data"
    assert main(["diagnose", str(tmp_path / "metrics.jsonl")]) == 0
    text = capsys.readouterr().out
    spike = text[text.index("skip the update at step 45"):]
    assert spike.splitlines()[1].strip().startswith(
        "quarantined: step 45, stream_index 45, rank 0, row 3,")


def test_the_overhead_benchmark_smoke_prints_finite_shares(capsys):
    import benchmarks.bench_attribution as bench

    got = bench.main(["--smoke"])
    assert all(math.isfinite(v) for v in got.values()) and got["reduce_share"] > 0
    assert "attribution inside guard.step / median step:" in capsys.readouterr().out

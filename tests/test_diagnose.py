"""spikeguard diagnose on logs built from the worked scenarios (the real streams, written by the
JSONL sink), its spike search and evidence against brute-force references, what-if, the CLI."""

import json
import math
import statistics
import subprocess
import sys

import numpy as np
import pytest

import spikeguard as sg
from spikeguard.checkpoint.manager import rollback_target
from spikeguard.cli import main
from spikeguard.detector.detector import DetectorConfig
from spikeguard.diagnose import FindConfig, MetricsLog, find_spikes, rollback_step
from spikeguard.diagnose.evidence import first_move
from spikeguard.diagnose.spikes import block_median, prior_min
from spikeguard.record import metrics_record
from spikeguard.testing import scenarios as sc


def write_log(path, metrics):
    sink = sg.JsonlSink(path, mode="w", defer=False)
    for m in metrics:
        sink.log(metrics_record(m), m.step)
    sink.close()
    return path


def cli_json(capsys, *argv):
    assert main(["diagnose", *map(str, argv), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def scenario_logs(tmp_path_factory):
    d = tmp_path_factory.mktemp("scenarios")
    nan = sc.data_anomaly(1).metrics
    nan[3000].loss, nan[3000].nan_frac = math.nan, 1e-4  # step 40,000: a NaN step
    return {"s1": write_log(d / "s1" / "metrics.jsonl", sc.data_anomaly(0).metrics),
            "s2": write_log(d / "s2" / "metrics.jsonl", sc.logit_drift(0).metrics),
            "nan": write_log(d / "nan" / "metrics.jsonl", nan)}


# ---- the must-show cases: tiers 1, 2, 3 --------------------------------------------------------

def test_scenario1_data_anomaly_is_tier1_skip(scenario_logs, capsys):
    out = cli_json(capsys, scenario_logs["s1"], "--ckpt-every", 1000)
    (s,) = out["spikes"]
    assert (s["start"], s["tier"], s["action"], s["rollback_step"]) == (42_100, 1, "skip", None)
    assert s["skipped"] == [42_100] and s["reasons"][0].startswith("grad_norm")
    ev = s["evidence"]
    # loss and grad norm leave their bands at the same step: a tie, reported as one
    assert ev["moved_first"] == ["loss", "grad_norm"] and ev["moved_at"] == 42_100
    assert ev["exits"]["log_z"] is None
    # the seed: recovering 2.89 -> 2.44 over 400 steps; back within 0.1 nats of 2.41 after
    # (2.58 - 2.51) / (2.58 - 2.44) x 133 + 267 = 333 steps of the interpolated stream
    assert 300 <= ev["recovery_steps"] <= 380 and ev["recovered"] is True
    assert ev["grad_ratio"] > 3 and ev["grad_median"] == pytest.approx(1.1, rel=0.03)
    assert abs(ev["log_z_trend_per_1k"]) < 0.05 and ev["nan"] is False
    assert s["end"] - s["start"] == pytest.approx(333, abs=40)
    assert out["whatif"]["skip"] == [42_100] and not out["whatif"]["rollback"]


def test_scenario2_logit_drift_is_tier2_rollback_to_57000(scenario_logs, capsys):
    out = cli_json(capsys, scenario_logs["s2"], "--ckpt-every", 1000)
    (s,) = out["spikes"]
    assert (s["tier"], s["action"], s["rollback_step"]) == (2, "rollback", 57_000)
    assert s["reasons"][0].startswith("log_z") and s["detected"] <= 59_000
    ev = s["evidence"]
    assert ev["moved_first"] == ["log_z"]
    # log Z leaves 8.1 +- 3 MAD (about 0.1) within tens of steps of 57,000 (+0.003 per step)
    assert 57_000 <= ev["exits"]["log_z"] <= 57_100
    assert ev["exits"]["log_z"] < ev["exits"]["grad_norm"] < ev["exits"]["loss"]
    assert 58_000 <= ev["exits"]["grad_norm"] and 58_200 <= ev["exits"]["loss"] <= 58_300
    assert ev["log_z_rise"] == pytest.approx(15.2 - 8.1, abs=0.3)
    assert ev["recovered"] is False
    assert any("z-loss 0.0001" in a for a in s["advice"])
    assert any("checkpoint at step 57,000" in a for a in s["advice"])
    assert {r["to"] for r in out["whatif"]["rollback"]} == {57_000}
    # without --ckpt-every: the newest safe step, onset - 2
    out = cli_json(capsys, scenario_logs["s2"])
    assert out["spikes"][0]["rollback_step"] == out["spikes"][0]["start"] - 2


def test_nan_step_is_tier3_halt(scenario_logs, capsys):
    out = cli_json(capsys, scenario_logs["nan"], "--ckpt-every", 1000)
    tiers = {s["start"]: s for s in out["spikes"]}
    s = tiers[40_000]
    assert (s["tier"], s["action"], s["rollback_step"]) == (3, "halt", 39_000)
    assert s["evidence"]["nan"] and s["evidence"]["first_nonfinite_step"] == 40_000
    # a log without a config.json does not say its precision: no fp16 advice on a guess
    assert not any("bf16" in a or "fp16" in a for a in s["advice"])
    assert any("does not say the precision" in a for a in s["advice"])
    assert out["precision"]["precision"] is None
    assert tiers[42_100]["tier"] == 1
    assert out["whatif"]["halt"] == [40_000]
    assert any("NaN or inf at 1 step(s) (first: step 40000)" in w for w in out["warnings"])


def test_clean_run_has_nothing_above_tier1(tmp_path, capsys):
    scen = sc.clean_run(0, steps=8000)
    out = cli_json(capsys, write_log(tmp_path / "m.jsonl", scen.metrics))
    assert all(s["tier"] <= 1 for s in out["spikes"])
    skips = [s for s in out["spikes"] if s["tier"] == 1]
    assert all(s["action"] == "skip" and s["evidence"]["grad_ratio"] > 3 for s in skips)


# ---- rollback rule ------------------------------------------------------------------------------

def test_rollback_step_is_the_guards_rule():
    def brute(onset, every):  # saves at every, 2 every, ...: the newest s with s <= onset - 2
        ok = [s for s in range(every, onset + 1, every) if s + 1 < onset]
        return ok[-1] if ok else None

    for onset in (0, 1, 2, 3, 999, 1000, 1001, 1002, 57_001, 57_002, 57_184, 58_001, 58_002):
        for every in (1, 7, 50, 1000):
            assert rollback_step(onset, every) == brute(onset, every), (onset, every)
            assert rollback_step(onset, every) == rollback_target(onset, every)
    assert rollback_step(57_184, 1000) == 57_000 and rollback_step(57_001, 1000) == 56_000
    assert rollback_step(500, None) == 498 and rollback_step(1, None) is None
    with pytest.raises(ValueError, match="--ckpt-every=0 must be an integer >= 1"):
        rollback_step(500, 0)


# ---- the search and the evidence against brute force -------------------------------------------

def test_window_helpers_match_brute_force():
    rng = np.random.default_rng(3)
    x = rng.standard_normal(2_345)
    for w in (1, 7, 100, 1000):
        got = prior_min(x, w)
        want = [math.inf] + [min(x[max(0, t - w):t]) for t in range(1, len(x))]
        assert got.tolist() == want, w
    med = block_median(np.abs(x), 1000)  # median of 10 block medians of 100 before each block
    for t in (150, 999, 1500, 2344):
        k = t // 100
        blocks = [statistics.median(np.abs(x[b * 100:(b + 1) * 100])) for b in range(max(0, k - 10), k)]
        assert med[t] == pytest.approx(statistics.median(blocks), abs=1e-12)


def mlog(loss, grad=None, log_z=None):
    n = len(loss)
    cols = {"loss": np.asarray(loss, dtype=float),
            "grad_norm": np.ones(n) if grad is None else np.asarray(grad, dtype=float)}
    if log_z is not None:
        cols["log_z"] = np.asarray(log_z, dtype=float)
    return MetricsLog("mem", "jsonl", np.arange(n, dtype=np.int64), cols)


@pytest.mark.parametrize("rise, length, found", [
    (0.15, 60, True),    # +0.15 nats for 60 steps: a spike
    (0.15, 40, False),   # not for more than 50 steps
    (0.08, 400, False),  # below 0.1 nats
    (0.50, 2500, True),  # longer than the band: followed at its frozen level to the end
])
def test_persistent_spike_definition(rise, length, found):
    rng = np.random.default_rng(0)
    loss = 2.0 + 0.01 * rng.standard_normal(4000)
    loss[1200:1200 + length] += rise
    spikes = [f for f in find_spikes(mlog(loss)) if "persistent" in f.kinds]
    assert bool(spikes) == found
    if found:
        (f,) = spikes
        assert abs(f.i0 - 1200) <= 2 and abs(f.i1 - (1200 + length - 1)) <= 2
        assert f.pre_level == pytest.approx(2.0, abs=0.01)


def test_band_exit_matches_a_brute_force_scan():
    rng = np.random.default_rng(5)
    x = 5.0 + 0.05 * rng.standard_normal(3000)
    x[2000:] += 0.004 * np.arange(1000)  # a drift from index 2000
    med = statistics.median(x[:1000].tolist())
    mad = statistics.median([abs(v - med) for v in x[:1000].tolist()])
    got = first_move(x, 2500, 2999, med, mad, 3.0)
    out = x > med + 3 * mad
    i = 2999  # brute force: walk back from the peak, bridging up to 3 in-band steps
    first = i
    while i > 0:
        j = i - 1
        gap = 0
        while j >= 0 and not out[j] and gap <= 3:
            j, gap = j - 1, gap + 1
        if j < 0 or gap > 3:
            break
        first, i = j, j
    assert got == first and 2000 <= got <= 2060
    assert first_move(5.0 + 0.05 * rng.standard_normal(500), 0, 499, med, mad, 3.0) is None


# ---- what-if and the generated flags -------------------------------------------------------------

def test_whatif_flags_and_compare_replay_other_thresholds(scenario_logs, capsys):
    # the scenario's grad norm is ~9x its median: with grad_k 12 nothing is skipped
    out = cli_json(capsys, scenario_logs["s1"], "--grad-k", 12, "--compare", "grad_k=3,arm_after=10")
    assert out["detector"]["grad_k"] == 12.0 and out["whatif"]["skip"] == []
    assert out["spikes"] == []  # Tier 0 is listed apart
    (s,) = out["below"]
    assert s["tier"] == 0 and s["action"] == "continue" and "persistent" in s["kinds"]
    assert out["compare"]["changes"] == {"grad_k": 3.0, "arm_after": 10}
    assert out["compare"]["skip"] == [42_100]


def test_detector_flags_are_generated_from_the_config(capsys):
    with pytest.raises(SystemExit):
        main(["diagnose", "--help"])
    text = capsys.readouterr().out
    for f in DetectorConfig.__dataclass_fields__:
        assert "--" + f.replace("_", "-") in text, f
    for f in FindConfig.__dataclass_fields__:
        assert "--" + f.replace("_", "-") in text, f


@pytest.mark.parametrize("argv, message", [
    (["--grad-k", "0.5"], "--grad-k=0.5 must be > 1"),
    (["--compare", "grad_k"], "write FIELD=VALUE pairs of DetectorConfig"),
    (["--compare", "gradk=3"], "'gradk=3'"),
    (["--compare", "median_window=1.5"], "median_window takes an integer"),
    (["--compare", "skip_ratio=9"], "ratios must rise"),
    (["--ckpt-every", "0"], "--ckpt-every=0 must be an integer >= 1"),
    (["--persist-steps", "0"], "--persist-steps=0 must be an integer >= 1"),
    (["--map", "x"], "write COLUMN=METRIC"),
])
def test_bad_options_name_the_flag(scenario_logs, capsys, argv, message):
    assert main(["diagnose", str(scenario_logs["s1"]), *argv]) == 2
    assert message in capsys.readouterr().err


# ---- quarantine and the terminal summary -------------------------------------------------------

def test_quarantined_sequences_show_with_their_spike(scenario_logs, tmp_path, capsys):
    log = write_log(tmp_path / "run" / "metrics.jsonl", sc.data_anomaly(0).metrics)
    (tmp_path / "run" / "quarantine.jsonl").write_text(
        '{"step": 42100, "stream_index": 336803, "rank": 1, "row": 5, "loss": 11.2, '
        '"log_z": 9.1, "z": 14.2}\n'
        '{"step": 42100, "stream_index": 336810, "rank": 1, "row": 12, "loss": 9.8, '
        '"log_z": 8.9, "z": 7.5}\n'
        '{"step": 38000, "stream_index": 10, "rank": 0, "row": 0, "loss": 3.0, "z": 5.2}\n')
    out = cli_json(capsys, log)
    (s,) = out["spikes"]
    assert [q["row"] for q in s["quarantine"]] == [5, 12]
    assert [q["step"] for q in out["quarantine_unmatched"]] == [38_000]
    assert main(["diagnose", str(log)]) == 0
    text = capsys.readouterr().out
    assert "quarantined: step 42100, stream_index 336803, rank 1, row 5" in text
    assert "1 quarantined sequence(s) outside any spike" in text


def test_summary_in_a_fresh_process_imports_no_plot_extras(scenario_logs, sub_env):
    # the command end to end, and what it imports: no matplotlib, tensorboard or playwright
    # unless a report or a TensorBoard log asks for them
    code = ("import sys; from spikeguard.cli import main; "
            f"rc = main(['diagnose', {str(scenario_logs['s2'])!r}, '--ckpt-every', '1000']); "
            "print('extras', sorted(m for m in ('matplotlib', 'tensorboard', 'playwright') "
            "if m in sys.modules)); sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, env=sub_env)
    assert r.returncode == 0, r.stderr
    assert "1 spike(s)" in r.stdout and "57,000" in r.stdout and "logit drift" in r.stdout
    assert "what the detector would do" in r.stdout and "time: read" in r.stdout
    assert "extras []" in r.stdout


def test_sparse_log_every_10_steps(tmp_path, capsys):
    ms = [m for m in sc.data_anomaly(0).metrics if m.step % 10 == 0]
    out = cli_json(capsys, write_log(tmp_path / "m.jsonl", ms))
    assert out["stride"] == 10 and out["detector"]["median_window"] == 150
    (s,) = out["spikes"]
    assert (s["start"], s["tier"], s["skipped"]) == (42_100, 1, [42_100])


def test_replay_builds_the_same_step_metrics_by_position_and_by_name():
    from spikeguard.diagnose.classify import _by_name, _step_metrics

    values = (7, 2.5, 1.25, 8.0, 0.0, None, None, 1024.0)
    assert _step_metrics()(*values) == _by_name(*values) == sg.StepMetrics(
        step=7, loss=2.5, grad_norm=1.25, log_z=8.0, nan_frac=0.0, grad_scale=1024.0)


def test_fp16_overflow_in_a_log_with_grad_scale_is_no_halt(tmp_path, capsys):
    rows = ["step,loss,grad_norm,grad_scale"]
    rows += [f"{i},{2.5 + 0.001 * (i % 7)},{1.0 + 0.01 * (i % 5)},65536" for i in range(300)]
    rows[201] = "200,2.5,inf,65536"  # GradScaler overflow: the scaler skips, halves the scale
    path = tmp_path / "fp16.csv"
    path.write_text("\n".join(rows) + "\n")
    out = cli_json(capsys, path)
    assert out["whatif"]["halt"] == [] and out["whatif"]["scaler_skips"] == 1
    assert out["spikes"] == []
    (s,) = out["below"]
    assert s["tier"] == 0 and s["start"] == 200 and "GradScaler" in s["cause"]


def test_skip_storm_is_tier2_with_the_checkpoint_before_the_storm(tmp_path, capsys):
    scen = sc.grad_storm(0)  # grad norm x4 for good from step 300
    out = cli_json(capsys, write_log(tmp_path / "m.jsonl", scen.metrics), "--ckpt-every", 50)
    (s,) = out["spikes"]
    assert (s["start"], s["tier"], s["action"]) == (300, 2, "rollback")
    assert s["rollback_step"] == 250  # the checkpoint at 300 holds update 300, in the storm
    assert s["cause"].startswith("skip storm") and s["evidence"]["moved_first"] == ["grad_norm"]
    assert out["spikes"][0]["detected"] < 310


def test_a_spikeguard_train_log_is_classified_as_its_injected_faults(tmp_path, capsys, sub_env):
    # a real run of the tiny model: an outlier batch at 60 (skipped), a NaN gradient at 100 (halt)
    r = subprocess.run([sys.executable, "-m", "spikeguard", "train", "--model", "tiny",
                        "--batch-size", "8", "--eval-batches", "1", "--no-progress", "--no-plot",
                        "--lr", "1e-3", "--steps", "120", "--ckpt-every", "20", "--inject",
                        "outlier@60:repeat", "--inject", "nan@100", "--out", str(tmp_path)],
                       env=sub_env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 3, r.stdout + r.stderr  # the halt
    out = cli_json(capsys, tmp_path / "metrics.jsonl", "--ckpt-every", 20)
    spikes = {s["start"]: s for s in out["spikes"]}
    assert (spikes[60]["tier"], spikes[60]["action"]) == (1, "skip")
    # halted at 100: the newest checkpoint that predates update 99 is the one at 80
    assert (spikes[100]["tier"], spikes[100]["action"], spikes[100]["rollback_step"]) == (
        3, "halt", 80)
    assert out["whatif"]["skip"] == [60] and out["whatif"]["halt"] == [100]
    assert all(s["tier"] <= 1 for start, s in spikes.items() if start not in (60, 100))

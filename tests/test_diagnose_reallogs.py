"""diagnose on real public training logs (tests/data/reallogs, SOURCES.md there), against the
labels a person wrote from plots of the raw files before diagnose ever ran on them
(labels.json), and on spikeguard's own runs (tests/data/sgruns)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from spikeguard.diagnose import diagnose, print_summary
from tests.reallog_judge import LABELS, REAL, judge

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def diagnosed():
    return {name: diagnose(REAL / name) for name in LABELS}


def test_the_set_is_what_the_issue_asks_for():
    assert len(LABELS) >= 25
    assert len({lab["format"] for lab in LABELS.values()}) >= 6
    assert sum(bool(lab["spikes"]) for lab in LABELS.values()) >= 8  # a real event each
    assert sum(lab.get("precision") == "fp16" for lab in LABELS.values()) >= 5
    assert sum(lab["healthy"] for lab in LABELS.values()) >= 4
    intervals = {lab["interval"] for lab in LABELS.values()}
    assert min(intervals) == 1 and max(intervals) >= 50
    sources = (REAL / "SOURCES.md").read_text()
    for name in LABELS:
        assert f"`{name}`" in sources, name
    assert sum(p.stat().st_size for p in REAL.iterdir()) < 2_000_000


@pytest.mark.parametrize("name", sorted(LABELS))
def test_real_log_matches_its_labels(diagnosed, name):
    ok, why = judge(name, diagnosed[name])
    assert ok, why


@pytest.mark.parametrize("name", sorted(LABELS))
def test_evidence_and_cause_agree(diagnosed, name):
    for s in diagnosed[name].spikes + diagnosed[name].below:
        ev = s.evidence
        if ev.get("recovered") is True:
            assert "not back" not in s.cause and "stayed up, " not in s.cause.split(",")[0]
        if ev.get("recovered") is False:
            assert "back within" not in s.cause
        if ev.get("loss_rose") is False:
            assert "bad batch" not in s.cause, "a loss that did not move is no bad batch"
        if ev.get("loss_rose"):
            assert ev["loss_peak"] > ev["pre_spike_loss"], "a peak below its own pre-spike level"
        if "loss " in s.cause and " -> " in s.cause and ev.get("pre_spike_loss"):
            # it cites the numbers it was built from, and says how the level was derived
            assert f"{ev['pre_spike_loss']:.4g} (median before) -> {ev['loss_peak']:.4g}" \
                in s.cause
            assert ev["pre_spike_loss_from"].startswith("median of the")
        if ev.get("moved_at") is not None:  # "moved first" is what started it
            assert ev["moved_at"] <= s.start, (s.start, ev["moved_at"])


def test_sparse_healthy_log_says_what_it_cannot_see(diagnosed):
    d = diagnosed["lightning_slm_v0_metrics.csv"]
    text = " ".join(d.notes)
    assert "one record every 50 steps" in text and "cannot be told from noise" in text
    assert any("evaluation" in w for w in d.log.warnings)  # the validation rows left out
    assert d.whatif["rollback"] == [] and d.whatif["halt"] == []


def test_nan_divergence_and_blowup_are_tier3(diagnosed):
    (s,) = diagnosed["pasted_nanogpt_issue215.csv"].spikes
    assert s.tier == 3 and s.start == 3010 and "NaN/inf from step 3,010" in s.cause
    (s,) = diagnosed["pasted_pfnl_issue2.csv"].spikes
    assert s.tier == 3 and "blow-up" in s.cause and "1.508e+06" in s.cause
    assert "blowup" in s.kinds


def test_grad_only_outlier_is_not_called_a_bad_batch_of_the_loss(diagnosed):
    d = diagnosed["pasted_unsloth_issue5207.csv"]
    (s,) = d.spikes
    assert s.tier == 1 and s.end == 9 and s.evidence["loss_rose"] is False
    assert s.cause.startswith("a grad-norm outlier with an ordinary loss")
    assert s.evidence["grad_ratio"] > 1000  # from 3+ logged values before it, not empty
    # the ratio is the one the rule compared: against the detector's own running median
    assert s.evidence["grad_median_from"].startswith("the detector's running median at step 9")
    assert [(b.start, b.tier) for b in d.below] == [(4, 0)]
    assert d.below[0].cause.startswith("before the detector was armed")


# ---- spikeguard's own runs -------------------------------------------------------------------

def test_spikeguard_run_with_a_rollback(tmp_path):
    d = diagnose(DATA / "sgruns" / "rollback")
    assert d.ckpt_every == 25 and d.log.run_config["precision"] == "fp32"
    assert d.log.replays == [{"steps": [126, 156], "records": 31, "rollback_at": 156, "to": 125}]
    assert d.log.steps.tolist() == list(range(200))  # the first attempt, where the spike is
    (s,) = d.spikes
    assert (s.start, s.end, s.tier, s.action, s.rollback_step) == (151, 156, 2, "rollback", 125)
    assert s.skipped == [151, 152, 153, 154, 155]
    rec = d.recorded
    assert rec["skip"] == [151, 152, 153, 154, 155] and rec["drop"] == [] and rec["halt"] == []
    assert [(r["step"], r["to"], r["skip_range"]) for r in rec["rollback"]] == [(156, 125,
                                                                                [151, 156])]
    from rich.console import Console

    con = Console(record=True, width=200)
    print_summary(d, con)
    text = con.export_text()
    for want in ("151", "156", "rollback", "156 -> 125", "5: 151, 152, 153, 154, 155",
                 "replayed after a rollback", "steps 126-156", "checkpoints every 25 steps"):
        assert want in text, want
    from spikeguard.diagnose import write_report

    md = write_report(d, tmp_path / "report.md").read_text()
    for want in ("| 1 | 151 | 156 | 2 | rollback | 125 |", "5: 151, 152, 153, 154, 155",
                 "1: 156 -> 125", "skip the data of steps 151-156", "steps 126-156"):
        assert want in md, want


def test_spikeguard_run_that_halted_on_nan():
    d = diagnose(DATA / "sgruns" / "nan")
    (s,) = d.spikes  # no phantom Tier 1 beside it
    assert s.tier == 3 and s.start == 70 and s.action == "halt"
    assert any("the run is fp32, so not an fp16 overflow" in a for a in s.advice)
    assert not any("fp16 -> bf16" in a for a in s.advice)
    assert d.recorded["halt"] == [70]


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _write(path, recs):
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


@pytest.mark.parametrize("style", ["drop", "skip-not-skipped"])
def test_a_dropped_step_is_a_drop_not_a_skip(tmp_path, style):
    recs = _records(DATA / "sgruns" / "nan" / "metrics.jsonl")[:60]
    r = recs[40]
    r.update(action="drop" if style == "drop" else "skip", tier=1, skipped=False, kept_rows=15,
             reasons=["loss_ema_ratio > 2", "rerun: data"])
    d = diagnose(_write(tmp_path / "metrics.jsonl", recs))
    assert d.recorded["drop"] == [{"step": 40, "kept_rows": 15}] and d.recorded["skip"] == []


def test_guard_steps_restarting_at_zero_are_read_in_run_order(tmp_path):
    recs = _records(DATA / "sgruns" / "nan" / "metrics.jsonl")[:60]
    again = [{**r, "step": r["step"]} for r in recs[:30]]  # a resumed job counting from 0 again
    d = diagnose(_write(tmp_path / "metrics.jsonl", recs + again))
    assert d.log.steps.tolist() == list(range(90))
    assert any("start again at 0 after 59" in w and "renumbered +60" in w for w in d.log.warnings)


def test_a_blank_row_after_inf_is_no_second_halt(tmp_path):
    rows = ["step,loss,grad_norm"] + [f"{i},{2.5 + 0.01 * (i % 3)},{1 + 0.01 * (i % 4)}"
                                      for i in range(100)]
    rows[61] = "60,2.5,inf"
    rows[62] = "61,2.5,"  # no grad norm logged: not inf, and no evidence
    d = diagnose(_write_text(tmp_path / "run.csv", rows))
    assert d.whatif["halt"] == [60]
    (s,) = d.spikes
    assert s.tier == 3 and s.evidence["first_nonfinite_step"] == 60


def _write_text(path, rows):
    path.write_text("\n".join(rows) + "\n")
    return path


def test_rollback_rule_is_the_guards():
    from spikeguard.checkpoint import rollback_target as guards
    from spikeguard.diagnose._detector import rollback_target

    for onset in (2, 3, 57, 1001, 1002, 57_182, 57_001):
        for every in (1, 7, 25, 1000):
            assert rollback_target(onset, every) == guards(onset, every)
        assert rollback_target(onset, [100, 1000, 57_000]) == guards(onset, [100, 1000, 57_000])


def test_diagnose_on_a_csv_does_not_import_torch(tmp_path):
    path = REAL / "speedrun_soap.csv"
    code = ("import sys\nfrom spikeguard.cli import main\n"
            f"rc = main(['diagnose', {str(path)!r}, '--json'])\n"
            "assert rc == 0, rc\nassert 'torch' not in sys.modules, 'torch was imported'\n")
    src = str(Path(__file__).parents[1] / "src")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PYTHONPATH": src, "PATH": "/usr/bin:/bin"}, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout)["records"] == 6000


def test_a_gap_in_the_steps_is_reported(tmp_path):
    steps = [*range(0, 500, 10), *range(2000, 2500, 10)]
    rows = ["step,loss"] + [f"{s},{3.0 + 0.01 * (s % 7)}" for s in steps]
    d = diagnose(_write_text(tmp_path / "gap.csv", rows))
    assert d.log.stride == 10
    assert any("1 gap(s) in the steps (first: 490 -> 2000)" in w for w in d.log.warnings)
    assert d.spikes == []


def test_evaluation_rows_of_a_trainer_state_are_left_out(diagnosed):
    d = diagnosed["hf_tinyllama_trainer_state.json"]
    state = json.loads((REAL / "hf_tinyllama_trainer_state.json").read_text())
    train = [e for e in state["log_history"] if "loss" in e]
    assert len(d.log) == len(train)
    assert d.log.columns["loss"].tolist() == [e["loss"] for e in train]


def test_an_alert_only_run_is_told_apart_from_the_replay(tmp_path):
    recs = _records(DATA / "sgruns" / "rollback" / "metrics.jsonl")
    for r in recs:  # the same run with the guard set to alert: nothing skipped, nothing rolled back
        if r.get("action") not in (None, "continue"):
            r.update(action="alert", skipped=False, rollback_to=None, skip_range=None)
    first = {}
    for r in recs:  # the alert-only run never rolled back: one record per step
        first.setdefault(r["step"], r)
    _write(tmp_path / "metrics.jsonl", list(first.values()))
    d = diagnose(tmp_path / "metrics.jsonl")
    assert d.recorded["skip"] == [] and d.recorded["rollback"] == [] and d.recorded["alerts"] > 0
    (note,) = [n for n in d.notes if "differs from the run's own record" in n]
    assert "where the run skipped nothing" in note and "alert(s) recorded" in note

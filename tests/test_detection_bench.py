"""benchmarks/detection.py's smoke matrix through the real runner (spikeguard.train, three
arms), its resumable results file and the table it prints."""

import io
import json

import pytest
from benchmarks import detection as bench

from spikeguard.testing.detection import HARM_RATIO, format_table, score, summarize_run


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    results = tmp_path_factory.mktemp("detection") / "results.jsonl"
    log = io.StringIO()
    lines = bench.run_jobs(bench.matrix("smoke"), results, workers=1, log=log)
    return results, lines, log.getvalue()


def test_the_smoke_cells_run_every_arm_and_the_table_lists_them(smoke):
    _, lines, log = smoke
    assert len(lines) == 6 and not any("error" in d for d in lines)
    assert {(d["cell"], d["arm"]) for d in lines} == {
        (f"clean/tiny/lr{lr:g}/T20", arm) for lr in (1e-3, 3e-3) for arm in bench.ARMS}
    assert log.count("\n[") + log.startswith("[") == 6  # one progress line per run
    table = format_table(score(lines))
    for lr in ("0.001", "0.003"):
        for arm in bench.ARMS:
            assert f"| clean/tiny/lr{lr}/T20 | {arm} | 1 |" in table
    for d in lines:
        assert d["records"] >= 20 and 0 < d["armed_steps"] <= d["records"]
        assert d["run_precision"] == "fp32" and d["wall_s"] > 0


def test_the_scoring_of_the_smoke_runs_matches_the_pairs(smoke):
    _, lines, _ = smoke
    by = {(d["cell"], d["arm"]): d for d in lines}
    cells = {(c.cell, c.arm): c for c in score(lines)}
    identical = 0
    for (cell, arm), d in by.items():
        base = by[(cell, "unguarded")]
        c = cells[(cell, arm)]
        if arm == "unguarded":  # paired with itself: never judged, ratio exactly 1
            assert c.targets == {} and c.final_over_clean == [1.0]
            continue
        harmed = (d["halted"] or d["rollbacks"] > 0
                  or d["val_loss"] > HARM_RATIO * base["val_loss"])
        assert c.harmed == int(harmed)
        assert c.false_skips == d["armed_skips"] <= len(d["skip_steps"])
        assert c.armed_steps == d["armed_steps"]
        if not d["skip_steps"] and not d["halted"] and not d["rollbacks"]:
            # nothing withheld: the same updates, so bit-identical held-out loss
            assert d["val_loss"] == base["val_loss"]
            identical += 1
    assert identical >= 1  # the lr 1e-3 cell never skips


def test_a_rerun_skips_finished_runs_and_cuts_a_torn_last_line(smoke, tmp_path):
    results, lines, _ = smoke
    path = tmp_path / "r.jsonl"
    path.write_bytes(results.read_bytes() + b'{"cell": "clean/tiny/lr0.001/T20", "ar')
    log = io.StringIO()
    again = bench.run_jobs(bench.matrix("smoke"), path, workers=1, log=log)
    assert "6 already in" in log.getvalue() and "0 to run" in log.getvalue()
    assert path.read_bytes() == results.read_bytes()  # the torn tail is cut, nothing added
    assert [json.dumps(d, sort_keys=True) for d in again] == [
        json.dumps(d, sort_keys=True) for d in lines]


def test_the_matrix_has_the_issue_s_cells():
    everything = bench.matrix("all")
    clean = {d["cell"] for d in everything if d["kind"] == "clean"}
    faults = {d["cell"] for d in everything if d["kind"] == "fault"}
    assert len(clean) == 4 * 5 + 2 * 4 and len(faults) == 2 * 9
    runs = {d["cell"]: set() for d in everything}
    for d in everything:
        runs[d["cell"]].add(d["seed"])
    assert {len(s) for c, s in runs.items() if c.startswith("clean/tiny")} == {10}
    assert {len(s) for c, s in runs.items() if c.startswith("fault/demo")} == {3}
    # and the gap references: one clean unguarded run per seed without the outlier's and the
    # storm's batches, on the same seeds as their faulted cells
    gaps = [d for d in everything if d["kind"] == "gap"]
    assert {(d["cell"], d["fault_spec"]) for d in gaps} == {
        (f"gap/{m}/{f}", spec) for m in ("tiny", "demo")
        for f, spec in (("outlier", "gap@150:1"), ("storm", "gap@150:5"))}
    assert {d["arm"] for d in gaps} == {"unguarded"} and len(gaps) == 2 * (5 + 3)
    assert len(everything) == 3 * (4 * 5 * 10 + 2 * 4 * 5 + 9 * 5 + 9 * 3) + len(gaps)
    assert everything[0]["cell"] == "clean/tiny/lr0.003/T20"  # the first priority first
    fp16 = [d for d in everything if d.get("fault") == "fp16-overflow"]
    assert {d["precision"] for d in fp16} == {"fp16-mixed"}


def test_compare_puts_each_cell_beside_itself_in_another_file(smoke):
    _, lines, _ = smoke
    halted = [dict(d, halted=True, val_loss=None) if d["arm"] == "alert" else d for d in lines]
    table = bench.compare(halted, lines)
    assert table.count("\n| clean/tiny/") == 4  # two cells x two guarded arms
    assert "| clean/tiny/lr0.001/T20 | alert | 1/1 -> 0/1 | 1 -> 0 |" in table
    assert "NOT met -> met" in table


def test_a_bound_job_has_its_own_cell_and_the_plain_clean_reference():
    job = next(j for j in bench.matrix("faults") if j["cell"] == "fault/tiny/lr")
    bound = bench.with_bound(job, 3.0)
    assert bound["cell"] == "fault/tiny+bound3/lr" and bound["update_bound"] == 3.0
    assert bound["clean_ref"] == job["clean_ref"] == "clean/tiny/lr0.003/T300"
    assert "update_bound" not in job  # the matrix's own job is left as it was
    records = [{"step": t, "action": "continue", "tier": 0, "armed": True, "skipped": False}
               for t in range(4)]

    def line(j, arm, val, **over):
        s = summarize_run(records, val_loss=val, fault_step=j.get("fault_step"))
        return {**j, **s, "arm": arm, "seed": 0, **over}

    lines = [line(bound, "alert", 2.2), line(bound, "unguarded", 2.2),
             line(job, "unguarded", 2.0, cell=job["clean_ref"], kind="clean")]
    cells = {(c.cell, c.arm): c for c in score(lines)}
    assert cells[("fault/tiny+bound3/lr", "alert")].final_over_clean == [pytest.approx(1.1)]

"""spikeguard.testing.detection on hand-built records: harm, false skips, caught faults, targets.

The records are built the way metrics.jsonl holds them (step, action, tier, armed, skipped,
summary, halt); each expected number is counted by hand from the list."""

import math
import subprocess
import sys
from pathlib import Path

import pytest

from spikeguard.testing import detection
from spikeguard.testing.detection import (
    HARM_RATIO,
    format_table,
    overall,
    score,
    summarize_run,
)


def _rec(step, *, action="continue", tier=0, armed=True, skipped=None, **extra):
    r = {"step": step, "action": action, "tier": tier, "armed": armed,
         "skipped": action in ("skip", "rollback", "halt") if skipped is None else skipped}
    r.update(extra)
    return r


def _clean(n, *, armed_from=5, skips=(), halt_at=None, rollback_at=None):
    out = []
    for t in range(n):
        if t == halt_at:
            out.append(_rec(t, action="halt", tier=3, halt={"nonfinite_params": [],
                                                            "first_forward": None}))
            break
        action = ("skip" if t in skips else "rollback" if t == rollback_at else "continue")
        out.append(_rec(t, action=action, tier=1 if action == "skip" else 0,
                        armed=t >= armed_from))
    return out


def _line(cell, arm, seed, records, val, *, kind="clean", clean_ref=None, **fault):
    s = summarize_run(records, val_loss=val, fault_step=fault.get("fault_step"))
    s.update(cell=cell, arm=arm, seed=seed, kind=kind, clean_ref=clean_ref or cell, **fault)
    return s


def _cell(cells, cell, arm):
    return next(c for c in cells if c.cell == cell and c.arm == arm)


def test_summary_counts_armed_steps_and_skips_but_not_the_halt():
    recs = [*_clean(40, armed_from=10, skips=(3, 12, 20)),
            _rec(40, action="halt", tier=3, halt={"nonfinite_params": ["wte.weight"],
                                                 "first_forward": "wte", "first_backward": None})]
    s = summarize_run(recs, val_loss=float("nan"))
    assert s["records"] == 41
    assert s["armed_steps"] == 31  # steps 10..40
    assert s["armed_skips"] == 2   # 12 and 20; 3 is unarmed, the halt is not a skip
    assert s["skip_steps"] == [3, 12, 20]
    assert s["halted"] and s["halt"]["step"] == 40
    assert s["halt"]["named"] == ["wte.weight", "wte"]
    assert s["val_loss"] is None  # NaN becomes None (JSON has no NaN)


def test_a_drop_counts_as_a_skip_and_its_cause_is_kept():
    recs = _clean(30)
    recs[20] = _rec(20, action="drop", tier=1, skipped=False, cause="data")
    recs[25] = _rec(25, action="skip", tier=1, cause="weights")
    s = summarize_run(recs, val_loss=2.0)
    assert s["armed_skips"] == 2 and s["skip_steps"] == [20, 25]
    assert s["causes"] == {"data": 1, "weights": 1}


def test_an_fp16_overflow_is_not_a_false_skip_but_still_catches_an_injected_one():
    """GradScaler skips an overflowing step with or without the guard (the guard's record says
    "scaler"); a clean run's false skips are the guard's own choices only."""
    recs = _clean(30)
    recs[12] = _rec(12, action="skip", tier=0, reasons=["scaler"])
    recs[20] = _rec(20, action="skip", tier=1, reasons=["grad_norm > 3x median"])
    s = summarize_run(recs, val_loss=2.0, fault_step=12)
    assert s["armed_skips"] == 1 and s["scaler_skips"] == 1
    assert s["skip_steps"] == [12, 20]
    base = _line("clean/fp16", "unguarded", 0, _clean(30), 2.0)
    cells = score([_line("clean/fp16", "alert", 0, recs, 2.0), base])
    assert _cell(cells, "clean/fp16", "alert").false_skips == 1
    fault = _line("fault/fp16-overflow", "alert", 0, recs, 2.0, kind="fault",
                  clean_ref="clean/fp16", fault="fp16-overflow", fault_step=12)
    cells = score([fault, _line("fault/fp16-overflow", "unguarded", 0, _clean(30), 2.0,
                                kind="fault", clean_ref="clean/fp16", fault="fp16-overflow",
                                fault_step=12), base])
    assert _cell(cells, "fault/fp16-overflow", "alert").caught == 1


@pytest.mark.parametrize("ratio, harmed", [(1.006, True), (1.004, False), (1.0, False),
                                           (0.9, False)])
def test_a_clean_run_is_harmed_above_1_005x_the_unguarded_loss(ratio, harmed):
    lines = [_line("c", "unguarded", 0, _clean(100), 2.0),
             _line("c", "alert", 0, _clean(100), 2.0 * ratio)]
    c = _cell(score(lines), "c", "alert")
    assert c.harmed == int(harmed)
    assert c.targets["none harmed"] is (not harmed)
    assert c.over_unguarded == [pytest.approx(ratio)]
    assert HARM_RATIO == 1.005


def test_a_halt_or_a_rollback_harms_a_clean_run_whatever_the_loss():
    lines = [_line("c", "unguarded", s, _clean(100), 2.0) for s in (0, 1)]
    lines += [_line("c", "alert", 0, _clean(100, halt_at=50), None),
              _line("c", "rollback", 1, _clean(100, rollback_at=60), 1.9)]
    cells = score(lines)
    a, r = _cell(cells, "c", "alert"), _cell(cells, "c", "rollback")
    assert (a.halts, a.harmed, a.targets["no halt"]) == (1, 1, False)
    assert (r.rollbacks, r.harmed, r.targets["no rollback"]) == (1, 1, False)
    assert r.over_unguarded == [pytest.approx(0.95)]  # better loss, still harmed
    assert a.met is False and r.met is False


def test_false_skips_are_per_1000_armed_steps_over_the_seeds():
    # seed 0: 95 armed steps (5..99), 1 armed skip; seed 1: 150 armed, 0 skips; the unarmed
    # skip at step 2 does not count: 1 / 245 armed steps = 4.08 per 1,000
    lines = [_line("c", "unguarded", s, _clean(n), 2.0) for s, n in ((0, 100), (1, 155))]
    lines += [_line("c", "alert", 0, _clean(100, skips=(2, 50)), 2.0),
              _line("c", "alert", 1, _clean(155), 2.0)]
    c = _cell(score(lines), "c", "alert")
    assert (c.false_skips, c.armed_steps) == (1, 245)
    assert c.false_skips_per_1k == pytest.approx(1000 / 245)
    assert c.targets["false skips <= 1/1k"] is False
    assert c.harmed == 0  # a skip alone is not harm


def test_the_unguarded_arm_is_never_judged_and_pairs_with_itself():
    lines = [_line("c", "unguarded", 0, _clean(50, skips=(20,)), 2.0)]
    c = _cell(score(lines), "c", "unguarded")
    assert c.targets == {} and c.met is None
    assert c.final_over_clean == [1.0]
    assert overall(score(lines)) == (0, 0)


def test_an_unpaired_guarded_run_is_counted_not_judged_harmless_by_default():
    c = _cell(score([_line("c", "alert", 0, _clean(50), 2.0)]), "c", "alert")
    assert (c.harmed, c.unpaired, c.over_unguarded) == (0, 1, [])
    assert c.targets["none harmed"] is None and c.met is None


def _fault(fault, arm, seed, records, val, *, step=150, length=1):
    return _line(f"fault/tiny/{fault}", arm, seed, records, val, kind="fault",
                 clean_ref="clean/tiny/lr0.003/T300", fault=fault, fault_step=step,
                 fault_len=length)


def test_a_storm_is_caught_only_when_every_batch_of_it_was_skipped_and_final_is_judged():
    ref = [_line("clean/tiny/lr0.003/T300", "unguarded", s, _clean(300), 2.0) for s in (0, 1)]
    full = _clean(300, skips=range(150, 155))
    partial = _clean(300, skips=(150, 151, 153, 154))
    lines = ref + [_fault("storm", "unguarded", s, _clean(300), 2.01, length=5) for s in (0, 1)]
    lines += [_fault("storm", "alert", 0, full, 2.005, length=5),
              _fault("storm", "alert", 1, partial, 2.002, length=5)]
    c = _cell(score(lines), "fault/tiny/storm", "alert")
    assert c.caught == 1
    assert c.targets["skipped on every seed"] is False
    assert max(c.final_over_clean) == pytest.approx(1.0025)
    assert c.targets["final <= 1.002x clean"] is False  # 2.005 / 2.0
    assert c.targets["not worse than unguarded"] is True
    assert "final <= 1.002x kept data" not in c.targets  # no gap reference was run


def test_a_storm_is_also_judged_against_the_clean_run_without_its_batches():
    """The gap run (the same seed, clean, the storm's batches never yielded) is the reference a
    perfect skip equals; its own final/clean is what losing the batches costs."""
    ref = [_line("clean/tiny/lr0.003/T300", "unguarded", s, _clean(300), 2.0) for s in (0, 1)]
    gap = [_line("gap/tiny/storm", "unguarded", 0, _clean(300), 2.006, kind="gap",
                 clean_ref="clean/tiny/lr0.003/T300", fault="storm", fault_step=150,
                 fault_len=5)]
    full = _clean(300, skips=range(150, 155))
    lines = ref + gap + [_fault("storm", "unguarded", s, _clean(300), 2.01, length=5)
                         for s in (0, 1)]
    lines += [_fault("storm", "alert", 0, full, 2.006, length=5)]
    cells = score(lines)
    c = _cell(cells, "fault/tiny/storm", "alert")
    assert c.final_over_kept == [1.0] and c.final_over_clean == [pytest.approx(1.003)]
    # judged against the run on the same data less the bad batches, both ratios in the table
    assert "final <= 1.002x clean" not in c.targets
    assert c.targets["final <= 1.002x kept data"] is True
    g = _cell(cells, "gap/tiny/storm", "unguarded")
    assert g.final_over_clean == [pytest.approx(1.003)] and not g.targets
    row = next(r for r in format_table(cells).splitlines()
               if r.startswith("| fault/tiny/storm | alert"))
    assert "| 1.0030 | 1.0000 |" in row
    # a second seed without its gap run: that target waits rather than passing
    lines += [_fault("storm", "alert", 1, full, 2.002, length=5)]
    assert _cell(score(lines), "fault/tiny/storm", "alert").targets[
        "final <= 1.002x kept data"] is None


def test_a_nan_fault_is_caught_by_a_halt_at_its_step_naming_a_tensor():
    named = {"nonfinite_params": ["blocks.0.mlp.fc.weight"], "first_forward": None}
    at = [*_clean(150), _rec(150, action="halt", tier=3, halt=named)]
    late = [*_clean(151), _rec(151, action="halt", tier=3, halt=named)]
    silent = [*_clean(150), _rec(150, action="halt", tier=3, halt={})]
    lines = [_fault("nan-grad", "unguarded", s, _clean(300), None) for s in range(3)]
    lines += [_fault("nan-grad", "alert", s, r, None) for s, r in enumerate((at, late, silent))]
    c = _cell(score(lines), "fault/tiny/nan-grad", "alert")
    assert c.caught == 1
    assert c.targets == {"not worse than unguarded": True,
                         "halts at the step, naming the tensor": False}


def test_the_lr_alert_must_come_within_10_steps_of_the_first_anomaly_and_the_run_go_on():
    def run(alert_at):
        r = _clean(300)
        r[152] = _rec(152, tier=1, reasons=["loss/EMA > 1.5"])  # first anomaly
        r[alert_at] = _rec(alert_at, action="alert", tier=2, summary={"step": alert_at})
        return r
    lines = [_fault("lr", "unguarded", s, _clean(300), 2.1, length=20) for s in (0, 1)]
    lines += [_fault("lr", "alert", 0, run(162), 2.1, length=20),
              _fault("lr", "alert", 1, run(163), 2.1, length=20)]
    c = _cell(score(lines), "fault/tiny/lr", "alert")
    assert c.caught == 1
    assert c.targets["tier 2 alert within 10 steps"] is False
    assert c.targets["goes on"] is True


def test_an_alert_without_its_summary_is_not_a_tier2_alert():
    r = _clean(300)
    r[155] = _rec(155, action="alert", tier=2)
    s = summarize_run(r, val_loss=2.0, fault_step=150)
    assert s["alerts"] == [] and s["first_tier2"] is None and s["first_anomaly"] == 155


def test_the_sticky_lr_fault_under_rollback_must_exhaust_the_budget_and_halt():
    def run(rollbacks, halt):
        r = _clean(150)
        r += [_rec(160 + i, action="rollback", tier=2) for i in range(rollbacks)]
        if halt:
            r.append(_rec(170, action="halt", tier=3, halt={"detail": "budget"}))
        return r
    lines = [_fault("lr-sticky", "unguarded", s, _clean(300), 2.5, length=20) for s in (0, 1)]
    lines += [_fault("lr-sticky", "rollback", 0, run(3, True), None, length=20),
              _fault("lr-sticky", "rollback", 1, run(2, True), None, length=20)]
    c = _cell(score(lines), "fault/tiny/lr-sticky", "rollback")
    assert c.caught == 1 and c.targets["withheld, or halts with the budget spent"] is False
    assert c.targets["not worse than unguarded"] is True  # the halt is what it asks for


def test_the_sticky_lr_fault_withheld_at_every_faulty_step_is_caught_without_a_halt():
    def run(withheld):
        r = _clean(300)
        for t in range(150, 150 + withheld):
            r[t] = _rec(t, action="skip", tier=1)
        return r
    lines = [_fault("lr-sticky", "unguarded", s, _clean(300), 2.5, length=20) for s in (0, 1)]
    lines += [_fault("lr-sticky", "rollback", 0, run(20), 2.1, length=20),
              _fault("lr-sticky", "rollback", 1, run(19), 2.1, length=20)]
    c = _cell(score(lines), "fault/tiny/lr-sticky", "rollback")
    assert c.caught == 1  # seed 1 let the last faulty update through
    assert c.targets["withheld, or halts with the budget spent"] is False


def test_a_guarded_faulted_run_that_halts_where_unguarded_finished_is_worse():
    lines = [_fault("outlier", "unguarded", 0, _clean(300), 2.0)]
    lines.append(_fault("outlier", "alert", 0, _clean(300, halt_at=200), None))
    c = _cell(score(lines), "fault/tiny/outlier", "alert")
    assert c.worse == 1 and c.targets["not worse than unguarded"] is False


def test_a_later_line_of_the_same_run_replaces_the_earlier_and_the_table_says_why():
    lines = [_line("c", "unguarded", 0, _clean(100), 2.0),
             _line("c", "alert", 0, _clean(100, halt_at=40), None),
             _line("c", "alert", 0, _clean(100), 2.0)]
    cells = score(lines)
    assert _cell(cells, "c", "alert").runs == 1 and _cell(cells, "c", "alert").met
    bad = score(lines[:2])
    table = format_table(bad)
    assert "| c | alert | 1 | 1 | 0 | 1 |" in table
    assert "NOT met: no halt, none harmed" in table
    assert "overall: 0/1" in table
    assert format_table(bad, only_failed=True).count("| c |") == 1
    assert math.isinf(max(_cell(bad, "c", "alert").final_over_clean, default=math.inf))


def test_the_scoring_module_needs_no_torch():
    """It only imports the standard library: loaded from its file with torch blocked."""
    path = Path(detection.__file__)
    code = ("import sys, importlib.util; sys.modules['torch'] = None; "
            f"spec = importlib.util.spec_from_file_location('det', {str(path)!r}); "
            "m = sys.modules['det'] = importlib.util.module_from_spec(spec); "
            "spec.loader.exec_module(m); "
            "print(m.summarize_run([{'step': 0, 'armed': True, 'skipped': True}], "
            "val_loss=1.0)['armed_skips'])")
    r = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert r.stdout.strip() == "1"


def test_without_its_clean_run_the_final_target_is_not_judged_rather_than_failed():
    lines = [_fault("outlier", "unguarded", 0, _clean(300), 2.0),
             _fault("outlier", "alert", 0, _clean(300, skips=(150,)), 2.0)]
    cells = score(lines)
    c = _cell(cells, "fault/tiny/outlier", "alert")
    assert c.targets["final <= 1.002x clean"] is None and c.met is None
    assert "not judged yet: final <= 1.002x clean (a reference run missing)" in format_table(cells)
    assert overall(cells) == (0, 1)
    lines.append(_line("clean/tiny/lr0.003/T300", "unguarded", 0, _clean(300), 2.0))
    c = _cell(score(lines), "fault/tiny/outlier", "alert")
    assert c.met is True and c.final_over_clean == [1.0]


def test_summary_counts_the_updates_the_bound_moved_back():
    recs = _clean(6)
    recs[2]["update_coef"], recs[3]["update_coef"], recs[4]["update_coef"] = 0.2, 1.0, 0.999
    assert summarize_run(recs, val_loss=2.0)["bounded"] == 2
    assert summarize_run(_clean(6), val_loss=2.0)["bounded"] == 0  # no bound, no field

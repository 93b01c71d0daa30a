"""benchmarks/placebo.py: which guarded runs it weighs, where its gaps go, how it scores them."""

from __future__ import annotations

from benchmarks import placebo


def _run(arm: str, seed: int, val: float, skips: list[int], cell: str = "natural/output-logit"):
    return {"cell": cell, "kind": "natural", "variant": cell.split("/")[1], "arm": arm,
            "seed": seed, "steps": 300, "val_loss": val, "skip_steps": skips}


def test_only_guarded_runs_that_skipped_and_ended_elsewhere_are_weighed():
    runs = [_run("unguarded", 1, 3.0, []), _run("alert", 1, 3.3, [62]),     # weighed
            _run("unguarded", 2, 3.0, []), _run("alert", 2, 3.0, [62]),     # ended the same
            _run("unguarded", 3, 3.0, []), _run("alert", 3, 3.1, []),       # no skip
            _run("alert", 4, 3.1, [50]),                                    # no twin
            _run("unguarded", 5, 3.0, [], "clean/base"), _run("alert", 5, 3.1, [9], "clean/base"),
            _run("rollback", 1, 2.0, [62])]
    pairs = placebo.subjects(runs, ["natural/*"], None)
    assert [(g["seed"], u["arm"]) for g, u in pairs] == [(1, "unguarded")]
    assert placebo.subjects(runs, ["natural/*"], [2, 3]) == []
    # a later file's run replaces an earlier one's: the same alert run, now equal to unguarded
    assert placebo.subjects([*runs, _run("alert", 1, 3.0, [62])], ["natural/*"], None) == []


def test_the_gaps_leave_out_as_many_batches_as_the_guard_skipped_around_its_first_skip():
    g = _run("alert", 7, 3.3, [10, 11, 290])
    jobs = placebo.placebo_jobs(g, (-10, -5, 5, 287, 289))
    # step 0 and a gap past the run's end are left out; three batches each, unguarded
    assert [j["fault_spec"] for j in jobs] == ["gap@5:3", "gap@15:3", "gap@297:3"]
    assert {j["arm"] for j in jobs} == {"unguarded"} and {j["seed"] for j in jobs} == {7}
    assert len({j["cell"] for j in jobs}) == 3  # resumable: each placebo its own key


def test_a_guarded_run_worse_than_every_placebo_is_called_out():
    g, u = _run("alert", 1, 3.3, [62]), _run("unguarded", 1, 3.0, [])
    ps = [{"subject": g["cell"], "seed": 1, "val_loss": v} for v in (3.1, 3.2)]
    assert "worse than every placebo" in placebo.table([(g, u)], ps)
    ps.append({"subject": g["cell"], "seed": 1, "val_loss": 3.4})
    out = placebo.table([(g, u)], ps)
    assert "inside the band" in out and "| 1.1000x |" in out and "1 of 3" in out
    assert "1 of 1 guarded runs at or under their worst placebo" in out


def test_a_placebo_runs_the_zoo_or_probe_setting_of_its_subject():
    import pytest

    assert placebo._setting("output-logit")["lr"] == 1.0
    assert placebo._setting("muon")["optimizer"] == "muon"
    some_probe = next(iter(placebo.PROBES))
    assert {k: placebo._setting(some_probe)[k] for k in placebo.PROBES[some_probe]} \
        == placebo.PROBES[some_probe]
    with pytest.raises(ValueError, match="no zoo or zoo_probe setting"):
        placebo._setting("no-such-setting")

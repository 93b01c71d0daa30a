"""benchmarks/zoo.py: a few tiny zoo cells through the real loop (the guard beside the same run
with responses off), the design of the full set, the Muon + AdamW optimizer it trains with, and
the zoo's own targets."""

import copy
import io

import pytest
import torch
from benchmarks import zoo
from benchmarks.detection import run_jobs
from benchmarks.zoo_models import MuonAdamW
from benchmarks.zoo_run import departure
from benchmarks.zoo_score import zoo_score

import spikeguard as sg


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    results = tmp_path_factory.mktemp("zoo") / "results.jsonl"
    log = io.StringIO()
    lines = run_jobs(zoo.smoke(), results, workers=1, log=log, run=zoo._safe_run)
    return results, lines


def test_the_smoke_cells_pair_each_guarded_run_with_the_same_run_unguarded(smoke):
    results, lines = smoke
    assert not [d for d in lines if "error" in d]
    by = {(d["cell"], d["arm"]): d for d in lines}
    assert len(by) == len(zoo.smoke()) == 7
    for name in ("base", "muon"):
        guarded, base = by[(f"clean/smoke-{name}", "alert")], by[(f"clean/smoke-{name}",
                                                                   "unguarded")]
        assert guarded["records"] == base["records"] == zoo.SMOKE["steps"]
        if not guarded["skip_steps"] and not guarded["alerts"]:
            # nothing withheld, nothing paged: the same updates, bit for bit
            assert guarded["val_loss"] == base["val_loss"]
    # the outlier is skipped, the skip made up with one more batch: the run equals the one
    # whose stream never held the garbage batch, bit for bit. (It sits at step 55 of 60, it sat
    # at 30 of 40 before the grad rule's quiet arming: a grad-only spike, it is skipped only
    # once the grad rule is on, from step 47 here; see zoo.SMOKE_FAULT)
    fault, gap = by[("fault/base@smoke/outlier", "alert")], by[("gap/base@smoke/outlier",
                                                                 "unguarded")]
    assert zoo.SMOKE_FAULT in fault["skip_steps"] and fault["records"] == zoo.SMOKE["steps"] + 1
    assert fault["val_loss"] == gap["val_loss"]
    llama = by[("clean/smoke-llama", "alert")]
    assert llama["val_loss"] is not None and llama["val_loss"] < 5.6  # learnt below ln(256)
    cells = {(c.cell, c.arm): c for c in zoo_score(lines)}
    assert cells[("fault/base@smoke/outlier", "alert")].targets["skipped on every seed"]
    assert "no tier 2 page" in cells[("clean/smoke-base", "alert")].targets
    # a rerun finds every run done
    log = io.StringIO()
    run_jobs(zoo.smoke(), results, workers=1, log=log, run=zoo._safe_run)
    assert "0 to run" in log.getvalue()


def test_the_full_set_is_paired_split_in_halves_and_timed_where_it_says():
    jobs = zoo.cells()
    arms: dict[tuple[str, int], set[str]] = {}
    for j in jobs:
        arms.setdefault((j["cell"], j["seed"]), set()).add(j["arm"])
        assert j["half"] == ("tune" if j["seed"] in (0, 1) else "holdout")
    for (cell, _), got in arms.items():
        want = {"clean": {"alert", "unguarded"}, "gap": {"unguarded"}}.get(
            cell.split("/")[0], {"alert", "rollback", "unguarded"})
        assert got == want, cell
    assert [j["seed"] for j in jobs[:5]] == [0] * 5 and jobs[-1]["seed"] == 3
    for j in jobs:
        if j["kind"] not in ("fault", "gap"):
            continue
        s, at = j["setting"], j["fault_step"]
        det = sg.DetectorConfig.for_run(s["steps"], warmup_steps=s["warmup"]
                                        if s["warmup_given"] else None)
        if j["timing"] == "warmup":
            assert at < s["warmup"]
        elif j["timing"] == "arming":
            # just after the earliest step the grad rule can turn on: arm_quiet quiet updates
            # from max(arm_after, grad_arm_after) on
            assert 0 < at - (max(det.arm_after, det.grad_arm_after) + det.arm_quiet) <= 5
        elif j["timing"] == "cooldown":
            sched = sg.schedules.wsd(warmup_steps=s["warmup"], total_steps=s["steps"],
                                     decay_fraction=0.2, min_ratio=0.1)
            assert sched(at) < 1.0 and sched(at - 20) == 1.0
        elif j["timing"] == "last":
            assert at >= 0.95 * s["steps"]
        assert j["clean_ref"] in {c["cell"] for c in jobs if c["kind"] == "clean"}


def test_muon_adamw_steps_as_the_two_optimizers_and_resumes_from_its_state():
    torch.manual_seed(0)
    mats = [torch.randn(8, 6), torch.randn(6, 4)]
    vecs = [torch.randn(6), torch.randn(4)]

    def fresh():
        return [p.clone().requires_grad_() for p in mats], [p.clone().requires_grad_()
                                                            for p in vecs]

    def grads(params, k):
        g = torch.Generator().manual_seed(k)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)

    m1, v1 = fresh()
    m2, v2 = fresh()
    opt = MuonAdamW(m1, v1, muon_lr=0.02, adamw_lr=3e-3, weight_decay=0.1)
    ref_m = torch.optim.Muon(m2, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    ref_v = torch.optim.AdamW(v2, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)  # reaches both
    for k in range(3):
        grads(m1 + v1, k)
        grads(m2 + v2, k)
        opt.step()
        ref_m.step()
        ref_v.step()
        sched.step()
        for g in ref_m.param_groups + ref_v.param_groups:
            g["lr"] = g["lr"] * 0.5
    for a, b in zip(m1 + v1, m2 + v2):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # a fresh optimizer loaded from the state dict takes the same next step
    m3, v3 = [p.detach().clone().requires_grad_() for p in m1], [
        p.detach().clone().requires_grad_() for p in v1]
    other = MuonAdamW(m3, v3, muon_lr=0.02, adamw_lr=3e-3, weight_decay=0.1)
    other.load_state_dict(copy.deepcopy(opt.state_dict()))  # as from a file: no shared buffers
    grads(m1 + v1, 9)
    grads(m3 + v3, 9)
    opt.step()
    other.step()
    for a, b in zip(m1 + v1, m3 + v3):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_departure_is_the_first_of_three_steps_above_its_trend():
    flat = [3.0] * 30
    assert departure(flat) is None
    assert departure([*flat, 3.7, 3.7, 3.7, *flat]) == 30       # 3.7 > 1.2 x 3.0
    assert departure([*flat, 3.7, 3.0, 3.7, 3.7, 3.7]) == 32    # one high step is no departure
    assert departure(flat + [float("nan")] * 3) == 30
    assert departure([3.0 - 0.01 * t for t in range(100)]) is None


def _line(cell, kind, arm, seed=0, **kw):
    base = {"cell": cell, "kind": kind, "arm": arm, "seed": seed, "clean_ref": cell,
            "halted": False, "halt": None, "rollbacks": 0, "skip_steps": [], "alerts": [],
            "armed_steps": 100, "armed_skips": 0, "val_loss": 2.0, "first_anomaly": None,
            "first_tier2": None, "first_tier2_action": None, "departure": None}
    return {**base, **kw}


def test_the_zoo_targets_a_page_on_a_clean_run_and_the_natural_instabilities():
    lines = [_line("clean/sgd", "clean", "unguarded"),
             _line("clean/sgd", "clean", "alert", alerts=[32]),
             _line("fault/base@warmup/lr", "fault", "unguarded", fault="lr", fault_step=10,
                   fault_len=20, first_anomaly=32),
             _line("fault/base@warmup/lr", "fault", "alert", fault="lr", fault_step=10,
                   fault_len=20, first_anomaly=32, first_tier2=32, first_tier2_action="alert",
                   alerts=[32]),
             _line("natural/x", "natural", "unguarded", departure=70, val_loss=3.3),
             _line("natural/x", "natural", "alert", first_tier2=65, first_tier2_action="alert",
                   val_loss=3.3),
             _line("natural/x", "natural", "rollback", first_tier2=72,
                   first_tier2_action="rollback", rollbacks=1, val_loss=2.9)]
    cells = {(c.cell, c.arm): c for c in zoo_score(lines)}
    sgd = cells[("clean/sgd", "alert")]
    assert sgd.targets["no tier 2 page"] is False and sgd.met is False
    late_page = cells[("fault/base@warmup/lr", "alert")]  # 22 steps after the onset
    assert late_page.targets["tier 2 alert within 10 steps"] is True  # (of the first anomaly)
    assert late_page.targets["paged within 10 steps of the onset"] is False
    assert cells[("natural/x", "alert")].met is True
    late = cells[("natural/x", "rollback")]  # rolled back 2 steps after the loss departed
    assert late.targets["rolls back before the unguarded loss departs"] is False
    assert late.targets["ends better than unguarded"] is True


def test_a_natural_instability_under_rollback_keeps_the_lower_lr_and_ends_better():
    """Wortsman et al.'s attention-logit proxy (tiny GPT without QK-norm at LR 1.0), seed 0.
    The trouble comes back each time a replay's LR returns to the schedule; the second
    rollback into the same stretch keeps the LR at 0.25x for good (``rollback_lr_keep``). Before,
    each replay ramped back to 1x, and the third rollback spent the budget: a halt at step 81.
    Its page names the attention logits, so the rollback also turns QK-Clip on
    (``rollback_qk_clip``): 0.78x the unguarded run on an EPYC, 0.973x with the LR alone."""
    from benchmarks.zoo_run import run_one

    jobs = {j["arm"]: j for j in zoo.cells([0]) if j["cell"] == "natural/attn-logit"}
    guarded, unguarded = run_one(jobs["rollback"]), run_one(jobs["unguarded"])
    assert not guarded["halted"] and guarded["result_rollbacks"] >= 2
    assert guarded["qk_clip"] == 100.0
    # rolled back before the departure shows: at the latest at its first step, the first of
    # three above the trend (zoo_score's criterion; a Xeon rolled back at 62, the departure at 88;
    # an EPYC, whose kernels round otherwise, at 64, the departure at 64)
    assert guarded["first_tier2"] <= unguarded["departure"]
    assert guarded["val_loss"] < unguarded["val_loss"]  # ends better than unguarded


def test_a_natural_instability_under_the_default_policy_is_paged_and_not_skipped_into_a_chain():
    """The same proxy (attention logits, seed 0) under the default policy: paged, its flagged
    steps mostly let through by the weights check (the weights are at fault, not the batches),
    and the run no worse than unguarded. A Tier 1 rule that is clean step by step can still
    chain through the guard's responses here: a storm test tried on 2026-12-05 (after any
    flagged step, its reference held to the ordinary bars) skipped 292 of this run's 370 armed
    steps and ended it at a held-out loss of 7.94 (3.31 unguarded)."""
    from benchmarks.zoo_run import run_one

    jobs = {j["arm"]: j for j in zoo.cells([0]) if j["cell"] == "natural/attn-logit"}
    guarded, unguarded = run_one(jobs["alert"]), run_one(jobs["unguarded"])
    assert not guarded["halted"] and guarded["alerts"]  # paged
    assert guarded["armed_skips"] <= 5 and guarded["applied"] == 300
    assert guarded["val_loss"] <= 1.005 * unguarded["val_loss"]


def test_a_garbage_batch_before_the_grad_rule_is_on_is_skipped_inside_a_wide_grad_bar():
    """Zoo seed 3 (held-out), a batch of random token ids at step 52: post-warmup spikes had
    restarted the grad rule's quiet arming (17 of 20 there), and this run's noisy grad norm had
    widened the grad bar to 10.5x its median. The batch stood at 4.7x the median grad norm and
    1.24x the median loss (under the +40% floor): the joint test with the whole grad bar let it
    through; at the midpoint of the median and the bar, as once the rule is on, it is skipped,
    and its run equals the run whose stream never held it."""
    from benchmarks.zoo_run import run_one

    jobs = [j for j in zoo.cells([3]) if j["cell"].endswith("base@arming/outlier")
            and (j["kind"], j["arm"]) in (("fault", "alert"), ("gap", "unguarded"))]
    got = {(j["kind"], j["arm"]): run_one(j) for j in jobs}
    guarded = got[("fault", "alert")]
    assert guarded["skip_steps"] == [52] and not guarded["alerts"]
    assert guarded["val_loss"] == got[("gap", "unguarded")]["val_loss"]  # bit for bit


def test_a_storm_right_after_arming_is_skipped_whole_though_its_later_batches_look_milder():
    """Zoo seed 1, five batches of random token ids from step 52: the first two were skipped,
    the third (5.7x the grad median under a 5.8x bar, +19% loss, inside the joint test) went
    through, and the last two then looked healthy (2.5x, +12%): the run ended 1.04x the run
    without them. After a skip whose batch the weights check blamed, the storm test skips it,
    and the rest: the run equals the run whose stream never held the five, bit for bit."""
    from benchmarks.zoo_run import run_one

    jobs = [j for j in zoo.cells([1]) if j["cell"].endswith("base@arming/storm")
            and (j["kind"], j["arm"]) in (("fault", "alert"), ("gap", "unguarded"))]
    got = {(j["kind"], j["arm"]): run_one(j) for j in jobs}
    guarded = got[("fault", "alert")]
    assert guarded["skip_steps"] == [52, 53, 54, 55, 56] and not guarded["alerts"]
    assert guarded["val_loss"] == got[("gap", "unguarded")]["val_loss"]  # bit for bit


def test_the_gpu_zoo_script_runs_its_cells_on_the_cpu_and_meets_their_targets(tmp_path):
    """benchmarks/gpu_zoo.py is for a lent GPU; its --smoke mode (the tiny GPT, 60 steps) runs
    the same cells on any device, so the script is known to work before a device is."""
    import json

    from benchmarks import gpu_zoo

    out = tmp_path / "gpu_zoo.jsonl"
    assert gpu_zoo.main(["--device", "cpu", "--smoke", "--json", str(out)]) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(x["cell"], x["arm"]) for x in lines] == [
        ("clean", "alert"), ("clean", "unguarded"), ("outlier", "alert"),
        ("outlier", "unguarded"), ("lr", "alert"), ("lr", "rollback"), ("lr", "unguarded")]
    by = {(x["cell"], x["arm"]): x for x in lines}
    # the clean and outlier targets; the LR fault's end is chaotic on a 60-step tiny run (the
    # GPU run judges it), so here: paged at the faulty update and withheld from it on
    assert by[("clean", "alert")]["target"] == by[("outlier", "alert")]["target"] == "met"
    assert by[("outlier", "alert")]["skips"] == [30]
    for arm in ("alert", "rollback"):
        assert by[("lr", arm)]["tier2"][:1] == [30] and by[("lr", arm)]["skips"][:1] == [30]

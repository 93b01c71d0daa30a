"""Rollback judged against the onset at hand, and updates whose own size is the anomaly.

Real tiny GPT, real TokenStream, real CheckpointManager, short runs (tests/guard_harness.py).
"""

from __future__ import annotations

import json

import pytest
from rich.console import Console

import spikeguard as sg
from spikeguard.train.report import ProgressSink, summary_table

from .guard_harness import Fault, guarded_run

pytestmark = pytest.mark.usefixtures("one_thread")

# An LR x3.5 for one step at the end of the warmup (under the LR-jump bar of 4, twice the
# schedule's largest step-to-step ratio): the weights it leaves fail the next batches, the
# weights check lets the clipped updates through, and an alert (cause "weights") lands in the
# window of the checkpoint at step 25, which is then saved unhealthy. The run heals by itself.
EARLY = Fault("lr", 19, mult=3.5, length=1)


def _records(run):
    path = run.guard.checkpoints.directory.parent / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _infos(run):
    return {c.step: c for c in run.guard.checkpoints.list()}


def test_an_early_alert_that_healed_does_not_stop_the_rollback_to_the_checkpoint_before_it(
        tmp_path):
    """An LR x50 reached over four steps (each step's change under the jump bar, so only the
    update ratio sees it, after the fact) at step 40, after an early alert that marked the only
    checkpoint before the onset unhealthy: the alert healed (no flag for 10+ steps before the
    onset), so the guard rolls back to that checkpoint."""
    # arm_quiet=2: the grad rule on 2 quiet updates after arm_after (step 11), before EARLY at
    # the warmup's end; the early alert is a grad-norm flag the weights check released, and
    # with the default 20 quiet updates the rule is not on yet at step 19 (EARLY cannot move
    # later: it is about the warmup's end, and the onset must come after a checkpoint)
    quick = {"arm_quiet": 2}
    run = guarded_run(steps=90, out=tmp_path, every=25, tier2="rollback", detector=quick,
                      faults=[EARLY, Fault("lr", 40, mult=50.0, length=20, ramp=4)])
    records = _records(run)
    ckpt25 = _infos(run)[25]
    assert not ckpt25.healthy and ckpt25.alerts, "premise: the early alert taints step 25"
    alerts = [int(a.split(":")[0]) for a in ckpt25.alerts]
    assert max(alerts) <= 25
    rb = next(r for r in records if r["action"] == "rollback")
    assert rb["rollback_to"] == 25 <= rb["summary"]["onset_step"] - 2
    assert 40 <= rb["summary"]["onset_step"] <= 44 and rb["step"] <= 44
    assert not any(alerts[-1] < r["step"] < rb["summary"]["onset_step"] and r["tier"] >= 1
                   for r in records[:records.index(rb)]), "premise: healed before the onset"
    assert run.halted is None and run.guard.rollbacks == 1
    clean = guarded_run(steps=90, faults=[EARLY], detector=quick)
    # 90 steps: the replay from 25 at half the LR is a fifth of the run (the 2% target is for
    # full runs: BENCHMARKS.md)
    assert abs(run.final_loss() / clean.final_loss() - 1) < 0.05


@pytest.mark.parametrize("policy", ["alert", "rollback"])
def test_an_lr_jump_is_never_applied(policy, tmp_path):
    """LR x50 for 3 steps at step 30: each step's update is withheld before it is applied
    (parameters and optimizer state bit-identical across guard.step); the first is a Tier 2
    dated at itself (a page, and no rollback: nothing reached the weights), the others Tier 1
    skips with cause "lr"; the weights check never releases one."""
    run = guarded_run(steps=60, out=tmp_path, tier2=policy, watch=(29, 30, 31, 32, 33),
                      faults=[Fault("lr", 30, mult=50.0, length=3)])
    from .guard_harness import unchanged

    for t in (30, 31, 32):
        assert unchanged(*run.around[t]), t
    assert not unchanged(*run.around[29]) and not unchanged(*run.around[33])
    by_step = {r["step"]: r for r in _records(run)}
    first = by_step[30]
    assert first["tier"] == 2 and first["action"] == "alert" and first["skipped"]
    assert first["cause"] == "lr" and any(x.startswith("lr jump") for x in first["reasons"])
    assert first["summary"]["onset_step"] == 30
    for t in (31, 32):
        assert by_step[t]["tier"] == 1 and by_step[t]["skipped"] and by_step[t]["cause"] == "lr"
    assert not any(r.get("cause") == "weights" for r in by_step.values())
    assert run.guard.rollbacks == 0 and run.halted is None
    if policy == "rollback":  # the page says nothing was rolled back, not where it would go
        assert "rollback_not_needed" in first
        assert first["summary"]["rollback"].startswith("not needed: the update was withheld")
    else:  # the suggestion for a person
        assert first["summary"]["rollback"].startswith("to the checkpoint of step ")


def test_with_the_lr_jump_check_off_the_jump_is_applied(tmp_path):
    """GuardConfig(lr_jump=0) (a schedule with warm restarts): the same LR x50 steps reach the
    weights, none is withheld for its LR; a bad value is refused naming the field."""
    run = guarded_run(steps=40, out=tmp_path, watch=(30, 31), lr_jump=0.0,
                      faults=[Fault("lr", 30, mult=50.0, length=2)])
    from .guard_harness import unchanged

    assert not unchanged(*run.around[30]) and not unchanged(*run.around[31])
    assert not any(r.get("cause") == "lr" for r in _records(run))
    with pytest.raises(ValueError, match="GuardConfig.lr_jump"):
        sg.GuardConfig(lr_jump=0.5)


def test_an_anomaly_at_a_risen_lr_stops_every_update_at_that_lr(tmp_path):
    """The same ramp under the default policy: Tier 2 pages within the ramp (after the fact),
    and from the next step on no update at that LR is applied (none let through as cause
    "weights"), until the fault ends."""
    run = guarded_run(steps=90, out=tmp_path, watch=tuple(range(40, 60)),
                      faults=[Fault("lr", 40, mult=50.0, length=20, ramp=4)])
    records = _records(run)
    page = next(r for r in records if r["tier"] == 2)
    assert 40 <= page["step"] <= 49  # paged within 10 steps of the onset (issue 43 target)
    after = [r for r in records if page["step"] < r["step"] < 60]
    assert after and all(r["skipped"] and r.get("cause") == "lr" for r in after)
    assert all(not run.around[r["step"]][0] or _same(run.around[r["step"]]) for r in after)
    assert not any(r.get("cause") == "weights" for r in after)
    assert not records[60]["skipped"]  # the LR came back: training goes on


def _same(pair):
    from .guard_harness import unchanged

    return unchanged(*pair)


def _end_table(run, records, *, total):
    """spikeguard train's end table of a run's records, as text."""
    console = Console(record=True, width=200, force_terminal=False)
    sink = ProgressSink(console, total=total, start=0, tokens_per_step=1, bar=False,
                        print_every=10**9)
    for r in records:
        sink.log(r, r["step"])
    console.print(summary_table(sink, applied=run.guard.applied, made_up=0,
                                rollbacks=run.guard.rollbacks, val_loss=1.0, seconds=1.0,
                                halted=run.halted is not None))
    return console.export_text()


def test_with_no_checkpoint_before_the_onset_the_summary_and_the_table_say_so(tmp_path):
    """The ramp at step 12, before the first checkpoint (25): Tier 2 cannot roll back; the
    record, the Tier 2 summary and spikeguard train's end table say that no checkpoint precedes
    the onset (never "step None")."""
    run = guarded_run(steps=60, out=tmp_path, every=25, tier2="rollback",
                      faults=[Fault("lr", 12, mult=50.0, length=8, ramp=4)])
    records = _records(run)
    failed = [r for r in records if r.get("rollback_failed")]
    assert failed and run.guard.rollbacks == 0
    rec = failed[0]
    assert "no checkpoint precedes the onset" in rec["rollback_failed"]
    assert rec["summary"]["rollback"] == "no checkpoint precedes the onset"
    assert rec["summary"]["rollback_checkpoint"] is None
    text = _end_table(run, records, total=60)
    assert "no checkpoint precedes the onset" in text and "None" not in text
    assert f"steps {rec['step']}" in text


def test_the_lr_jump_bar_is_the_schedules_own_largest_ratio():
    """The bar is twice the largest step-to-step ratio the schedule made; a clean warmup +
    cosine schedule (and a WSD one) is never withheld, and x50 after it is."""
    from spikeguard.guard.lr_jump import LrJump

    for sched in (sg.schedules.warmup_cosine(warmup_steps=20, total_steps=300, min_ratio=0.1),
                  sg.schedules.wsd(warmup_steps=20, total_steps=300, decay_fraction=0.2)):
        lrs = [3e-3 * sched(t) for t in range(300)]
        ratios = [b / a for a, b in zip(lrs, lrs[1:]) if a > 0]
        jump = LrJump()
        assert not any(jump.test(lr)[0] for lr in lrs)
        assert jump.largest == pytest.approx(max(ratios), rel=1e-12)
        assert jump.bar == pytest.approx(2 * max(ratios), rel=1e-12)
        assert not jump.test(lrs[-1] * 0.99 * jump.bar)[0]
        withheld, why = jump.test(lrs[-1] * 0.99 * jump.bar * 50)
        assert withheld and why.startswith("lr jump")


def test_a_rollback_into_the_last_replay_keeps_the_lr_lower_for_good_and_the_table_says_so(
        tmp_path):
    """A sticky LR ramp at 150 (it fires every time training passes it): the first rollback
    (154 -> 125) replays at 0.5x ramping back to 1x; the trouble comes back inside that replay,
    so the second (-> 150) replays at 0.25x and keeps it for good (``lr_kept``), which the
    record and spikeguard train's end table say."""
    run = guarded_run(steps=300, out=tmp_path, tier2="rollback", max_rollbacks=2,
                      faults=[Fault("lr", 150, mult=50.0, length=20, ramp=4, sticky=True)])
    records = _records(run)
    rollbacks = [r for r in records if r["action"] == "rollback"]
    assert [r.get("lr_kept") for r in rollbacks] == [None, 0.25]
    assert [r["replay_lr_scale"] for r in rollbacks] == [0.5, 0.25]
    assert run.guard.updater.lr.factor(10_000) == 0.25  # the schedule's tail, for good
    second = rollbacks[1]
    after = next(r for r in records[records.index(second) + 1:])
    assert after["step"] == second["rollback_to"] + 1
    sched = sg.schedules.warmup_cosine(warmup_steps=20, total_steps=300, min_ratio=0.1)
    fault = 50.0 ** (min(4, after["step"] - 150 + 1) / 4)
    assert after["lr"] == pytest.approx(3e-3 * sched(after["step"]) * fault * 0.25, rel=1e-9)
    assert "LR kept at this multiple of the schedule for good" in _end_table(run, records,
                                                                             total=300)

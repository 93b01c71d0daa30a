"""The Guard on 2 gloo ranks under FSDP2 with rank-skewed faults: every decision identical.

One run of 200 steps per rank: an outlier gradient on rank 1 only (skip on both), a transient
LR x 50 on rank 1 only (its shards alone are damaged; a skip storm, then a rollback that brings
both ranks to the same step), and a NaN planted in rank 0's local shard of one gradient (a halt
on both with the same report). Each step's verdict is all-gathered and compared on the spot.
"""

import pytest
import torch.distributed as dist

from tests.dist import run_distributed

STEPS = 200


def _guarded_fsdp(rank: int, world: int, directory: str) -> dict:
    import spikeguard as sg
    from tests.guard_harness import fsdp_tiny

    model, opt, sched = fsdp_tiny(world, STEPS)
    cfg = model.cfg
    data = sg.TokenStream.from_corpus("pydoc", batch_size=4, seq_len=cfg.seq_len, seed=0,
                                      rank=rank, world_size=world)
    guard = sg.Guard(model, opt, scheduler=sched, data=data,
                     checkpoints=sg.CheckpointManager(f"{directory}/ckpt", every=25, keep=20),
                     config=sg.GuardConfig(detector=sg.DetectorConfig.for_run(STEPS),
                                           tier2="rollback"))
    lr_fault = {"left": None}
    outlier = None
    verdicts, restarts, halted = [], [], None
    try:
        while guard.step_index < STEPS:
            t = guard.step_index
            x, y = next(data)
            out = model.loss(model(x), y)
            # the outlier: rank 1's gradient x 50 (a random-byte batch on one rank of two moved
            # the mean gradient only 2-4x on some trajectories); the test checks its size below
            (out.loss * (50.0 if t == 60 and rank == 1 else 1.0)).backward()
            if t == 170 and rank == 0:
                g = dict(model.named_parameters())["blocks.0.mlp.fc.weight"].grad
                g.to_local().view(-1)[0] = float("nan")
            if t == 120 and lr_fault["left"] is None:
                lr_fault["left"] = 20
            saved = None
            if rank == 1 and lr_fault["left"]:
                lr_fault["left"] -= 1
                saved = [grp["lr"] for grp in opt.param_groups]
                for grp in opt.param_groups:
                    grp["lr"] *= 50.0
            (v,) = guard.step(out)
            for grp, lr in zip(opt.param_groups, saved or ()):
                if grp["lr"] == lr * 50.0:  # skipped: the scheduler did not reset it
                    grp["lr"] = lr
            if guard.step_index <= t:  # rolled back: the transient fault is over
                lr_fault["left"] = 0
                restarts.append(guard.step_index)
            row = (v.step, v.tier, v.action.value, v.reasons, v.skip)
            rows = [None] * world
            dist.all_gather_object(rows, row)
            assert all(r == rows[0] for r in rows), rows
            verdicts.append(row)
            if t == 60:
                outlier = v.evidence["grad_norm"] / v.evidence["grad_median"]
    except sg.TrainingHalted as e:
        halted = e.report.to_dict()
    guard.close()
    return {"verdicts": verdicts, "restarts": restarts, "halted": halted,
            "rollbacks": guard.rollbacks, "outlier": outlier}


@pytest.mark.dist
@pytest.mark.slow
def test_rank_skewed_faults_get_the_same_decision_on_every_rank(tmp_path):
    a, b = run_distributed(_guarded_fsdp, 2, str(tmp_path), timeout=600)
    assert a["verdicts"] == b["verdicts"] and a["restarts"] == b["restarts"]
    skips = {row[0] for row in a["verdicts"] if row[2] == "skip"}
    assert a["outlier"] >= 20  # the planted gradient is an outlier on this trajectory
    assert 60 in skips  # the outlier on rank 1 only is skipped on both
    # the LR x50 on rank 1 only is withheld before it is applied on both ranks (the jump flag
    # rides the measure all-reduce): every one of its steps, and nothing to roll back
    withheld = {row[0] for row in a["verdicts"] if row[4] and 120 <= row[0] < 140}
    assert withheld == set(range(120, 140)), sorted(withheld)
    assert a["rollbacks"] == b["rollbacks"] == 0 and not a["restarts"]
    assert a["halted"] is not None and a["halted"] == b["halted"]
    assert a["halted"]["step"] == 170
    assert a["halted"]["nonfinite_params"] == ["blocks.0.mlp.fc.weight"]

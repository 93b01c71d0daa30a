"""Attribution on 2 gloo ranks under FSDP2: a garbage sequence in rank 1's batch only.

Every rank re-runs the skipped step together (its collectives included), the rows of both ranks
are gathered so the z-scores see the global batch, rank 0 writes the one quarantine line (naming
rank 1), and the drop re-runs the step with 3 of rank 1's rows and all 4 of rank 0's: its update
is one process's gradient of the mean over those 7 rows.
"""

import json
from pathlib import Path

import pytest
import torch

from tests.dist import run_distributed

STEPS, AT, ROW, STOP = 60, 33, 3, 36  # batch 4 per rank: the global batches of tests that run
# 8 rows on one process, so the same 0xFF row (global row 7) spikes the grad norm at step 33


def _attributed_fsdp(rank: int, world: int, directory: str) -> dict:
    import spikeguard as sg
    from spikeguard.data import load_corpus
    from spikeguard.guard import AttributionConfig
    from tests.attribution_harness import plant
    from tests.guard_harness import fsdp_tiny

    model, opt, sched = fsdp_tiny(world, STEPS)
    cfg = model.cfg
    tokens = load_corpus("pydoc").train.copy()
    data = sg.TokenStream(tokens, batch_size=4, seq_len=cfg.seq_len, seed=0, rank=rank,
                          world_size=world)
    if rank == 1:
        plant(data, tokens, AT, ROW, kind="repeat")
    # the flat 3x-median grad rule (grad_z 1), as in attribution_harness: this tests the drop
    guard = sg.Guard(model, opt, scheduler=sched, data=data,
                     sinks=[sg.JsonlSink(f"{directory}/metrics.jsonl")],
                     config=sg.GuardConfig(detector=sg.DetectorConfig.for_run(STEPS, grad_z=1.0),
                                           attribution=AttributionConfig(drop_sequences=True)))
    verdicts, seen = [], {}

    def at_the_drop(*_):  # the optimizer step after the drop's re-run: that re-run's gradients
        if "kept" in seen and "grads" not in seen:
            seen["grads"] = [p.grad.full_tensor() for p in model.parameters()]
            seen["params"] = [p.detach().full_tensor() for p in model.parameters()]
            seen["parts"] = [None] * world
            torch.distributed.all_gather_object(seen["parts"], seen["kept"])

    opt.register_step_pre_hook(at_the_drop)
    while guard.step_index < STOP:
        x, y = next(data)

        def again(keep=None, x=x, y=y):
            if keep is not None:
                x, y = x[keep], y[keep]
                seen["kept"] = (x, y)
            o = model.loss(model(x), y)
            guard.backward(o)
            return o

        out = model.loss(model(x), y)
        out.loss.backward()
        (v,) = guard.step(out, rerun=again)
        verdicts.append((v.step, v.action.value, v.reasons, v.skip))
    guard.close()
    full = [p.detach().full_tensor() for p in model.parameters()]
    return {"verdicts": verdicts, "applied": guard.applied, "reruns": guard.attribution.reruns,
            "params": float(sum(p.double().square().sum() for p in full)),
            "drop": _against_one_process(seen)}


def _against_one_process(seen: dict) -> dict:
    """The drop's gradient (after any clipping: compared as a direction) against one process's
    gradient of the mean loss over every kept row of both ranks, and against the mean of the
    ranks' own means (what an unweighted re-run gives)."""
    import spikeguard as sg

    ref = sg.GPT(sg.GPTConfig.tiny())
    with torch.no_grad():
        for p, full in zip(ref.parameters(), seen["params"]):
            p.copy_(full)

    def grad(rows: list) -> torch.Tensor:
        ref.zero_grad()
        x, y = torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])
        ref.loss(ref(x), y).loss.backward()
        return torch.cat([p.grad.flatten() for p in ref.parameters()]).double()

    def unit(v: torch.Tensor) -> torch.Tensor:
        return v / v.norm()

    parts = seen["parts"]
    got = unit(torch.cat([g.flatten() for g in seen["grads"]]).double())
    glob = grad(parts)
    own = sum(grad([part]) for part in parts) / len(parts)
    return {"rows": [len(part[0]) for part in parts], "global_norm": float(glob.norm()),
            "gap": float((got - unit(glob)).norm()), "gap_own": float((got - unit(own)).norm())}


@pytest.mark.dist
@pytest.mark.slow
def test_two_ranks_quarantine_the_sequence_of_rank_1_and_drop_only_it(tmp_path):
    r0, r1 = run_distributed(_attributed_fsdp, 2, str(tmp_path))
    assert r0 == r1  # every decision, every reason, the weights
    flagged = [v for v in r0["verdicts"] if v[1] != "continue"]
    assert [(s, a) for s, a, _, _ in flagged] == [(AT, "skip")]
    lines = [json.loads(x) for x in (Path(tmp_path) / "quarantine.jsonl").read_text().splitlines()]
    assert [(q["step"], q["stream_index"], q["rank"], q["row"]) for q in lines] == \
        [(AT, AT, 1, ROW)]
    rec = next(json.loads(x) for x in (Path(tmp_path) / "metrics.jsonl").read_text().splitlines()
               if json.loads(x)["step"] == AT)
    assert rec["cause"] == "data" and rec["kept_rows"] == [7, 8] and rec["skipped"] is False
    # the update is the gradient of the mean over all 7 kept rows (rank 1 lost one of 4)
    drop = r0["drop"]
    assert drop["rows"] == [4, 3]
    assert drop["gap"] < 1e-5 < drop["gap_own"] / 100, drop
    assert rec["kept_grad_norm"] == pytest.approx(drop["global_norm"], rel=1e-5)
    assert r0["applied"] == STOP and r0["reruns"] == 1

"""A rank dies in the middle of a step under torchrun; the elastic agent restarts the job, and
`spikeguard train` resumes from its run directory on every rank at the same step and batch.

Two gloo ranks under ``torchrun --standalone --max-restarts 1`` with DDP. Rank 1 is killed
(SIGKILL, through the test-only crash point ``mid_step@25:1``) after its backward of step 25,
while rank 0 waits in the step's all-reduce; the checkpoints at 10 and 20 are complete. The
restarted ranks must both resume from step 20 at batch 21 of their own shard, finish, and leave a
metrics file equal, record for record, to an uninterrupted run of the same job.
"""

import json
import subprocess
import sys

import pytest

from spikeguard.sinks import read_metrics
from tests.conftest import ROOT
from tests.state_compare import same_record

ARGS = ["--model", "tiny", "--batch-size", "4", "--eval-batches", "1", "--no-progress",
        "--no-plot", "--parallel", "ddp", "--steps", "30", "--ckpt-every", "10"]
CRASH_STEP, CKPT = 25, 20


def _torchrun(out, env, *extra):
    env = {**env, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", *extra, "-m", "spikeguard", "train", *ARGS,
                           "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    import os

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    out = tmp_path_factory.mktemp("elastic_ref")
    r = _torchrun(out, env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return read_metrics(out / "metrics.jsonl")


def _lost(records, reference) -> int:
    """Finished steps missing or repeated, and records that differ from the uninterrupted run
    (a step run from another state or batch)."""
    steps = [r["step"] for r in records]
    lost = len(set(range(30)) - set(steps)) + len(steps) - len(set(steps))
    return lost + sum(not same_record(a, b) for a, b in zip(records, reference))


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.fault_runs(1, 5)
def test_a_rank_killed_mid_step_restarts_and_resumes_on_every_rank_alike(
        fault_run, fault_table, uninterrupted, tmp_path, sub_env):
    env = {**sub_env, "SPIKEGUARD_TEST_CRASH": f"mid_step@{CRASH_STEP}:1"}
    with fault_table.run("rank killed mid-step, torchrun elastic restart") as run:
        r = _torchrun(tmp_path, env, "--max-restarts", "1", "--monitor-interval", "0.5")
        log = r.stdout[-3000:] + r.stderr[-3000:]
        assert r.returncode == 0, log
        ranks = [json.loads((tmp_path / "ranks" / f"rank{i}.json").read_text()) for i in (0, 1)]
        records = read_metrics(tmp_path / "metrics.jsonl")
        run.lost = _lost(records, uninterrupted)
        checks = {
            "the agent restarted the job after the kill":
                "resumed from the checkpoint at step 20" in r.stdout,
            "both ranks resumed from the checkpoint at 20, batch 21":
                [(x["resumed_from"], x["resumed_at_batch"]) for x in ranks] == [(CKPT, CKPT + 1)] * 2,
            "both ranks finished 30 steps alike":
                [(x["steps"], x["applied"], x["skipped"]) for x in ranks] ==
                [(30, ranks[0]["applied"], ranks[0]["skipped"])] * 2,
        }
        run.held = all(checks.values())
    assert run.held and run.lost == 0, ({k: v for k, v in checks.items() if not v}, run.lost, log)

"""The Guard inside torchtitan 0.3.0's Trainer, on 2 gloo ranks (torchrun) with torchtitan's
llama3 debug model (2 of its 6 layers, FSDP2 over both ranks) and spikeguard's CPU helper
(spikeguard.integrations.torchtitan_cpu): an outlier batch skipped on both ranks with nothing
moved, a resume that continues the steps without duplicate records, a rollback through
torchtitan's CheckpointManager that ends within 2% of a clean run and loses no checkpoint, a
fault that returns on the replay halting early, the example as documented, and a NaN gradient
that halts naming the tensor with exit status 3. One job runs every scenario (tests/_titan_job.py): importing
torchtitan is most of its time."""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from spikeguard.sinks import read_metrics
from tests.conftest import ROOT, checkout_env

TESTED = "0.3.0"


def _skip_reason() -> str | None:
    if importlib.util.find_spec("torchtitan") is None:
        return ("torchtitan is not installed; scripts/install_torchtitan.sh installs the "
                f"tested version ({TESTED}) and the few packages its imports need")
    version = importlib.metadata.version("torchtitan")
    if version != TESTED:
        return (f"torchtitan {version} is installed; these tests pin {TESTED} "
                "(scripts/install_torchtitan.sh)")
    return None


pytestmark = [pytest.mark.dist, pytest.mark.slow,
              pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))]

NAN_PARAM = "layers.1.feed_forward.w2.weight"
WORLD = int(os.environ.get("SPIKEGUARD_TITAN_NPROC", "2"))
"""Ranks of the job: 2 gloo ranks here; benchmarks/gpu_check.py sets one per GPU (at most 2)."""


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("titan")
    env = dict(checkout_env(), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={WORLD}",
           "-m", "tests._titan_job", str(out), "outlier", "outlier_lag1", "rollback", "recurring",
           "recurring_keep", "example", "refusals", "nan"]
    # its own session: a job that hangs is killed whole (torchrun and every rank)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        for pid in [proc.pid, *_descendants(proc.pid)]:  # torchrun's ranks have their own group
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        log, _ = proc.communicate(timeout=60)
        pytest.fail(f"the torchtitan job hung for 300 s:\n{log[-4000:]}")
    (out / "torchrun.log").write_text(log)
    for name in ("outlier", "outlier_lag1", "rollback", "recurring", "recurring_keep", "example",
                 "refusals"):
        assert (out / name / "done").exists(), f"scenario {name} did not finish:\n{log[-4000:]}"
    return proc.returncode, out, log


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc), children first."""
    parents: dict[int, int] = {}
    for d in os.listdir("/proc"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = open(f"/proc/{d}/stat").read()
            parents[int(d)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, todo = [], [pid]
    while todo:
        kids = [c for c, p in parents.items() if p == todo.pop()]
        out += kids
        todo += kids
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


RUNS = [("outlier", 0), ("outlier_lag1", 1)]
"""The outlier-and-resume scenario with the host reading each step at once (decide(), the
trainer steps), and one step late (a GPU's default: step(), the skip is AdamW's found_inf)."""


@pytest.mark.parametrize(("name", "lag"), RUNS)
def test_outlier_batch_is_skipped_on_both_ranks_and_nothing_moves(job, name, lag):
    _, out, _ = job
    records = read_metrics(out / name / "metrics-first.jsonl")
    assert [r["step"] for r in records if r["skipped"]] == [10]
    bad = records[10]
    assert bad["action"] == "skip" and bad["reasons"][0].startswith("grad_norm")
    # GuardedTrainer hands the guard the batch's input ids: one token repeated is past the
    # input-token check's bar too
    assert any(r.startswith("tokens: ") for r in bad["reasons"]), bad["reasons"]
    prior = sorted(r["grad_norm"] for r in records[:10])
    assert bad["grad_norm"] > 3 * (prior[4] + prior[5]) / 2  # 3x the median before it
    # the LR of the step after the skip is the skipped step's: the schedule did not advance
    assert records[11]["lr"] == records[10]["lr"] != records[9]["lr"]
    # read_lag 1: guard.step() steps the view, whose step hooks (around both inner optimizers)
    # give the signals the update: every applied one reads above 0, the withheld one 0. read_lag
    # 0: the trainer steps the optimizers after guard.decide() has read the step, so no record
    # carries an update ratio (none is made up)
    ratios = [r.get("update_ratio") for r in records]
    if lag:
        assert ratios[10] == 0 and sum(v is not None for v in ratios) >= len(records) - 1
        assert all(v > 0 for i, v in enumerate(ratios) if i != 10 and v is not None), ratios
    else:
        assert ratios == [None] * len(records)
    for rank in range(WORLD):
        state = torch.load(out / name / f"outlier-rank{rank}.pt", weights_only=False)
        snaps = state["snaps"]  # by torchtitan's step: the guard's + 1
        assert [s for s, skipped in state["first"] if skipped] == [10]  # this rank skipped it
        b, a = snaps[11]["before"], snaps[11]["after"]
        assert b["optimizers"] == ["Adam", "AdamW"]  # two inner optimizers, each its own LR
        assert b["lr"][0] == b["lr"][1] / 2
        assert _same(b["params"], a["params"])
        for n in b["moments"]:  # Adam(W)'s exp_avg, exp_avg_sq and step, bit for bit
            assert set(b["moments"][n]) == {"step", "exp_avg", "exp_avg_sq"}
            assert _same(b["moments"][n], a["moments"][n])
        # the LR schedulers step when a step is resolved: in its own call, or (read_lag 1)
        # in the next one; the skipped step's resolution leaves them where they were
        b, a = snaps[11 + lag]["before"], snaps[11 + lag]["after"]
        assert b["lr"] == a["lr"] and b["sched"] == a["sched"]
        assert b["lr"][0] == records[10]["lr"]  # the record's LR: the first inner group's
        # the same snapshots see an applied update move everything
        b, a = snaps[12]["before"], snaps[12]["after"]
        assert not any(torch.equal(b["params"][n], a["params"][n]) for n in b["params"])
        assert all(a["moments"][n]["step"] == b["moments"][n]["step"] + 1 for n in b["moments"])
        b, a = snaps[12 + lag]["before"], snaps[12 + lag]["after"]
        assert a["sched"] == [s + 1 for s in b["sched"]] and a["lr"] != b["lr"]


def test_the_records_loss_and_log_z_are_the_steps_token_means(job):
    _, out, _ = job
    records = read_metrics(out / "nan" / "metrics.jsonl")
    # torchtitan's loss is each rank's sum over the global token count of the step (two
    # micro-batches per rank here); the guard's is the mean over every token of the step, as
    # float64 torch computes it apart from the trainer
    sums = [row for rank in range(WORLD)
            for row in json.loads((out / "nan" / f"reference-rank{rank}.json").read_text())]
    assert len(sums) == 2 * WORLD
    ce, lse, n = (sum(col) for col in zip(*sums))
    assert records[2]["loss"] == pytest.approx(ce / n, rel=1e-5)
    assert records[2]["log_z"] == pytest.approx(lse / n, rel=1e-5)
    # not the mean of the per-rank or per-micro-batch means by accident: they differ here
    assert records[2]["loss"] != pytest.approx(sums[0][0] / sums[0][2], rel=1e-5)


@pytest.mark.parametrize(("name", "lag"), RUNS)
def test_resume_continues_the_steps_without_duplicate_records(job, name, lag):
    _, out, _ = job
    first = read_metrics(out / name / "metrics-first.jsonl")
    records = read_metrics(out / name / "metrics.jsonl")
    # the first run stopped before torchtitan's step 15 (guard step 14), its newest checkpoint
    # at torchtitan's step 12: the resumed run replays guard steps 12-13 and goes on to the end
    assert [r["step"] for r in first] == list(range(14))
    assert [r["step"] for r in records] == list(range(16))
    assert [r["step"] for r in records if r["skipped"]] == [10]
    for rank in range(WORLD):
        state = torch.load(out / name / f"outlier-rank{rank}.pt", weights_only=False)
        assert state["resumed_at"] == 13
        assert [s for s, _ in state["second"]] == [12, 13, 14, 15]
    # the checkpoint restored model, optimizer, schedule and data position exactly
    for step in (12, 13):
        assert records[step]["loss"] == first[step]["loss"]
        assert records[step]["grad_norm"] == first[step]["grad_norm"]
        assert records[step]["lr"] == first[step]["lr"]
    steps = sorted(int(p.name.split("-")[1]) for p in (out / name / "checkpoint").iterdir())
    assert steps == [4, 8, 12, 16]  # torchtitan's interval and last step, by torchtitan


def test_rollback_leaves_the_poisoned_batches_out_and_ends_near_clean(job):
    _, out, _ = job
    result = json.loads((out / "rollback" / "rollback.json").read_text())
    records = read_metrics(out / "rollback" / "rollback" / "metrics.jsonl")
    rolled = [r for r in records if r["action"] == "rollback"]
    assert len(rolled) == 1 and result["rollbacks"] == 1
    back = rolled[0]
    # six skips in a row (steps 10-15) are a Tier 2; the newest checkpoint at or before the
    # onset - 2 is torchtitan's step 8 (the guard's 7); the six corrupt batches are left out
    assert [r["step"] for r in records if r["skipped"]][:6] == list(range(10, 16))
    assert back["step"] == 15 and back["rollback_to"] == 7 and back["skip_range"] == [10, 15]
    after = records[records.index(back) + 1:]
    assert [r["step"] for r in after] == list(range(8, 20))
    assert not any(r["skipped"] for r in after)
    assert after[0]["loss"] == records[8]["loss"]  # the restored state replays step 8 exactly
    # held-out loss of the final model, against the same run never poisoned
    assert abs(result["rollback"] - result["clean"]) <= 0.02 * result["clean"], result
    # torchtitan's numbering beside the guard's: the rollback went to the folder step-8
    assert back["titan_step"] == 16 and back["titan_rollback_to"] == 8
    # no checkpoint folder seen before any step is gone: the replay's step-12 set the first aside
    seen, after = result["seen"], result["after"]
    lost = {path for path, inode in seen.items() if inode not in after.values()}
    assert not lost, sorted(lost)
    assert any(path.startswith("checkpoint/superseded/step-12") for path in after), after


def test_a_fault_that_returns_on_replay_halts_early_with_its_reason(job):
    _, out, _ = job
    result = json.loads((out / "recurring" / "recurring.json").read_text())
    assert result["rollbacks"] == 2  # the second Tier 2 met on the replay: no third rollback
    assert "came back on replay" in result["halt"] and "not the data" in result["halt"]
    records = read_metrics(out / "recurring" / "metrics.jsonl")
    assert [r["step"] for r in records if r["action"] == "rollback"] == [13, 13]


def test_a_fault_that_returns_on_replay_is_rolled_back_at_a_kept_lower_lr_within_budget(job):
    # rollback_lr_scale 0.5: the fault that came back gets the lower LR the guard keeps (no
    # halt for coming back), and the budget (2 here) halts it after that
    _, out, _ = job
    result = json.loads((out / "recurring_keep" / "recurring.json").read_text())
    assert result["rollbacks"] == 2
    assert "budget of 2 exhausted" in result["halt"] and "came back" not in result["halt"]
    records = read_metrics(out / "recurring_keep" / "metrics.jsonl")
    rolled = [r for r in records if r["action"] == "rollback"]
    assert [(r["replay_lr_scale"], r.get("lr_kept")) for r in rolled] == [(0.5, None),
                                                                        (0.25, 0.25)]


def test_the_example_runs_as_documented_on_cpu_ranks(job):
    _, out, _ = job
    records = read_metrics(out / "example" / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert [r["titan_step"] for r in records] == [1, 2, 3, 4]
    assert all(r["loss"] > 0 and r["log_z"] > 0 for r in records)
    config = json.loads((out / "example" / "run" / "config.json").read_text())
    assert config["config"]["guard"]["tier2"] == "rollback"
    assert config["config"]["z_loss"] == 1e-4 and config["precision"] == "float32"


def test_nan_gradient_halts_naming_the_tensor_with_a_non_zero_exit(job):
    code, out, log = job
    assert code != 0
    assert not (out / "nan" / "done").exists()
    report = json.loads((out / "nan" / "report.json").read_text())
    assert report["step"] == 6 and report["nonfinite_params"] == [NAN_PARAM]
    records = read_metrics(out / "nan" / "metrics.jsonl")
    assert records[-1]["step"] == 6 and records[-1]["action"] == "halt"
    assert records[-1]["tier"] == 3
    assert log.count("TrainingHalted") >= WORLD, log[-3000:]  # on every rank
    assert code != 0 and "exitcode  : 3" in log, log[-3000:]  # exits.HALTED, as the example
    assert os.path.getsize(out / "nan" / "report.json") > 0


def test_refused_configurations_say_what_to_change(job):
    _, out, _ = job
    messages = json.loads((out / "refusals" / "refusals.json").read_text())
    assert "GuardConfig.clip=1.0 and training.max_norm=0.5" in messages["clip"]
    assert "set them equal" in messages["clip"]
    assert "checkpoint.enable=True" in messages["rollback"]
    assert "MSELoss.Config" in messages["loss"] and "SpikeguardLoss.Config()" in messages["loss"]
    assert "MSELoss.Config" in messages["guarded"]

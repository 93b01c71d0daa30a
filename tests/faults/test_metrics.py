"""The metrics path fails: a full disk (ENOSPC), the file size limit cutting a line (EFBIG), and a
partial line left by a kill. The JSONL file keeps whole records only, the run goes on, and the
sinks that still work carry the condition in their records (``sink_errors``)."""

import json
import random
import subprocess
import sys
import warnings

import pytest

import spikeguard as sg
from spikeguard.cli import main
from spikeguard.sinks import SinkDisabledWarning, read_metrics
from tests.conftest import ROOT
from tests.faults._guarded import Collect, guarded_loop
from tests.state_compare import same_record

STEPS = 12


def _strict(path) -> list:
    """Every line of a JSONL file parsed strictly (None for a line that is not whole JSON)."""
    raw = path.read_bytes()
    out = []
    for line in raw.split(b"\n")[:-1] if raw.endswith(b"\n") or not raw else raw.split(b"\n"):
        try:
            out.append(json.loads(line))
        except ValueError:
            out.append(None)
    return out


def _lost(lines: list, want_steps: list[int]) -> int:
    """Unparseable lines, and wanted steps missing or repeated."""
    steps = [x["step"] for x in lines if x is not None]
    return (sum(x is None for x in lines) + len(set(want_steps) - set(steps))
            + len(steps) - len(set(steps)))


@pytest.mark.fault_runs(1, 20)
def test_a_full_disk_disables_the_jsonl_and_the_other_sinks_say_so(fault_run, fault_table,
                                                                    tmp_path):
    good, collect = tmp_path / "good.jsonl", Collect()
    with fault_table.run("metrics disk full (ENOSPC)") as run:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            guarded_loop(STEPS, [sg.JsonlSink("/dev/full"), sg.JsonlSink(good), collect],
                         seed=fault_run)
        lines = _strict(good)
        run.lost = _lost(lines, list(range(STEPS))) + STEPS - len(collect.records)
        said = [str(w.message) for w in caught if w.category is SinkDisabledWarning]
        noted = [r.get("sink_errors", {}).get("JsonlSink", "") for r in collect.records]
        run.held = (len(said) == 1 and "full disk" in said[0]
                    and all("No space left on device" in n for n in noted)
                    and all(x and "No space left" in x["sink_errors"]["JsonlSink"] for x in lines))
    assert run.held and run.lost == 0, (said, noted[:2], lines[:1])


@pytest.mark.fault_runs(1, 20)
def test_the_file_size_limit_mid_line_leaves_whole_lines_and_the_run_goes_on(fault_run,
                                                                            fault_table, tmp_path,
                                                                            sub_env):
    ref = tmp_path / "ref.jsonl"
    ref_collect = Collect()
    guarded_loop(STEPS, [sg.JsonlSink(ref), ref_collect], seed=0)
    lines = ref.read_bytes().splitlines(keepends=True)
    rng = random.Random(fault_run)
    k = rng.randint(1, STEPS - 2)  # the line the limit cuts
    limit = sum(map(len, lines[:k])) + rng.randint(1, len(lines[k]) - 1)
    path = tmp_path / "m.jsonl"
    with fault_table.run("metrics file size limit (EFBIG) mid-line") as run:
        r = subprocess.run([sys.executable, "-m", "tests.faults._guarded", str(path), str(limit),
                            str(STEPS)], cwd=ROOT, env=sub_env, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        got = json.loads(r.stdout)
        written = path.read_bytes()
        whole = _strict(path)
        run.lost = _lost(whole, list(range(k))) + STEPS - len(got["records"])
        noted = [x.get("sink_errors", {}).get("JsonlSink", "") for x in got["records"]]
        run.held = (written == b"".join(lines[:k])  # exactly the records before the cut, whole
                    and sum("SinkDisabledWarning" in w and "file size limit" in w
                            for w in got["warnings"]) == 1
                    and noted[:k] == [""] * k
                    and all("File too large" in n for n in noted[k:])
                    and [x["loss"] for x in got["records"]] == [x["loss"] for x in ref_collect.records])
    assert run.held and run.lost == 0, (k, limit, len(written), got["warnings"], noted)


TRAIN = ["--model", "tiny", "--batch-size", "4", "--eval-batches", "1", "--no-progress",
         "--no-plot", "--steps", "30", "--ckpt-every", "10", "--warmup-steps", "5"]


@pytest.fixture(scope="module")
def uninterrupted_train(tmp_path_factory):
    out = tmp_path_factory.mktemp("train_ref")
    assert main(["train", *TRAIN, "--out", str(out)]) == 0
    return read_metrics(out / "metrics.jsonl")


@pytest.mark.fault_runs(1, 20)
def test_a_partial_line_left_by_a_kill_is_dropped_and_every_step_kept_once(
        fault_run, fault_table, uninterrupted_train, tmp_path, sub_env):
    # even runs (CI's one): killed after the checkpoint at 20 (the rerun resumes from it); odd:
    # before the first checkpoint (the rerun starts over)
    crash = 25 if fault_run % 2 == 0 else 4
    out = tmp_path / "run"
    with fault_table.run("metrics partial line left by a kill") as run:
        r = subprocess.run([sys.executable, "-m", "spikeguard", "train", *TRAIN, "--out", str(out)],
                           cwd=ROOT, env={**sub_env, "SPIKEGUARD_TEST_CRASH": f"mid_step@{crash}"},
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == -9, r.stderr[-3000:]
        metrics = out / "metrics.jsonl"
        before = metrics.read_bytes()
        with open(metrics, "ab") as f:  # what a kill in the middle of a write leaves
            f.write(b'{"schema": 1, "step": ' + str(crash).encode() + b', "loss": 2.')
        assert main(["train", *TRAIN, "--out", str(out)]) == 0
        lines = _strict(metrics)
        run.lost = _lost(lines, list(range(30))) + sum(
            not same_record(a, b) for a, b in zip(read_metrics(metrics), uninterrupted_train))
        run.held = before.count(b"\n") == crash and len(lines) == 30
    assert run.held and run.lost == 0, (crash, before.count(b"\n"), len(lines))

"""Faults inside a checkpoint save: a SIGKILL at each deterministic point of a sync and an async
save, and a full disk (EFBIG under RLIMIT_FSIZE) with ``on_error="raise"`` and ``"warn"``.

Each run is tests/faults/_ckpt_run.py in a subprocess (30 guarded steps, checkpoints at 10 and
20). A kill at the save of step 20: the checkpoint at 10 still verifies and loads, the partial
one at 20 is never listed (killed after the commit, it is complete and is the one picked), and a
rerun resumes from the newest complete one and ends bit for bit as an uninterrupted run: the
same metrics records, each step once, and the same weights and optimizer state. A full disk: a
clear error naming it, the checkpoint at 10 intact, no partial files left, and then a clean stop
("raise", and a rerun with room resumes to the same end) or a run that trains on to the same end
without saving ("warn").
"""

import json
import subprocess
import sys

import pytest
import torch

import spikeguard as sg
from spikeguard.checkpoint import verify_checkpoint
from spikeguard.sinks import read_metrics
from tests.conftest import ROOT
from tests.faults._ckpt_run import run

POINTS = ("after_shard", "before_commit", "after_manifest", "after_commit")
FSIZE = 200_000  # above the metrics file and a sidecar, below a shard (~1.4 MB)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt_ref")
    assert run(out) == 30
    return read_metrics(out / "metrics.jsonl"), torch.load(out / "final.pt", weights_only=True)


def _worker(out, env, *args):
    return subprocess.run([sys.executable, "-m", "tests.faults._ckpt_run", str(out), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def _same_state(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b))
    return a == b


def _unloadable(directory, steps) -> int:
    """Checkpoints among ``steps`` that are missing, fail verification or fail to restore."""
    lost = 0
    for step in steps:
        path = directory / f"step_{step:08d}"
        try:
            verify_checkpoint(path)
            model = sg.GPT(sg.GPTConfig.tiny())
            opt = torch.optim.AdamW(model.parameters())
            mgr = sg.CheckpointManager(directory, model=model, optimizer=opt)
            assert mgr.restore(at_or_before=step).step == step
        except Exception:
            lost += 1
    return lost


def _metrics_lost(out, reference) -> int:
    """Lines not whole JSON, steps missing or repeated, records unlike the uninterrupted run's."""
    lines = (out / "metrics.jsonl").read_bytes().splitlines()
    bad = 0
    for line in lines:
        try:
            json.loads(line)
        except ValueError:
            bad += 1
    records = read_metrics(out / "metrics.jsonl")
    steps = [r["step"] for r in records]
    return (bad + len(set(range(30)) - set(steps)) + len(steps) - len(set(steps))
            + sum(a != b for a, b in zip(records, reference)))


@pytest.mark.slow
@pytest.mark.fault_runs(1, 10)
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("point", POINTS)
def test_a_kill_inside_a_save_loses_nothing(point, mode, fault_run, fault_table, reference,
                                            tmp_path, sub_env, capsys):
    row = f"kill in {'a sync' if mode == 'sync' else 'an async'} save: {point}"
    flags = ["--async"] if mode == "async" else []
    last = 20 if point == "after_commit" else 10  # the newest complete checkpoint at the kill
    with fault_table.run(row) as r:
        killed = _worker(tmp_path, {**sub_env, "SPIKEGUARD_TEST_CRASH": f"{point}@20"}, *flags)
        assert killed.returncode == -9, killed.stderr[-3000:]
        ckpt = tmp_path / "ckpt"
        listed = [c.step for c in sg.CheckpointManager(ckpt).list()]
        r.lost = _unloadable(ckpt, [10, 20][:last // 10])  # complete before the kill
        partial_left = (ckpt / ".tmp-step_00000020").is_dir()
        step = run(tmp_path, async_save=mode == "async")
        resumed = f"resumed from the checkpoint at step {last}" in capsys.readouterr().out
        r.lost += _metrics_lost(tmp_path, reference[0])
        r.lost += int(not _same_state(torch.load(tmp_path / "final.pt", weights_only=True),
                                      reference[1]))
        r.held = (listed == [10, 20][:last // 10] and partial_left == (last == 10) and resumed
                  and step == 30 and not list(ckpt.glob(".tmp-step_*")))
    assert r.held and r.lost == 0, (listed, partial_left, resumed, r.lost)


@pytest.mark.slow
@pytest.mark.fault_runs(1, 10)
@pytest.mark.parametrize("on_error", ["raise", "warn"])
def test_a_full_disk_during_a_save_keeps_the_last_checkpoint_and_does_what_on_error_says(
        on_error, fault_run, fault_table, reference, tmp_path, sub_env):
    mode = "async" if fault_run % 2 else "sync"  # --faults-full alternates
    flags = ["--on-error", on_error, "--fsize", str(FSIZE), "--fsize-after", "10"]
    flags += ["--async"] if mode == "async" else []
    with fault_table.run(f"disk full in a save (EFBIG), on_error={on_error}") as r:
        full = _worker(tmp_path, sub_env, *flags)
        ckpt = tmp_path / "ckpt"
        listed = [c.step for c in sg.CheckpointManager(ckpt).list()]
        r.lost = _unloadable(ckpt, [10])
        said = full.stderr
        clear = ("step 20 could not be saved" in said and "the disk is full" in said
                 and "File too large" in said and "checkpoint at step 10 is intact" in said)
        tidy = listed == [10] and not list(ckpt.glob(".tmp-step_*"))
        if on_error == "raise":
            stopped = full.returncode == 4 and "CheckpointError" in said
            finished = run(tmp_path, async_save=mode == "async") == 30  # room again: resume
        else:
            stopped = full.returncode == 0 and said.count("CheckpointWarning") == 1
            finished = True
        r.lost += _metrics_lost(tmp_path, reference[0])
        r.lost += int(not _same_state(torch.load(tmp_path / "final.pt", weights_only=True),
                                      reference[1]))
        r.held = clear and tidy and stopped and finished
    assert r.held and r.lost == 0, (on_error, mode, full.returncode, said[-3000:], listed, r.lost)

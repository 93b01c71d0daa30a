"""What a newcomer trips on, as the command answers it: one line naming the problem and the fix,
the documented exit status, no traceback (RELIABILITY.md's bad-input table is :data:`CASES`)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT

TINY = ["--model", "tiny", "--batch-size", "4", "--eval-batches", "1", "--no-progress",
        "--no-plot", "--lr", "1e-3", "--steps", "8", "--warmup-steps", "2", "--ckpt-every", "4"]

CASES = {
    "read-only --out": (2, "is on a read-only file system; choose a writable --out"),
    "--out names a file": (2, "is a file, not a directory; choose another --out"),
    "every checkpoint shard deleted": (2, "pass --fresh to start over"),
    "Ctrl-C": (130, "rerun the same command to resume from the checkpoint at step"),
    "a finished run rerun": (0, "is complete: all 8 steps done"),
    "--fresh over an earlier run": (0, "--fresh: removing the earlier run"),
    "a fault past the last step": (2, "is past the run's last step 7 (--steps 8)"),
    "diagnose --report into a read-only directory": (2, "choose a writable --report directory"),
    "a warning": (0, "spikeguard: UserWarning: --warmup-steps=20 is not below --steps=8"),
}
"""case -> (exit status, the words of its one line)."""


def _spikeguard(args, env) -> subprocess.CompletedProcess:
    """The command as a user runs it: a fresh process."""
    return subprocess.run([sys.executable, "-m", "spikeguard", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def _main(args, capsys) -> subprocess.CompletedProcess:
    """The same command in this process (no torch import to wait for)."""
    from spikeguard.cli import main

    try:
        rc = main(args)
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, rc, out, err)


def _check(case: str, r: subprocess.CompletedProcess, words: str | None = None) -> None:
    status, words = CASES[case][0], words or CASES[case][1]
    assert r.returncode == status, (case, r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and "File \"" not in r.stderr, (case, r.stderr)
    line = [x for x in (r.stderr + r.stdout).splitlines() if words in x]
    assert len(line) == 1, (case, words, r.stdout, r.stderr)
    if status:  # an error is the last line on stderr, alone but for one-line warnings
        errors = [x for x in r.stderr.splitlines() if not x.startswith("spikeguard: ")]
        assert errors == line, (case, r.stderr)


@contextlib.contextmanager
def _read_only_dir(tmp: Path):
    """A directory this process cannot write to: a read-only tmpfs when running as root (root
    writes through permissions), permissions otherwise."""
    ro = tmp / "ro"
    ro.mkdir()
    if os.geteuid() != 0:
        ro.chmod(0o555)
        yield ro, "is not writable"
        ro.chmod(0o755)
        return
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(ro)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"no read-only file system to test with: {r.stderr.strip()}")
    try:
        yield ro, "is on a read-only file system"
    finally:
        subprocess.run(["umount", str(ro)], check=False)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    from spikeguard._config_cli import config_from_args
    from spikeguard.cli import build_parser
    from spikeguard.train import TrainConfig, train

    out = tmp_path_factory.mktemp("finished") / "run"
    train(config_from_args(TrainConfig, build_parser().parse_args(
        ["train", *TINY, "--out", str(out)])), echo=False)
    return out


def test_out_read_only_or_a_file(tmp_path, capsys):
    with _read_only_dir(tmp_path) as (ro, why):
        r = _main(["train", *TINY, "--out", str(ro / "x")], capsys)
        _check("read-only --out", r, f"{why}; choose a writable --out")
    (tmp_path / "file").write_text("not a directory")
    _check("--out names a file", _main(["train", *TINY, "--out", str(tmp_path / "file")], capsys))


def test_diagnose_report_into_a_read_only_directory(tmp_path, capsys, finished):
    with _read_only_dir(tmp_path) as (ro, _):
        r = _main(["diagnose", str(finished / "metrics.jsonl"), "--report",
                   str(ro / "report.html")], capsys)
    _check("diagnose --report into a read-only directory", r)


def test_finished_fresh_and_deleted_shards(tmp_path, capsys, sub_env, finished):
    _check("a finished run rerun", _main(["train", *TINY, "--out", str(finished)], capsys))
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    r = _main(["train", *TINY, "--out", str(run), "--fresh"], capsys)
    _check("--fresh over an earlier run", r)
    assert "2 checkpoint(s) (steps 4..7), metrics.jsonl (8 records)" in r.stdout
    for shard in run.glob("checkpoints/step_*/*.distcp"):
        shard.unlink()
    # a fresh process: each refused checkpoint is a warning (pytest here makes warnings errors)
    _check("every checkpoint shard deleted", _spikeguard(["train", *TINY, "--out", str(run)],
                                                         sub_env))


def test_a_fault_past_the_last_step_and_a_warning(tmp_path, capsys, sub_env):
    r = _main(["train", *TINY, "--inject", "nan@8", "--out", str(tmp_path)], capsys)
    _check("a fault past the last step", r)
    args = [*TINY, "--warmup-steps", "20", "--out", str(tmp_path / "w")]
    r = _spikeguard(["train", *args], sub_env)
    _check("a warning", r)
    assert not any(".py:" in line for line in r.stderr.splitlines())  # no source path


def test_ctrl_c_says_where_a_rerun_resumes(tmp_path, sub_env):
    args = [*TINY, "--steps", "100000", "--out", str(tmp_path)]
    p = subprocess.Popen([sys.executable, "-m", "spikeguard", "train", *args], cwd=ROOT,
                         env=sub_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    ckpt = tmp_path / "checkpoints" / "step_00000008"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and p.poll() is None and not ckpt.is_dir():
        time.sleep(0.05)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=600)
    r = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    _check("Ctrl-C", r)
    step = int(err.rsplit("checkpoint at step ", 1)[1].split()[0])
    assert step >= 8 and (tmp_path / "checkpoints" / f"step_{step:08d}").is_dir()


def test_reliability_md_lists_every_case_with_its_status():
    text = (ROOT / "RELIABILITY.md").read_text()
    table = text[text.index("| bad input | the one line | exit status |"):]
    rows = [r.split(" | ") for r in table.split("\n\n")[0].splitlines()[2:]]
    found = {r[0].strip("| `"): int(r[2].strip(" |")) for r in rows}
    assert found == {case: status for case, (status, _) in CASES.items()}

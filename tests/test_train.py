"""``spikeguard train``: the main job on the Guard, run as a user runs it (a subprocess)."""

import json
import os
import signal
import statistics
import subprocess
import sys
import time

import numpy as np
import pytest

from spikeguard.data import load_corpus
from spikeguard.sinks import read_metrics
from spikeguard.train import TrainConfig, parse_fault, train
from tests.conftest import ROOT

TINY = ["--model", "tiny", "--batch-size", "8", "--eval-batches", "1", "--no-progress", "--lr", "1e-3"]
"""The tiny model at lr 1e-3 trains calmly: in short runs at 3e-3 it has spikes of its own that
the guard rightly skips, which would blur what each test checks."""


def _run(args, env, *, check=True, timeout=1200):
    r = subprocess.run([sys.executable, "-m", "spikeguard", "train", *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"rc {r.returncode}\n{r.stdout}\n{r.stderr}")
    return r


def test_an_outlier_is_skipped_and_the_run_dir_holds_config_record_checkpoints_plot(tmp_path, sub_env):
    r = _run([*TINY, "--steps", "80", "--inject", "outlier@60", "--ckpt-every", "20",
              "--out", str(tmp_path)], sub_env)
    records = read_metrics(tmp_path / "metrics.jsonl")
    # --steps counts updates: the withheld one is made up by one more batch (step 80)
    assert [x["step"] for x in records] == list(range(81))
    # the planted batch is unambiguous on this run's own trajectory (the premise, checked): a
    # grad norm at 20x or more the median of the 20 steps before (63x on torch 2.13)
    before = records[40:60]
    assert records[60]["grad_norm"] >= 20 * statistics.median(x["grad_norm"] for x in before)
    assert [x["step"] for x in records if x["action"] != "continue"] == [60]
    assert records[60]["action"] == "skip" and records[60]["tier"] == 1
    # what happened, not a label: the device withheld step 60's update (the gate's own bit),
    # the LR schedule held there, and every other step was applied
    assert [x["step"] for x in records if x["skipped"]] == [60]
    assert records[61]["lr"] == records[60]["lr"] != records[59]["lr"]
    ranks = json.loads((tmp_path / "ranks" / "rank0.json").read_text())
    assert ranks["applied"] == 80 and ranks["skipped"] == [60] and ranks["made_up"] == 1
    meta = json.loads((tmp_path / "config.json").read_text())
    assert meta["config"]["gpt"]["qk_norm"] and meta["config"]["gpt"]["z_loss"] == 1e-4
    assert meta["config"]["guard"]["clip"] == 1.0 and len(meta["run_hash"]) == 64
    assert meta["config"]["guard"]["detector"]["median_window"] == 20  # for_run(80)
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == \
        ["step_00000020", "step_00000040", "step_00000060", "step_00000080"]  # + the last step
    assert "what the guard did" in r.stdout and "held-out loss" in r.stdout
    assert "skipped batches made up" in r.stdout
    _check_run_png(tmp_path, "outlier")


def test_a_nan_halts_with_status_3_a_halt_line_and_the_parameter_named(tmp_path, sub_env):
    r = _run([*TINY, "--steps", "60", "--inject", "nan@30:blocks.0.mlp.fc.weight",
              "--out", str(tmp_path)], sub_env, check=False)
    assert r.returncode == 3, r.stdout + r.stderr
    assert any(line.startswith("HALT at step 30") for line in r.stdout.splitlines())
    assert "blocks.0.mlp.fc.weight" in r.stderr
    last = read_metrics(tmp_path / "metrics.jsonl")[-1]
    assert last["step"] == 30 and last["action"] == "halt"
    assert last["halt"]["nonfinite_params"] == ["blocks.0.mlp.fc.weight"]
    _check_run_png(tmp_path, "nan")


def test_kill_and_rerun_continues_the_metrics_with_nothing_lost_or_repeated(tmp_path, sub_env):
    args = [*TINY, "--steps", "60", "--ckpt-every", "20", "--inject", "outlier@25"]
    _run([*args, "--out", str(tmp_path / "full")], sub_env)
    cut = tmp_path / "cut"
    p = subprocess.Popen([sys.executable, "-m", "spikeguard", "train", *args, "--out", str(cut)],
                         cwd=ROOT, env=sub_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 1200
    metrics = cut / "metrics.jsonl"
    while time.monotonic() < deadline and p.poll() is None:
        if metrics.exists() and metrics.read_bytes().count(b"\n") >= 47:
            break
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    lines_before = metrics.read_bytes().count(b"\n")
    assert 47 <= lines_before < 60  # killed after the checkpoint at 40, before the end
    r = _run([*args, "--out", str(cut)], sub_env)
    assert "resumed from the checkpoint at step 40" in r.stdout
    full = read_metrics(tmp_path / "full" / "metrics.jsonl")
    resumed = read_metrics(metrics)
    # the outlier at 25 is withheld for its input ids (one batch made up: 61 records); steps
    # 41.. ran again, once each
    assert full[25]["action"] == "skip" and [x["step"] for x in resumed] == list(range(61))
    assert resumed == full  # bit for bit: weights, data position, RNG and guard state restored


def test_bad_flags_and_data_paths_get_one_line_each_not_a_traceback(tmp_path, sub_env, capsys):
    from spikeguard.cli import main

    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "image.png").write_bytes(b"\x89PNG")
    cases = {("--steps", "0"): "--steps=0",
             ("--model", "huge"): "invalid choice",
             ("--inject", "spike@x"): "not a fault spec",
             ("--grad-k", "0.5"): "--grad-k=0.5",
             ("--clip", "-1"): "--clip=-1",
             ("--data", str(tmp_path / "nope")): "no such file",
             ("--data", str(tmp_path / "empty.txt")): "is empty",
             ("--data", str(tmp_path / "odd.bin")): "uint16",
             ("--data", str(tmp_path / "bare")): "holds no text files"}
    for args, want in cases.items():
        try:
            rc = main(["train", *args, "--out", str(tmp_path / "sub")])
        except SystemExit as e:  # argparse's own errors
            rc = e.code
        err = capsys.readouterr().err
        assert rc == 2 and want in err and len(err.strip().splitlines()) == 1, (args, err)
    # and as a user sees it, from a fresh process: one line, no traceback
    r = _run(["--data", str(tmp_path / "nope")], sub_env, check=False)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


def test_print_config_shows_resolved_defaults_and_defenses_none(capsys):
    from spikeguard.cli import main

    def resolved(*args):
        assert main(["train", "--print-config", *args]) == 0
        return json.loads(capsys.readouterr().out)

    on = resolved()
    assert on["gpt"]["qk_norm"] is True and on["gpt"]["z_loss"] == 1e-4
    assert on["guard"]["clip"] == 1.0 and on["guard"]["respond"] is True
    assert on["guard"]["detector"]["median_window"] == 75  # the 300-step default run
    off = resolved("--defenses", "none")
    assert (off["gpt"]["qk_norm"], off["gpt"]["z_loss"], off["guard"]["clip"],
            off["guard"]["respond"]) == (False, 0.0, None, False)
    mine = resolved("--z-loss", "0", "--no-clip", "--tier2", "rollback", "--grad-k", "4")
    assert (mine["gpt"]["z_loss"], mine["guard"]["clip"], mine["guard"]["tier2"],
            mine["guard"]["detector"]["grad_k"]) == (0.0, None, "rollback", 4.0)


def test_fault_specs_parse_and_refuse():
    f = parse_fault("lr@200:50:20!")
    assert (f.kind, f.step, f.args, f.sticky, f.length) == ("lr", 200, ("50", "20"), True, 20)
    assert parse_fault("nan@5:wte.weight").args == ("wte.weight",)
    assert parse_fault("logit-drift@7:0.01").kind == "logit-drift"
    for bad in ("lr@5:50", "lr@5:-1:3", "outlier@x", "nan@1:a:b", "drift@3"):
        with pytest.raises(ValueError, match="--inject"):
            parse_fault(bad)


def test_data_from_a_text_folder_a_bin_file_and_a_local_bpe(tmp_path):
    docs = tmp_path / "docs"
    (docs / "a").mkdir(parents=True)
    text = load_corpus("pydoc").train[:200_000].tobytes()
    (docs / "a" / "one.txt").write_bytes(text[:100_000])
    (docs / "two.md").write_bytes(text[100_000:])
    common = dict(steps=4, model="tiny", batch_size=2, eval_batches=1, progress=False, plot=False,
                  warmup_steps=1)
    r = train(TrainConfig(data=str(docs), out=str(tmp_path / "r1"), **common), echo=False)
    meta = json.loads((tmp_path / "r1" / "config.json").read_text())
    assert meta["model"]["vocab_size"] == 256 and np.isfinite(r.val_loss)
    ids = np.random.default_rng(0).integers(0, 999, 150_000).astype("<u2")
    ids[7] = 999
    ids.tofile(tmp_path / "tok.bin")
    train(TrainConfig(data=str(tmp_path / "tok.bin"), out=str(tmp_path / "r2"), **common),
          echo=False)
    assert json.loads((tmp_path / "r2" / "config.json").read_text())["model"]["vocab_size"] == 1000
    train(TrainConfig(data=str(docs), tokenizer="bpe", vocab_size=320,
                      out=str(tmp_path / "r3"), **common), echo=False)
    meta = json.loads((tmp_path / "r3" / "config.json").read_text())
    assert meta["model"]["vocab_size"] == 320 and "bpe tokens" in meta["data"]


def test_a_directory_of_another_config_is_refused_unless_fresh(tmp_path):
    common = dict(steps=4, model="tiny", batch_size=2, eval_batches=1, progress=False, plot=False,
                  out=str(tmp_path), ckpt_every=2, warmup_steps=1)
    train(TrainConfig(**common), echo=False)
    with pytest.raises(ValueError, match="another config"):
        train(TrainConfig(lr=1e-3, **common), echo=False)
    r = train(TrainConfig(lr=1e-3, fresh=True, **common), echo=False)
    assert r.resumed_from is None and len(r.losses) == 4


@pytest.mark.dist
@pytest.mark.slow
def test_two_ranks_under_torchrun_skip_an_outlier_on_rank_1_together(tmp_path, sub_env):
    # half the global batch garbage moves its loss less than the loss rule's 40%, so the grad
    # rule catches it: it counts quiet updates from step 20 (the warmup) and is on after
    # arm_quiet (20) of them in a row, so the outlier comes at step 50 of 60
    env = {**sub_env, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", "2", "-m", "spikeguard", "train", *TINY,
                        "--steps", "60", "--grad-arm-after", "20", "--inject", "outlier@50",
                        "--inject-rank", "1", "--parallel", "ddp", "--out", str(tmp_path)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout + r.stderr
    records = read_metrics(tmp_path / "metrics.jsonl")
    # one record for the job; both ranks make up the withheld update with one more batch
    assert [x["step"] for x in records] == list(range(61))
    assert [x["step"] for x in records if x["skipped"]] == [50]
    assert records[50]["reasons"][0] == "grad_norm > 3x median"
    ranks = [json.loads((tmp_path / "ranks" / f"rank{i}.json").read_text()) for i in (0, 1)]
    assert ranks[0]["skipped"] == ranks[1]["skipped"] == [50]
    assert ranks[0]["applied"] == ranks[1]["applied"] == 60
    assert ranks[0]["made_up"] == ranks[1]["made_up"] == 1
    assert os.path.getsize(tmp_path / "config.json") > 0


def test_benchmark_smokes_print_parsable_numbers(sub_env):
    import math
    import re

    r = subprocess.run([sys.executable, "benchmarks/bench_defenses.py", "--smoke"], cwd=ROOT,
                       env=sub_env, capture_output=True, text=True, timeout=900, check=True)
    tps = re.search(r"tokens/s ratio ([\d.]+)", r.stdout)
    qk = re.search(r"step ratio qk/defended ([\d.]+)", r.stdout)
    assert tps and qk and math.isfinite(float(tps.group(1))) and float(qk.group(1)) > 0, r.stdout
    r = subprocess.run([sys.executable, "benchmarks/survival.py", "--smoke", "--steps", "40",
                        "--faults", "outlier", "nan", "--workers", "1"], cwd=ROOT, env=sub_env,
                       capture_output=True, text=True, timeout=1500, check=True)
    rows = re.findall(r"^\s+(on|off)\s+0\s+([\d.na]+)\s+([\d.]+)\s+([\d.na]+)\s+(\S.*)$", r.stdout,
                      re.M)
    assert len(rows) == 4, r.stdout
    nan_on = next(o for arm, _, _, _, o in rows[2:] if arm == "on")
    assert nan_on.startswith("halted at 20 naming ['blocks.0.mlp.fc.weight']"), r.stdout


def test_an_lr_spike_under_rollback_is_withheld_and_nothing_is_rolled_back(tmp_path, sub_env):
    """LR x200 for 10 steps: the guard sees the jump before each step and withholds it (cause
    lr); the first pages (Tier 2) and, with nothing applied, nothing is rolled back; the run
    reaches its end with the withheld updates made up."""
    _run([*TINY, "--steps", "120", "--inject", "lr@80:200:10", "--tier2", "rollback",
          "--ckpt-every", "20", "--out", str(tmp_path)], sub_env)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert not any(x["action"] in ("rollback", "halt") for x in records)
    faulty = [x for x in records if 80 <= x["step"] < 90]
    assert all(x["skipped"] and x["cause"] == "lr" for x in faulty)
    assert faulty[0]["tier"] == 2 and "rollback_not_needed" in faulty[0]
    assert records[-1]["step"] >= 119
    _check_run_png(tmp_path, "lr_withheld")


def _check_run_png(out, name):
    """run.png as the command wrote it, read pixel by pixel: each action that happened is its own
    colour at its training step on every panel (above the curve), no other action's colour is
    anywhere, the legend names only what happened, the unarmed steps are shaded and a rollback's
    replayed steps too. Kept as screenshots/run_NAME.png."""
    from spikeguard.train.plot import (
        ABANDONED,
        ACTION_STYLE,
        LINE,
        REPLAYED_COLOR,
        UNARMED_COLOR,
        draw_run,
        final_path,
    )
    from tests import plot_check as pc

    pc.keep(out / "run.png", f"run_{name}.png")
    img = pc.pixels(out / "run.png")
    records = read_metrics(out / "metrics.jsonl")
    fig = draw_run(records, title=name)  # the same layout, for matplotlib's own transforms
    assert fig.canvas.get_width_height() == (img.shape[1], img.shape[0])
    axes = fig.axes
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    for action, (color, _, label) in ACTION_STYLE.items():
        at = [r["step"] for r in records if r["action"] == action]
        assert any(lab.startswith(label) for lab in labels) == bool(at), (action, labels)
        if not at:
            assert not pc.mask(img, color).any(), f"{action}'s colour drawn, but none happened"
            continue
        for ax in axes:
            for s in at:
                assert pc.share_at(img, fig, ax, s, color) > 0.6, (action, s, ax.get_ylabel())
        loss_ax = axes[0]  # the mark is drawn over the curve, not behind it
        assert pc.share_at(img, fig, loss_ax, at[0], LINE, half=0) == 0.0, action
    assert axes[-1].get_xlabel() == "training step"
    top = max(r["step"] for r in records)
    assert top < axes[-1].get_xlim()[1] < top + 3  # training steps, not run order
    path = [r for r, k in zip(records, final_path(records)) if k]
    armed_at = next(r["step"] for r in path if r["armed"])
    assert armed_at > 1 and any(lab.startswith("unarmed") for lab in labels)
    assert pc.share_at(img, fig, axes[0], armed_at // 2, UNARMED_COLOR) > 0.6
    assert pc.share_at(img, fig, axes[0], armed_at + 3, UNARMED_COLOR) == 0.0
    rollbacks = [r for r in records if r["action"] == "rollback"]
    if not rollbacks:
        assert not pc.mask(img, REPLAYED_COLOR).any() and len(records) == top + 1
        return
    rb = rollbacks[0]
    lo, hi = rb["rollback_to"], rb["step"]
    assert pc.share_at(img, fig, axes[0], (lo + hi) / 2, REPLAYED_COLOR) > 0.3
    assert pc.share_at(img, fig, axes[0], hi + 5, REPLAYED_COLOR) == 0.0
    dashed = pc.inside(img, fig, axes[0], ABANDONED)
    assert len(dashed) and pc.column(fig, axes[0], lo) <= dashed.min() \
        and dashed.max() <= pc.column(fig, axes[0], hi) + 1

"""diagnose reads the console logs big runs write, by content: each format on lines written the
way the trainer prints them (the format strings of Megatron-LM, NeMo, DeepSpeed, the HF Trainer,
fairseq, nanoGPT, litgpt, llm.c, modded-nanogpt and mlx-lm), checked value by value; a file of no
known format says which formats are read; a missing extra is named."""

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from spikeguard.diagnose import read_log

MEGATRON = (" [2025-04-13 23:41:{s:02d}] iteration {it:>8}/    1000 | consumed samples:   {cs:>10} | "
            "elapsed time per iteration (ms): 820.7 | learning rate: {lr:.6E} | global batch "
            "size:    16 | {loss}loss scale: {scale:.1f} | {grad}number of skipped iterations: "
            "{skip:>3} | number of nan iterations: {nan:>3} |")


def megatron_line(it, loss, scale, grad=None, skip=0, nan=0, lr=1e-4):
    return MEGATRON.format(s=it % 60, it=it, cs=it * 16, lr=lr, scale=scale, skip=skip, nan=nan,
                           loss="" if loss is None else f"lm loss: {loss:.6E} | ",
                           grad="" if grad is None else f"grad norm: {grad:.3f} | ")


def write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_megatron_iteration_lines(tmp_path):
    lines = ["training ...", megatron_line(10, None, 8388608.0, skip=10),
             " validation loss at iteration 10 | lm loss value: 9.0E+00 | lm loss PPL: 8.1E+03 | ",
             megatron_line(20, 10.72453, 131072.0, grad=3.874, skip=6),
             megatron_line(30, 10.38769, 4096.0, grad=float("nan")),
             megatron_line(40, 9.992319, 4096.0, grad=2.357).split("2.357")[0] + "2.3"]  # cut
    log = read_log(write(tmp_path / "train.out", lines))
    assert log.format == "megatron" and log.steps.tolist() == [10, 20, 30, 40]
    assert np.array_equal(log.columns["loss"], [math.nan, 10.72453, 10.38769, 9.992319],
                          equal_nan=True)
    assert log.missing["loss"].tolist() == [True, False, False, False]
    g = log.columns["grad_norm"]
    assert g[1] == 3.874 and math.isnan(g[2]) and not log.missing["grad_norm"][2]
    assert log.missing["grad_norm"][3]  # cut off: no value, not a NaN
    assert log.columns["grad_scale"][:3].tolist() == [8388608.0, 131072.0, 4096.0]
    assert log.columns["skipped"][:3].tolist() == [10, 6, 0]
    assert log.columns["lr"][0] == 1e-4


def test_nemo2_lines_take_the_global_step(tmp_path):
    line = ("(pretraining, pid=1) Training epoch {e}, iteration {i}/999 | lr: {lr} | "
            "global_batch_size: 512 | global_step: {g} | reduced_train_loss: {l} | "
            "train_step_timing in s: 46.86 | consumed_samples: 10240")
    log = read_log(write(tmp_path / "nemo.log", [
        line.format(e=1, i=0, lr="2.999e-06", g=19, l="11.03"),
        "[NeMo I 2025-05-22 20:09:41 model_checkpoint:522] Async checkpoint save for step 19",
        line.format(e=1, i=1, lr="3.1e-06", g=20, l="10.98")]))
    assert log.format == "nemo" and log.steps.tolist() == [19, 20]
    assert log.columns["loss"].tolist() == [11.03, 10.98]


def test_deepspeed_overflow_lines_dated_by_the_progress_bar(tmp_path):
    bar = " 14%|#         | {n}/2724 [13:58:09<86:18:35, 132.44s/it]"
    over = ("[2023-06-07 22:16:00,018] [INFO] [loss_scaler.py:181:update_scale] [deepspeed] "
            "OVERFLOW! Rank 0 Skipping step. Attempted loss scale: {a}, reducing to {b}")
    log = read_log(write(tmp_path / "ds.txt", [
        bar.format(n=377), bar.format(n=378) + over.format(a=64, b=32),
        "{'loss': 2.0491, 'learning_rate': 0.0001961913563176343, 'epoch': 0.28}",
        bar.format(n=379) + over.format(a=32, b=16)]))
    assert log.format == "deepspeed" and log.steps.tolist() == [378, 379]
    assert log.columns["grad_scale"].tolist() == [32, 16]
    assert log.columns["scale_tried"].tolist() == [64, 32]
    assert log.columns["skipped"].tolist() == [1, 1]
    assert log.columns["loss"][0] == 2.0491  # the Trainer's row, dated by the last bar


def test_hf_console_rows_are_numbered_and_say_so(tmp_path):
    log = read_log(write(tmp_path / "stdout.txt", [
        "{'loss': 4.4202, 'grad_norm': nan, 'learning_rate': 0.0, 'epoch': 0.13}",
        "{'eval_loss': 4.1, 'eval_runtime': 3.2, 'epoch': 0.2}",
        "{'loss': 4.4061, 'grad_norm': 1.5, 'learning_rate': 1e-05, 'epoch': 0.27}",
        "{'train_runtime': 13.3, 'train_loss': 4.41, 'epoch': 0.3}"]))
    assert log.format == "hfconsole" and log.steps.tolist() == [0, 1]
    assert math.isnan(log.columns["grad_norm"][0]) and log.columns["lr"].tolist() == [0.0, 1e-5]
    assert any("carry no step: numbered from 0" in w for w in log.warnings)


def test_fairseq_progress_and_epoch_lines(tmp_path):
    log = read_log(write(tmp_path / "train.log", [
        "| epoch 001:    450 / 1891 loss=11.521, nll_loss=10.881, ppl=1886.05, wps=52922, "
        "num_updates=445, lr=8.90889e-05, gnorm=1.543, clip=0%, loss_scale=2.000, wall=882",
        "| epoch 001 | valid on 'valid' subset | valid_loss 8.11425 | num_updates 600",
        "| epoch 002 | loss 3.736 | nll_loss 2.045 | ppl 4.13 | num_updates 11001 | "
        "lr 0.000602995 | gnorm 0.434 | clip 100% | oom 0 | loss_scale 2.000 | wall 4464"]))
    assert log.format == "fairseq" and log.steps.tolist() == [445, 11001]
    assert log.columns["loss"].tolist() == [11.521, 3.736]
    assert log.columns["grad_norm"].tolist() == [1.543, 0.434]
    assert log.columns["grad_scale"].tolist() == [2.0, 2.0]


@pytest.mark.parametrize("fmt,lines,steps,losses,extra", [
    ("nanogpt", ["iter 0: loss 4.2648, time 9371.81ms, mfu -100.00%",
                 "step 250: train loss 1.5440, val loss 1.7220",
                 "iter 10: loss nan, time 893.76ms, mfu 16.68%"], [0, 10], [4.2648, math.nan], {}),
    ("litgpt", ["iter 7 step 1: loss 1.1201, iter time: 1819.72ms (optimizer.step)",
                "iter 8 step 1: loss nan, iter time: 1957.89ms"], [7, 8], [1.1201, math.nan], {}),
    ("llmc", ["step    1/74 | train loss 11.010205 | norm 15.4195 | lr 1.00e-06 | 6093.03 ms",
              "step    2/74 | train loss 10.918427 | norm 14.8127 | lr 2.00e-06 | 203.30 ms"],
     [1, 2], [11.010205, 10.918427], {"grad_norm": [15.4195, 14.8127]}),
    ("llmc", ["s:0 tel:10.9", "s:0 trl:11.01", "s:1 trl:10.90 lr:0.0006 norm:3.2"],
     [0, 1], [11.01, 10.90], {}),
    ("moddednanogpt", ["step:0/6000 val_loss:10.9264 train_time:0ms step_avg:nanms",
                       "step:1/6000 train_loss:10.9184 train_time:25ms step_avg:nanms",
                       "step:2/6000 train_loss:8.6834 train_time:50ms step_avg:nanms"],
     [1, 2], [10.9184, 8.6834], {}),
    ("mlx", ["Iter 1: Val loss 2.086, Val took 17.177s",
             "Iter 25: Train loss 1.593, Learning Rate 7.000e-05, It/sec 0.999",
             "Iter 50: Train loss 1.406, Learning Rate 7.000e-05, It/sec 0.942"],
     [25, 50], [1.593, 1.406], {"lr": [7e-5, 7e-5]}),
])
def test_one_line_formats(tmp_path, fmt, lines, steps, losses, extra):
    log = read_log(write(tmp_path / "run.log", ["some banner line", *lines]))
    assert log.format == fmt and log.steps.tolist() == steps
    assert np.array_equal(log.columns["loss"], losses, equal_nan=True)
    for k, v in extra.items():
        assert log.columns[k].tolist() == v


def test_a_file_of_no_known_format_names_the_formats_in_one_line(tmp_path):
    with pytest.raises(ValueError) as e:
        read_log(write(tmp_path / "notes.txt", ["hello", "the loss looked fine today"]))
    msg = str(e.value)
    assert "\n" not in msg and "Megatron-LM" in msg and "nanoGPT" in msg and "llm.c" in msg
    assert "--format" in msg


def _blocked(module, code, tmp_path):
    """Run ``code`` in a fresh process where importing ``module`` fails as if not installed."""
    src = str(Path(__file__).parents[1] / "src")
    prog = f"import sys\nsys.modules[{module!r}] = None\n{code}"
    return subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True,
                          env={"PYTHONPATH": src, "PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
                               "MPLCONFIGDIR": str(tmp_path)}, timeout=120)


def test_missing_extras_are_named(tmp_path):
    ev = tmp_path / "events.out.tfevents.1.host"
    ev.write_bytes(b"\x00" * 16)
    r = _blocked("tensorboard", "from spikeguard.cli import main\n"
                 f"raise SystemExit(main(['diagnose', {str(ev)!r}]))", tmp_path)
    assert r.returncode == 2 and "spikeguard[tb]" in r.stderr, r.stderr
    csv = write(tmp_path / "m.csv", ["step,loss"] + [f"{i},{3 - 0.001 * i}" for i in range(50)])
    r = _blocked("matplotlib", "from spikeguard.cli import main\n"
                 f"raise SystemExit(main(['diagnose', {str(csv)!r}, '--report', "
                 f"{str(tmp_path / 'r.html')!r}]))", tmp_path)
    assert r.returncode == 2 and "spikeguard[plot]" in r.stderr, r.stderr

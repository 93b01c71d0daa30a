"""Sinks: crash-safe JSONL, its reader, console, TensorBoard and W&B read back, contained failures."""

import enum
import errno
import io
import json
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from rich.console import Console

from spikeguard.record import RECORD_KEYS, SCHEMA, StepMetrics, metrics_record
from spikeguard.sinks import (
    ConsoleSink,
    JsonlSink,
    SinkDisabledWarning,
    Sinks,
    encode_record,
    host_record,
    read_metrics,
)

ROOT = Path(__file__).resolve().parents[1]


def rec(step: int, **kw) -> dict:
    fields = {"loss": 2.0 + step / 8, "grad_norm": 1.0 + step / 4, "log_z": 8.25, "nan_frac": 0.0}
    fields.update(kw)
    return metrics_record(StepMetrics(step=step, **fields))


# -- the record ------------------------------------------------------------------------------

def test_metrics_record_keys_and_defaults():
    r = metrics_record(StepMetrics(step=7, loss=2.5, grad_norm=1.25, grad_scale=65536.0,
                                   extras={"tokens_per_s": 1e5}))
    assert list(r)[: len(RECORD_KEYS)] == list(RECORD_KEYS)
    assert r["schema"] == SCHEMA == 1
    assert (r["tier"], r["action"], r["reasons"]) == (0, "continue", [])
    assert r["loss_ema_ratio"] is None and math.isnan(r["log_z"])
    assert r["grad_scale"] == 65536.0 and r["tokens_per_s"] == 1e5
    assert "grad_scale" not in metrics_record(StepMetrics(step=0, loss=1.0, grad_norm=1.0))

    class Action(enum.Enum):
        SKIP = "skip"

    r = metrics_record(StepMetrics(step=1, loss=1.0, grad_norm=9.0), tier=1, action=Action.SKIP,
                       reasons=("grad_norm 9 > 3 x median 1",))
    assert (r["tier"], r["action"], r["reasons"]) == (1, "skip", ["grad_norm 9 > 3 x median 1"])
    with pytest.raises(ValueError, match="action='explode'"):
        metrics_record(StepMetrics(step=1, loss=1.0, grad_norm=1.0), action="explode")
    with pytest.raises(ValueError, match="'tier'"):
        metrics_record(StepMetrics(step=1, loss=1.0, grad_norm=1.0, extras={"tier": 3}))


# -- JSONL -----------------------------------------------------------------------------------

WRITER = textwrap.dedent("""
    import sys, torch
    from spikeguard.record import StepMetrics, metrics_record
    from spikeguard.sinks import JsonlSink
    sink = JsonlSink(sys.argv[1], defer=sys.argv[2] == "1")
    steps = int(sys.argv[3])
    for step in range(steps):
        m = StepMetrics(step=step, loss=torch.tensor(step / 4, dtype=torch.float64),
                        grad_norm=float(step), nan_frac=0.0, extras={"pad": "x" * 200})
        sink.log(metrics_record(m), step)
        print(step, flush=True)  # log(step) has returned
    if len(sys.argv) > 4:
        raise SystemExit(3)  # exit without close(): atexit must flush the pending record
""")


def _kill_mid_run(cmd: list[str], env: dict) -> int:
    """Run a writer, kill -9 it wherever it is once it has logged 300 steps; return the last
    step whose log() had returned."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env) as proc:
        announced = -1
        for line in proc.stdout:
            announced = int(line)
            if announced >= 300:
                break
        os.kill(proc.pid, signal.SIGKILL)
        rest = proc.stdout.read().split()
    return int(rest[-1]) if rest else announced


def test_jsonl_kill_9_loses_at_most_the_last_step_and_exit_flushes(tmp_path, sub_env):
    """Three writers at once (Python start-up dominates): killed with immediate writes, killed
    with one-step-late writes, and one that exits without close()."""
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    out = {name: tmp_path / f"{name}.jsonl" for name in ("immediate", "late", "exit")}
    cmd = [sys.executable, str(script)]
    with ThreadPoolExecutor(3) as pool:
        killed = {name: pool.submit(_kill_mid_run, [*cmd, str(out[name]), flag, "10000000"],
                                    sub_env) for name, flag in (("immediate", "0"), ("late", "1"))}
        exited = pool.submit(subprocess.run, [*cmd, str(out["exit"]), "1", "5", "exit"],
                             env=sub_env, capture_output=True, text=True)
        killed = {name: f.result() for name, f in killed.items()}
        exited = exited.result()
    for name, announced in killed.items():
        raw = out[name].read_bytes().split(b"\n")
        for line in raw[:-1]:  # every newline-terminated line is a whole strict-JSON record
            json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c} in JSON"))
        records = read_metrics(out[name])
        steps = [r["step"] for r in records]
        assert steps == list(range(len(steps)))
        assert all(r["loss"] == r["step"] / 4 for r in records)
        # log(announced) returned; with a one-step-late read its record may still be pending
        late = int(name == "late")
        assert announced - late + 1 <= len(steps) <= announced + 2, (name, announced, len(steps))
    assert exited.returncode == 3, exited.stderr
    assert [x["step"] for x in read_metrics(out["exit"])] == [0, 1, 2, 3, 4]


def test_nonfinite_round_trip_and_strict_json(tmp_path):
    path = tmp_path / "m.jsonl"
    sink = JsonlSink(path)
    values = [math.nan, math.inf, -math.inf, 1.5]
    for step, v in enumerate(values):
        sink.log(rec(step, loss=v, grad_norm=-v, extras={"per_head": [v, 0.0]}), step)
    sink.close()
    for line in path.read_text().splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c} in JSON"))
    assert '"loss": "NaN"' in path.read_text() and '"loss": "-Infinity"' in path.read_text()
    got = read_metrics(path)
    for r, v in zip(got, values):
        for x, want in ((r["loss"], v), (r["grad_norm"], -v), (r["per_head"][0], v)):
            assert (math.isnan(x) and math.isnan(want)) or x == want
    assert [r["action"] for r in got] == ["continue"] * 4


def test_read_metrics_tolerates_cut_line_and_any_schema(tmp_path):
    path = tmp_path / "m.jsonl"
    lines = [encode_record(rec(0)), '{"step": 1, "loss": 2.0, "grad_norm": "Infinity"}',
             encode_record(rec(2))[:37]]
    path.write_text("\n".join(lines))  # no newline after the cut record
    got = read_metrics(path)
    assert [r["step"] for r in got] == [0, 1]
    assert got[1]["grad_norm"] == math.inf and got[1]["schema"] == SCHEMA
    assert (got[1]["tier"], got[1]["action"], got[1]["reasons"], got[1]["log_z"]) == \
        (0, "continue", [], None)
    # appending after a crash drops the cut line instead of gluing the next record to it
    sink = JsonlSink(path)
    sink.log(rec(2), 2)
    sink.close()
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2]

    path.write_text(lines[2] + "\n" + lines[0] + "\n")
    with pytest.raises(ValueError, match=r"m\.jsonl:1: not a JSON record"):
        read_metrics(path)
    path.write_text(json.dumps({"schema": SCHEMA + 1, "step": 0}) + "\n")
    with pytest.raises(ValueError, match="upgrade spikeguard"):
        read_metrics(path)


def test_device_values_are_written_one_step_late(tmp_path):
    path = tmp_path / "m.jsonl"
    sink = JsonlSink(path, defer=True)
    loss = torch.tensor(3.25)
    sink.log({**rec(0, loss=loss), "tier": torch.tensor(1), "flag": torch.tensor(True),
              "per_head": torch.tensor([[1.5, 2.5], [3.5, 4.5]])}, 0)
    loss.fill_(99.0)  # the value at log() time is the one written
    assert not path.exists() or path.read_text() == ""
    sink.log(rec(1), 1)
    first = read_metrics(path)
    assert len(first) == 1 and first[0]["loss"] == 3.25 and first[0]["tier"] == 1
    assert first[0]["flag"] is True and first[0]["per_head"] == [[1.5, 2.5], [3.5, 4.5]]
    sink.close()
    assert [r["step"] for r in read_metrics(path)] == [0, 1]
    assert host_record({"x": torch.tensor(2, dtype=torch.int32)}) == {"x": 2}


# -- failures are contained ------------------------------------------------------------------

def test_failing_sinks_are_reported_and_disabled(tmp_path):
    full = JsonlSink("/dev/full")  # every write: ENOSPC, a full disk
    with pytest.warns(SinkDisabledWarning, match="JsonlSink failed.*No space left"):
        full.log(rec(0), 0)
    assert full.disabled and full.error.errno == errno.ENOSPC
    (tmp_path / "file").write_text("")
    blocked = JsonlSink(tmp_path / "file" / "m.jsonl")  # parent is a file: unwritable
    with pytest.warns(SinkDisabledWarning, match="JsonlSink failed"):
        blocked.log(rec(0), 0)

    class Broken:
        def log(self, record, step):
            if step == 2:
                raise RuntimeError("remote went away")

    seen = []

    class Collect:
        def log(self, record, step):
            seen.append(record)

    good = tmp_path / "good.jsonl"
    group = Sinks([Broken(), JsonlSink(good), Collect()])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing reported before the failure
        group.log(rec(0, loss=torch.tensor(2.0)), 0)
        group.log(rec(1), 1)
    with pytest.warns(SinkDisabledWarning, match="Broken failed.*remote went away"):
        group.log(rec(2), 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # reported once, then silent; the rest go on
        for step in range(3, 6):
            group.log(rec(step), step)
            full.log(rec(step), step)
        group.close()
        full.close()
    assert [r["step"] for r in read_metrics(good)] == list(range(6))
    assert [r["step"] for r in seen] == list(range(6))
    assert type(seen[0]["loss"]) is float  # plain sinks get host values, never tensors
    assert "Broken" in group.failed


# -- console ---------------------------------------------------------------------------------

def test_console_lines_and_summary():
    buf = io.StringIO()
    sink = ConsoleSink(console=Console(file=buf, width=200, highlight=False), every=2)
    for step in range(5):
        r = rec(step, grad_norm=9.0) if step == 3 else rec(step)
        if step == 3:
            r.update(tier=1, action="skip", reasons=["grad_norm 9 > 3 x median 1.5"])
        sink.log(r, step)
    sink.close()
    text = buf.getvalue()
    printed = [ln for ln in text.splitlines() if ln.startswith("step")]
    assert [int(ln.split()[1]) for ln in printed] == [0, 2, 3, 4]
    assert "loss 2.2500" in printed[1] and "tier 1 skip | grad_norm 9 > 3 x median 1.5" in printed[2]
    assert "5 steps logged (0 to 4)" in text and "actions: continue 4, skip 1" in text
    loss_row = next(ln for ln in text.splitlines() if ln.startswith("│ loss"))
    # last, min, max, mean of 2.0, 2.125, ..., 2.5
    assert loss_row.split("│")[2:6] == [" 2.5000 ", " 2.0000 ", " 2.5000 ", " 2.2500 "]

    live_buf = io.StringIO()
    live = ConsoleSink(console=Console(file=live_buf, force_terminal=True, width=120), live=True)
    for step in range(3):
        live.log(rec(step), step)
    live.close()
    assert "step       2" in live_buf.getvalue() and "3 steps logged" in live_buf.getvalue()


# -- TensorBoard and W&B: read back with their own readers -----------------------------------

def test_tensorboard_sink_reads_back(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from spikeguard.sinks import TensorBoardSink

    sink = TensorBoardSink(tmp_path)
    for step in range(4):
        r = rec(step, loss=math.nan) if step == 2 else rec(step)
        if step == 2:
            r.update(tier=3, action="halt", reasons=["nan_frac 0.5 > 0"])
        sink.log(r, step)
    sink.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert {"loss", "grad_norm", "log_z", "nan_frac", "tier"} <= set(acc.Tags()["scalars"])
    loss = acc.Scalars("loss")
    assert [e.step for e in loss] == [0, 1, 2, 3]
    assert [e.value for e in loss][:2] == [2.0, 2.125] and math.isnan(loss[2].value)
    assert [e.value for e in acc.Scalars("tier")] == [0, 0, 3, 0]
    assert acc.Scalars("grad_norm")[3].value == 1.75


def test_wandb_offline_sink_reads_back(tmp_path, monkeypatch):
    """Read back through the run's public summary, which W&B's service updates with each logged
    row: after every log() it holds that row's values (and ``_step``, the rows so far)."""
    pytest.importorskip("wandb")
    from spikeguard.sinks import WandbSink

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = WandbSink(mode="offline", dir=str(tmp_path), name="sg-{rank}")
    assert sink.run.offline and sink.run.name == "sg-0"
    rows = []
    for step in (10, 11, 12, 11):  # a rollback repeats step 11: kept, not dropped
        r = rec(step)
        if step == 12:
            r.update(tier=1, action="skip", reasons=["loss/EMA 2.3 > 2"])
        sink.log(r, step)
        rows.append(dict(sink.run.summary))
    run_dir = Path(sink.run.dir).parent
    sink.close()
    assert [row["_step"] for row in rows] == [0, 1, 2, 3]  # four history rows, none dropped
    assert [row["step"] for row in rows] == [10, 11, 12, 11]
    assert [row["loss"] for row in rows] == [2.0 + s / 8 for s in (10, 11, 12, 11)]
    assert [row["action"] for row in rows] == ["continue", "continue", "skip", "continue"]
    assert rows[2]["reasons"] == "loss/EMA 2.3 > 2" and rows[2]["tier"] == 1
    assert rows[1]["tier"] == 0 and "reasons" not in rows[0]
    assert list(run_dir.glob("run-*.wandb"))  # the offline run, ready for `wandb sync`


# -- the benchmark runs ----------------------------------------------------------------------

@pytest.mark.parametrize("name, kwargs, extra", [("TensorBoardSink", {"log_dir": "tb"}, "tb"),
                                                  ("WandbSink", {}, "wandb")])
def test_bad_arguments_are_named_before_a_missing_extra(name, kwargs, extra, monkeypatch):
    """Where the extra is not installed (the GPU machine has no wandb), a bad rank still gets
    the rank's error first: one fix at a time, the argument before the install."""
    import importlib.util

    from spikeguard.sinks import _remote

    cls = getattr(_remote, name)
    real = importlib.util.find_spec
    missing = {"tb": "tensorboard", "wandb": "wandb"}[extra]
    monkeypatch.setattr(_remote.importlib.util, "find_spec",
                        lambda name, *a: None if name == missing else real(name, *a))
    with pytest.raises(ValueError, match="rank"):
        cls(**kwargs, rank=-1)
    with pytest.raises(ImportError, match=rf"spikeguard\[{extra}\]"):
        cls(**kwargs)


def test_bench_sinks_smoke(sub_env, tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_sinks.py"), "--smoke",
                        "--out", str(tmp_path)], env=sub_env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    share = re.search(r"log\(\) time / median step: ([-+0-9.eE]+|nan|inf)%", r.stdout)
    ratios = re.search(r"step ratio sinks/base (\S+)\s+A/A base2/base (\S+)", r.stdout)
    assert share and ratios, r.stdout
    values = [float(share.group(1)), float(ratios.group(1)), float(ratios.group(2))]
    assert all(math.isfinite(v) and v > 0 for v in values), r.stdout


def test_jsonl_resume_keeps_the_records_up_to_the_checkpoint_and_continues(tmp_path):
    path = tmp_path / "m.jsonl"
    sink = JsonlSink(path, defer=False)
    for t in range(10):
        sink.log({"step": t, "loss": float(t)}, t)
    sink.close()
    with path.open("ab") as f:
        f.write(b'{"step": 10, "lo')  # a line cut by a kill
    resumed = JsonlSink(path, defer=False)
    resumed.resume(6)  # the checkpoint had handed 6 records to the sinks: steps 0..5
    assert [r["step"] for r in read_metrics(path)] == list(range(6))
    for t in range(6, 8):
        resumed.log({"step": t, "loss": -1.0}, t)
    resumed.close()
    records = read_metrics(path)
    assert [r["step"] for r in records] == list(range(8)) and records[6]["loss"] == -1.0
    short = JsonlSink(path, defer=False)
    short.resume(50)  # more than the file holds (a metrics file lost its tail): keep it all
    short.close()
    assert len(read_metrics(path)) == 8
    group = Sinks([JsonlSink(path, defer=False), object.__new__(type("Plain", (), {
        "log": lambda self, record, step: None}))])
    group.resume(3)  # passed on to the members that resume; a plain sink is left alone
    group.close()
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2]
    assert not group.failed

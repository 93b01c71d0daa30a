"""Real mode's pieces without the server: the page's toggles -> the TrainConfig the child runs,
and the server-sent-event tail of a metrics file that a real child process writes slowly."""

import asyncio
import dataclasses
import json
import subprocess
import sys
import textwrap

import pytest

from spikeguard.guard import GuardConfig
from spikeguard.model import GPTConfig
from spikeguard.sandbox.real import MAX_STEPS, RealConfig, RealRun, RealRuns
from spikeguard.sinks import read_metrics
from spikeguard.train import TrainConfig


def test_toggles_off_map_to_the_library_switches():
    cfg = RealConfig(steps=120, outlier_step=60, seed=4).train_config("somewhere")
    assert isinstance(cfg, TrainConfig)
    assert cfg.model == "tiny" and cfg.steps == 120 and cfg.seed == 4 and cfg.out == "somewhere"
    assert cfg.guard.clip is None and cfg.warmup_steps == 0 and cfg.gpt.z_loss == 0.0
    assert cfg.guard.tier2 == "alert" and cfg.inject == ("outlier@60",)
    assert cfg.fresh and not cfg.plot and not cfg.progress
    # nothing else differs from `spikeguard train --model tiny`'s defaults
    base = TrainConfig(model="tiny", steps=120, seed=4, out="somewhere", fresh=True, plot=False,
                       progress=False, inject=("outlier@60",))
    assert dataclasses.replace(cfg, guard=base.guard, gpt=base.gpt, warmup_steps=20) == base
    assert dataclasses.replace(cfg.guard, clip=1.0) == base.guard
    assert dataclasses.replace(cfg.gpt, z_loss=base.gpt.z_loss) == base.gpt


def test_toggles_on_keep_each_default_where_it_lives():
    cfg = RealConfig(clip=True, warmup=True, z_loss=True, rollback=True,
                     outlier=False).train_config("x")
    assert cfg.guard.clip == GuardConfig().clip == 1.0
    assert cfg.warmup_steps == TrainConfig().warmup_steps == 20
    assert cfg.gpt.z_loss == GPTConfig().z_loss == 1e-4
    assert cfg.guard.tier2 == "rollback" and cfg.inject == ()
    cfg.resolved()  # a complete, valid run config


@pytest.mark.parametrize("kwargs,name", [
    ({"steps": MAX_STEPS + 1}, "steps"), ({"steps": 49}, "steps"), ({"steps": True}, "steps"),
    ({"outlier_step": 200}, "outlier_step"), ({"outlier_step": -1}, "outlier_step"),
    ({"seed": 2**31}, "seed"), ({"clip": 1}, "clip"), ({"rollback": "yes"}, "rollback"),
])
def test_real_config_refuses_bad_values_naming_them(kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name}="):
        RealConfig(**kwargs)


WRITER = textwrap.dedent("""
    import os, sys, time
    fd = os.open(sys.argv[1] + "/metrics.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    open(sys.argv[1] + "/config.json", "w").write(sys.argv[2])
    for i in range(5):
        line = ('{"step": %d, "loss": %d}\\n' % (i, 10 - i)).encode()
        os.write(fd, line[:7]); time.sleep(0.15); os.write(fd, line[7:]); time.sleep(0.05)
    open(sys.argv[1] + "/result.json", "w").write('{"status": "finished", "applied": 5}')
""")

CONFIG = {"config": {"batch_size": 16, "lr": 3e-3, "steps": 5, "warmup_steps": 0,
                     "guard": {"clip": None, "tier2": "alert", "detector": {"arm_after": 5}},
                     "inject": []},
          "model": {"n_layer": 2, "d_model": 64, "seq_len": 64, "z_loss": 0.0, "qk_norm": True},
          "params": 119552, "precision": "fp32", "data": "five lines"}


def _events(run: RealRun, after: int = 0) -> list[tuple[str, str | None, str]]:
    async def collect():
        return [chunk async for chunk in RealRuns().events(run, after)]

    out = []
    for block in "".join(asyncio.run(collect())).split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "data" in fields:
            out.append((fields.get("event", "message"), fields.get("id"), fields["data"]))
    return out


@pytest.mark.parametrize("after", [0, 3])
def test_events_tail_whole_records_in_order_then_end(tmp_path, after):
    """Lines written in two pieces each arrive whole, once, with ids counting records; a
    reconnect with Last-Event-ID = 3 gets records 4 and 5 only."""
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), json.dumps(CONFIG)])
    run = RealRun(1, RealConfig(steps=50, outlier_step=5), tmp_path, proc)
    try:
        events = _events(run, after)
    finally:
        proc.wait(timeout=30)
    assert events[0][0] == "config"
    what = json.loads(events[0][2])
    assert what["params"] == 119552 and what["clip"] is None and what["arm_after"] == 5
    messages = [(i, json.loads(d)) for e, i, d in events if e == "message"]
    assert messages == [(str(k + 1), {"step": k, "loss": 10 - k}) for k in range(after, 5)]
    assert events[-1][0] == "end"
    end = json.loads(events[-1][2])
    assert end == {"run": 1, "returncode": 0, "status": "finished", "applied": 5}
    assert len(events) == 2 + 5 - after


def test_a_child_that_fails_ends_with_its_message(tmp_path):
    with open(tmp_path / "child.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", "import sys; print('no data here'); "
                                 "sys.exit(7)"], stdout=log)
        proc.wait(timeout=30)
    run = RealRun(2, RealConfig(), tmp_path, proc)
    events = _events(run)
    assert [e for e, _, _ in events] == ["end"]
    end = json.loads(events[0][2])
    assert end["status"] == "failed" and end["returncode"] == 7
    assert "exited with status 7: no data here" in end["message"]


@pytest.mark.slow
def test_the_default_real_run_with_every_defense_on_survives_and_says_what_the_guard_did(
        tmp_path, sub_env):
    """The page's "run it for real" with clipping, warmup and z-loss on, the default seed and
    length, as the server starts it: it finishes (it used to halt at step 32 on a storm of
    skips on weights that only the skipped update would have repaired), the planted outlier at
    step 100 is skipped, and result.json says in a sentence what the guard did."""
    config = RealConfig(clip=True, warmup=True, z_loss=True)
    folder = tmp_path / "run"
    folder.mkdir()
    subprocess.run([sys.executable, "-m", "spikeguard.sandbox._real_run",
                    json.dumps(dataclasses.asdict(config)), str(folder)],
                   env=sub_env, check=True, timeout=600, capture_output=True)
    result = json.loads((folder / "result.json").read_text())
    assert result["status"] == "finished" and result["rollbacks"] == 0
    records = read_metrics(folder / "metrics.jsonl")
    assert records[100]["skipped"] and records[100]["action"] == "skip"
    assert not any(r["action"] in ("halt", "rollback") for r in records)
    assert "skipped step 100" in result["guard"]
    acted = [r["step"] for r in records if r["action"] != "continue"]
    assert all(f"step {s}" in result["guard"] for s in acted)

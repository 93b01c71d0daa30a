"""The on-call loop with real parts: a webhook server on 127.0.0.1 (tests/_oncall_hook.py),
``spikeguard train --tier2 ask`` as a user runs it (a subprocess), ``spikeguard respond`` answering it.

The scenario of docs/on-call.md: the tiny model without z-loss, its logits drifting from step 60
and again after any rollback (``--inject logit-drift@60:0.05!``, peak LR 3e-3). The page reaches the server; bad
answers are refused with one line while the run goes on untouched; the answer "roll back to the
checkpoint before log Z began to rise, z-loss 1e-3" is applied, recorded, kept in config.json,
and log Z stays below where it stood at the page. (z-loss 1e-4, PaLM's value, only slows this
injected drift on the tiny model: benchmarks/HISTORY.md, "The on-call loop".)"""

import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from spikeguard import cli
from spikeguard.guard.summary import History, tier2_summary
from spikeguard.oncall import OnCallConfig, Pager
from spikeguard.oncall.pager import PageEvent
from spikeguard.oncall.settings import parse_setting
from spikeguard.sinks import read_metrics
from tests._oncall_hook import closed_port, hook
from tests.conftest import ROOT

TINY = ["--model", "tiny", "--batch-size", "8", "--eval-batches", "1", "--no-progress",
        "--lr", "1e-3", "--z-loss", "0", "--ckpt-every", "20"]
DRIFT = ["--inject", "logit-drift@60:0.2"]
STICKY = ["--inject", "logit-drift@60:0.05!", "--lr", "3e-3"]
"""The scenario's drift comes back after a rollback (the model's own tendency, not a transient):
a rollback alone meets it again, the answer's z-loss is what holds it."""
SECRET = "pd-routing-key-7f3a9c"


def _train(args, env, **kw):
    return subprocess.Popen([sys.executable, "-m", "spikeguard", "train", *TINY, *args],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kw)


def _stop_when(proc, out, done, timeout=300.0):
    """Interrupt ``proc`` (Ctrl-C: it checkpoints and exits 130) once ``done(records)`` holds
    for the records in ``out``: the run's length then adapts to the machine's speed."""
    end = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < end:
        try:
            if done(read_metrics(out / "metrics.jsonl")):
                proc.send_signal(signal.SIGINT)
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    return proc.communicate(timeout=600)


def _respond(capsys, *args):
    rc = cli.main(["respond", *map(str, args)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _summary():
    h = History(100)
    for s in range(100):
        h.add(s, 3.0 - s * 0.01, 1.0 + 0.01 * s, 5.0 + (0.05 * (s - 80) if s > 80 else 0.0))
    return tier2_summary(h, step=99, reasons=("log_z > median of last 32 + 1",), onset=82,
                         data_range=(82, 99), rollback_to=80)


def test_generic_and_slack_pages_reach_a_real_server_with_the_token_from_the_environment(
        tmp_path, monkeypatch):
    monkeypatch.setenv("SG_TEST_TOKEN", SECRET)
    with hook() as h:
        for fmt in ("generic", "slack"):
            cfg = OnCallConfig(page_to=h.url, page_format=fmt, page_secret_env="SG_TEST_TOKEN")
            pager = Pager(cfg, tmp_path)
            page = {"incident": "99-abc", "run_dir": str(tmp_path), "summary": _summary(),
                    "plot": str(tmp_path / "p.png"),
                    "answers": {"continue": f"spikeguard respond {tmp_path} continue"}}
            pager.send(PageEvent(action="trigger", incident="99-abc", dedup_key="k/99-abc",
                                 page=page))
            assert pager.close(wait_s=30) == (1, 0)
        posts = h.wait(2)
    generic, slack = (p["body"] for p in posts)
    assert generic["event"] == "trigger" and generic["dedup_key"] == "k/99-abc"
    assert generic["summary"]["onset_step"] == 82 and generic["summary"]["rollback_checkpoint"] == 80
    assert generic["summary"]["log_z"]["last"] == pytest.approx(5.0 + 0.05 * 19)
    assert slack["text"].startswith("spikeguard Tier 2 at step 99")
    blocks = json.dumps(slack["blocks"])
    assert "onset step 82" in blocks and f"spikeguard respond {tmp_path} continue" in blocks
    assert all(p["headers"]["Authorization"] == f"Bearer {SECRET}" for p in posts)
    lines = (tmp_path / "pages.jsonl").read_text()
    assert lines.count('"status": "sent"') == 2 and SECRET not in lines


def test_settings_parse_and_refuse_with_the_fix():
    layers = ["blocks.0.attn", "blocks.0.mlp"]
    assert parse_setting("z_loss", "1e-4", layers=layers) == ("z_loss", 1e-4)
    assert parse_setting("clip", "none", layers=layers) == ("clip", None)
    assert parse_setting("precision.blocks.0.attn", "fp32", layers=layers)[1] == "fp32"
    for name, value, says in [("z_loss", "abc", "finite number"), ("z_loss", "0.5", "PaLM"),
                              ("lr", "-1", "> 0"), ("warmup", "3", "unknown setting"),
                              ("precision.blocks.9.attn", "fp32", "no module"),
                              ("precision.blocks.0.attn", "fp8", "fp32")]:
        with pytest.raises(ValueError, match=says):
            parse_setting(name, value, layers=layers)


@pytest.mark.slow
def test_the_drift_scenario_paged_refused_answered_rolled_back_with_z_loss(tmp_path, sub_env,
                                                                           capsys):
    out = tmp_path / "run"
    env = {**sub_env, "SG_TEST_PD_KEY": SECRET}
    cmd = ["--steps", "2000", *STICKY, "--tier2", "ask", "--answer-within-s", "600", "--resolve-after",
           "20", "--page-format", "pagerduty", "--page-secret-env", "SG_TEST_PD_KEY",
           "--out", str(out)]
    with hook() as h:
        proc = _train([*cmd, "--page-to", h.url], env)
        try:
            (trigger,) = h.wait(1)
            body = trigger["body"]
            # the page: PagerDuty Events v2, the summary filled in, the plot drawn, the commands
            assert body["routing_key"] == SECRET and body["event_action"] == "trigger"
            page = body["payload"]["custom_details"]
            s = page["summary"]
            incident = page["incident"]
            assert body["dedup_key"].endswith("/" + incident)
            assert s["step"] >= s["onset_step"] >= 60 and s["reasons"]
            assert math.isfinite(s["log_z"]["first"]) and s["log_z"]["last"] > s["log_z"]["first"]
            assert all(math.isfinite(v) for v in s["grad_norm_percentiles"].values())
            assert s["data_range"][0] <= s["data_range"][1]
            to = s["rollback_checkpoint"]
            assert to is not None and to <= s["onset_step"] - 2 and to % 20 == 0
            assert os.path.getsize(page["plot"]) > 1000  # the PNG of the last window
            assert page["answers"]["rollback"] == (
                f"spikeguard respond {out} rollback --incident {incident} --to {to} "
                f"--skip-data {s['data_range'][0]}:{s['data_range'][1]}")
            # bad answers: one line each, exit 2, nothing written while the run goes on
            bad = [(["rollback", "--incident", "1-000000"], "old incident"),
                   (["rollback", "--incident", incident, "--to", to + 7], "no healthy checkpoint"),
                   (["rollback", "--incident", incident, "--set", "warmup=3"], "unknown setting"),
                   (["rollback", "--incident", incident, "--set", "z_loss=abc"], "finite number"),
                   (["rollback", "--incident", incident, "--skip-data", "9:3"], "A <= B"),
                   (["halt", "--incident", incident, "--to", to], "go with rollback")]
            for args, says in bad:
                rc, so, se = _respond(capsys, out, *args)
                assert rc == 2 and so == "" and se.count("\n") == 1 and says in se, (args, se)
                assert se.startswith("spikeguard respond: ")
                assert not (out / "oncall" / "answer.json").exists()
            assert proc.poll() is None  # the run went on meanwhile
            rc, so, _ = _respond(capsys, out, "rollback", "--incident", incident, "--to", to,
                                 "--set", "z_loss=1e-3")
            assert rc == 0 and "answered incident" in so

            def replayed(records):  # 60 steps after the answer's rollback
                noted = [k for k, r in enumerate(records) if "oncall" in r]
                return bool(noted) and len(records) - noted[0] >= 60

            stdout, stderr = _stop_when(proc, out, replayed)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode in (0, 130), stdout + stderr
        posts = h.wait(2, timeout=30)  # the resolve: the run recovered
    resolve = posts[1]["body"]
    assert resolve == {"routing_key": SECRET, "event_action": "resolve",
                       "dedup_key": body["dedup_key"]}
    records = read_metrics(out / "metrics.jsonl")
    noted = [r for r in records if "oncall" in r]
    assert len(noted) == 1  # the refused answers never reached the run
    note = noted[0]["oncall"]
    assert note["incident"] == incident and note["decision"] == "rollback"
    assert note["by"] == "person" and note["rollback_to"] == to
    assert note["settings"] == {"z_loss": 1e-3}
    assert noted[0]["step"] == to + 1  # the first replayed step carries it
    meta = json.loads((out / "config.json").read_text())
    assert meta["config"]["gpt"]["z_loss"] == 1e-3
    assert meta["oncall"]["overrides"] == {"z_loss": 1e-3}
    # log Z under the same drift at the same steps: the first pass (no z-loss) against the
    # replay after the answer; and the replay never climbs back to where the first pass went
    i = records.index(noted[0])
    first = {r["step"]: r["log_z"] for r in records[:i] if r["step"] >= s["onset_step"]}
    replay = {r["step"]: r["log_z"] for r in records[i:]}
    both = sorted(set(first) & set(replay))
    assert len(both) >= 20, both
    gap = sum(first[t] - replay[t] for t in both) / len(both)
    print(f"log Z, steps {both[0]}-{both[-1]}: first pass - replay with z-loss = {gap:.3f} nats")
    assert gap > 0.3
    assert max(replay.values()) < max(first.values())
    # the secret is in no file of the run and in no output
    for path in out.rglob("*"):
        if path.is_file() and path.suffix in (".json", ".jsonl", ".txt"):
            assert SECRET not in path.read_text(errors="replace"), path
    assert SECRET not in stdout + stderr
    # the same command again resumes from the last checkpoint with the answer's z-loss
    last = max(r["step"] for r in records)
    again = _train([*cmd, "--page-to", "http://127.0.0.1:9/unused"], env)
    so, se = _stop_when(again, out, lambda rs: max(r["step"] for r in rs) > last + 5)
    assert again.returncode in (0, 130), so + se
    assert "resumed from the checkpoint" in so and \
        "kept the on-call answers' settings: {'z_loss': 0.001}" in so, so
    meta = json.loads((out / "config.json").read_text())
    assert meta["config"]["gpt"]["z_loss"] == 1e-3 and meta["oncall"]["overrides"] == {"z_loss": 1e-3}


@pytest.mark.slow
def test_the_server_down_for_the_whole_run_and_no_answer_the_default_applies(tmp_path, sub_env):
    out = tmp_path / "run"
    proc = _train(["--steps", "400", *DRIFT, "--tier2", "ask", "--answer-within-s", "1",
                   "--answer-default", "rollback", "--page-retries", "2",
                   "--page-backoff-s", "0.1", "--page-to",
                   f"http://127.0.0.1:{closed_port()}/hook", "--out", str(out)], sub_env)
    stdout, stderr = _stop_when(proc, out, lambda rs: any("oncall" in r for r in rs[-10:-5]))
    assert proc.returncode in (0, 130), stdout + stderr
    pages = [json.loads(x) for x in (out / "pages.jsonl").read_text().splitlines()]
    trigger = next(p for p in pages if p["action"] == "trigger")
    assert trigger["status"] == "unsent" and trigger["attempts"] == 3
    assert "Connection refused" in trigger["error"]
    assert trigger["page"]["summary"]["rollback_checkpoint"] is not None  # the whole page kept
    assert re.search(r"on-call: \d+ page\(s\) could not be sent .* kept in .*pages\.jsonl",
                     stdout), stdout
    incident = json.loads((out / "oncall" / "incident.json").read_text())
    assert incident["pages"]["unsent"] >= 1
    assert incident["decision"]["by"] == "timeout" and incident["decision"]["decision"] == "rollback"
    noted = [r for r in read_metrics(out / "metrics.jsonl") if "oncall" in r]
    assert [r["oncall"]["by"] for r in noted] == ["timeout"]
    assert noted[0]["oncall"]["rollback_to"] == trigger["page"]["summary"]["rollback_checkpoint"]
    assert noted[0]["oncall"]["waited_s"] >= 1.0


def _seconds(stdout: str) -> float:
    return float(re.search(r"seconds\s*\S\s*([\d.]+)", stdout).group(1))


@pytest.mark.slow
def test_a_slow_server_does_not_slow_the_steps(tmp_path, sub_env):
    args = ["--steps", "160", *DRIFT, "--tier2", "ask", "--answer-within-s", "600", "--no-plot"]
    with hook(delay=3.0) as h:  # both runs at once: the same load on both
        slow = _train([*args, "--page-to", h.url, "--page-timeout-s", "1", "--page-retries",
                       "3", "--page-backoff-s", "0.2", "--out", str(tmp_path / "slow")], sub_env)
        base = _train([*args, "--out", str(tmp_path / "base")], sub_env)
        so_slow, se = slow.communicate(timeout=600)
        assert slow.returncode == 0, so_slow + se
        so_base, se = base.communicate(timeout=600)
        assert base.returncode == 0, so_base + se
        assert h.wait(1, timeout=10)  # the page reached the server, which holds it 3 s
    ratio = _seconds(so_slow) / _seconds(so_base)
    print(f"train seconds with a 3 s webhook / without a pager: {ratio:.2f}")
    assert ratio < 1.6, (so_slow, so_base)


def test_an_answer_is_applied_as_a_reply_and_a_resume_keeps_its_settings(tmp_path):
    from spikeguard.data import TokenStream
    from spikeguard.guard import Guard, GuardConfig
    from spikeguard.model import GPT, GPTConfig
    from spikeguard.oncall import Decision, OnCall
    from spikeguard.train.loop import _keep_answers

    model = GPT(GPTConfig.tiny(z_loss=0.0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)
    stream = TokenStream(np.arange(5000) % 256, batch_size=2, seq_len=16, seed=0)
    oncall = OnCall(OnCallConfig(), tmp_path, ask=True)
    guard = Guard(model, opt, scheduler=sched, data=stream, config=GuardConfig(tier2="ask"),
                  oncall=oncall)
    from spikeguard.guard.responses.ask import answer

    reply = answer(Decision(incident="1-a", action="continue",
                            settings={"z_loss": 1e-4, "lr": 4e-4, "clip": 0.5,
                                      "precision.blocks.0.attn": "fp32"}),
                   guard.control, 7, model=model, updater=guard.updater, probes=guard.probes,
                   peak=1e-3)
    assert reply.record["settings"] == {"z_loss": 1e-4, "clip": 0.5, "lr": pytest.approx(4e-4),
                                        "precision.blocks.0.attn": "fp32"}
    assert reply.lr.first == 7 and reply.lr.last is None and reply.lr.scale == pytest.approx(0.4)
    assert model.cfg.z_loss == 1e-4 and guard.updater.clip == 0.5
    attn = model.get_submodule("blocks.0.attn")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        x = torch.randn(1, 16, model.cfg.d_model)
        assert attn(x).dtype == torch.float32  # outside autocast, whatever the policy
        assert model.get_submodule("blocks.0.mlp")(x).dtype == torch.bfloat16
    # a resumed run: the same settings again, on a fresh model; twice changes nothing more
    model2 = GPT(GPTConfig.tiny(z_loss=0.0))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 0.5)
    stream2 = TokenStream(np.arange(5000) % 256, batch_size=2, seq_len=16, seed=0)
    guard2 = Guard(model2, opt2, scheduler=sched2, data=stream2)
    section = {"overrides": reply.record["settings"], "skip_data": [[3, 5]]}
    for _ in range(2):
        kept = _keep_answers(section, guard2, model2, stream2)
    assert kept == section["overrides"] and model2.cfg.z_loss == 1e-4
    assert [s.scale for s in guard2.updater.lr.stretches] == [pytest.approx(0.4)]
    assert stream2.skip_ranges == [(3, 5)]

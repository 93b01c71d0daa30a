"""``spikeguard watch``: the CLI's server in a subprocess over a run directory holding an open
incident (made by the real OnCall, over a real checkpoint and a real plot), driven in headless
Chromium (tests/browser.py): the summary filled in, the plot shown, the commands, a bad answer
refused on the page with nothing written, a good one written as the run reads it."""

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import torch

from spikeguard.checkpoint import CheckpointManager
from spikeguard.model import GPT, GPTConfig
from spikeguard.oncall import OnCall, OnCallConfig
from spikeguard.oncall.answer import answer_path, take_answer
from spikeguard.train.plot import plot_run
from tests.browser import chromium_page
from tests.conftest import ROOT
from tests.test_oncall import _summary
from tests.test_sandbox_server import free_port


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("watched")
    model = GPT(GPTConfig.tiny())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    CheckpointManager(out / "checkpoints", model=model, optimizer=opt).save(80)
    records = [{"step": s, "loss": 3.0 - 0.01 * s, "grad_norm": 1.0, "log_z": 5.0 + max(0, s - 82) * 0.05,
                "loss_ema_ratio": 1.0, "tier": 0, "action": "continue", "reasons": []}
               for s in range(100)]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    oncall = OnCall(OnCallConfig(), out, ask=True, layers=[n for n, _ in model.named_modules() if n],
                    plot=lambda path: plot_run(records, path, title="watched"))
    oncall.page(_summary())
    inc = json.loads((out / "oncall" / "incident.json").read_text())
    deadline = time.monotonic() + 60
    while not os.path.exists(inc["plot"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return out, inc


@contextlib.contextmanager
def watching(out):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "spikeguard", "watch", str(out), "--port",
                             str(port)], cwd=ROOT, env=os.environ.copy(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "watch did not start listening"
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        proc.stdout.close()
        proc.stderr.close()


def _status(url, *, data=None, headers=None):
    req = urllib.request.Request(url, data=data, headers=headers or {},
                                 method="POST" if data is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read() or b"null") if "json" in r.headers.get(
                "content-type", "") else None
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_the_page_shows_the_incident_and_its_buttons_answer_it(run_dir):
    out, inc = run_dir
    with watching(out) as base, chromium_page() as page:
        seen = {"requests": [], "problems": []}
        page.on("request", lambda r: seen["requests"].append(r.url))
        page.on("console", lambda m: m.type in ("error", "warning")
                and seen["problems"].append(m.text))
        page.on("pageerror", lambda e: seen["problems"].append(str(e)))
        page.goto(base + "/")
        page.wait_for_function("() => window.watch && window.watch.renders > 0")
        page.wait_for_function("() => !document.getElementById('plot').hidden")
        assert page.inner_text("#incident-id") == inc["id"]
        assert page.inner_text("#incident-status") == "(open)"
        field = {k: page.inner_text(f"[data-field='{k}']") for k in
                 ("step", "onset_step", "reasons", "data_range", "rollback_checkpoint", "log_z")}
        assert field["step"] == "99" and field["onset_step"] == "82"
        assert field["rollback_checkpoint"] == "80" and field["data_range"] == "82, 99"
        assert "log_z > median of last 32 + 1" in field["reasons"]
        assert field["log_z"].startswith("first 5, last 5.950, slope_per_1k_steps")
        assert page.evaluate("() => document.getElementById('plot').naturalWidth") > 100
        assert inc["page"]["answers"]["rollback"] in page.inner_text("#commands")
        assert page.input_value("#to") == "80" and page.input_value("#skip") == "82:99"
        # a step with no checkpoint: the refusal on the page, nothing written
        page.fill("#to", "70")
        page.click("#rollback")
        page.wait_for_function("() => window.watch.answers === 1")
        assert "--to 70: no healthy checkpoint" in page.inner_text("#answer-result")
        assert not answer_path(out).exists()
        page.fill("#to", "80")
        page.fill("#set", "z_loss=1e-4 precision.blocks.0.attn=fp32")
        page.click("#rollback")
        page.wait_for_function("() => window.watch.answers === 2")
        assert page.inner_text("#answer-result").startswith("answered rollback")
        # the browser notes the refused answer's 400; nothing else went wrong
        assert [p for p in seen["problems"] if "400 (Bad Request)" not in p] == []
        assert len(seen["problems"]) == 1
        assert all(u.startswith(base + "/") for u in seen["requests"]), seen["requests"]
    # the run reads it as it reads spikeguard respond's
    layers = inc["layers"]
    answer, why = take_answer(out, inc["id"], layers=layers, checkpoints=[80])
    assert why is None and answer.action == "rollback" and answer.to == 80
    assert answer.skip_data == (82, 99)
    assert answer.settings == {"z_loss": 1e-4, "precision.blocks.0.attn": "fp32"}


def test_the_server_refuses_other_hosts_other_sites_and_forms(run_dir):
    out, inc = run_dir
    body = json.dumps({"incident": inc["id"], "action": "continue"}).encode()
    with watching(out) as base:
        assert _status(base + "/api/state")[0] == 200
        assert _status(base + "/api/state", headers={"Host": "evil.example:80"})[0] == 400
        code, j = _status(base + "/api/answer", data=body, headers={
            "Content-Type": "application/json", "Origin": "http://evil.example"})
        assert code == 403 and "Origin" in j["error"]
        code, j = _status(base + "/api/answer", data=body, headers={
            "Content-Type": "application/json", "Sec-Fetch-Site": "cross-site"})
        assert code == 403
        code, j = _status(base + "/api/answer", data=body,
                          headers={"Content-Type": "text/plain"})
        assert code == 415
        assert _status(base + "/static/..%2fanswer.py")[0] == 404
        assert not answer_path(out).exists()

"""The sandbox server, run for real: `python -m spikeguard sandbox --port P` in a subprocess.

Binding (127.0.0.1 only), raw-path traversal attempts sent byte for byte, bad parameters, the
Host check, real mode's parameters and its one-run-at-a-time rule, and the latency benchmark's
smoke run."""

import contextlib
import http.client
import json
import math
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from spikeguard.sandbox import SimConfig, simulate

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_sandbox(timeout: float = 60.0) -> Iterator[tuple[str, int, str]]:
    """The CLI's server in a subprocess on a free port; yields (base URL, port, the line it
    printed)."""
    port = free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen([sys.executable, "-m", "spikeguard", "sandbox", "--port", str(port)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"sandbox exited {proc.returncode}: {proc.stderr.read()}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("sandbox did not start listening") from None
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}", port, proc.stdout.readline()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


@pytest.fixture(scope="module")
def server():
    with running_sandbox() as s:
        yield s


def raw_request(port: int, method: str, path: str,
                headers: dict | None = None) -> tuple[int, dict, bytes]:
    """A request with the path sent exactly as written (http.client neither decodes nor
    normalises it)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request(method, path, headers=headers or {})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def raw_get(port: int, path: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
    return raw_request(port, "GET", path, headers)


def _listeners(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp* writes them) in LISTEN state on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, p = local.rsplit(":", 1)
                if int(p, 16) == port and state == "0A":
                    found.append(addr)
    return found


def _other_ipv4() -> str | None:
    """A non-loopback address of this machine, if it has one (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.254.254.254", 9))
            addr = s.getsockname()[0]
        except OSError:
            return None
    return None if addr.startswith("127.") else addr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/net/tcp")
def test_binds_127_0_0_1_only(server):
    base, port, banner = server
    assert banner.startswith(f"spikeguard sandbox: {base}/ ")
    assert _listeners(port) == ["0100007F"]  # 127.0.0.1, and no 0.0.0.0 or IPv6 listener
    with pytest.raises(ConnectionRefusedError):  # another loopback address: not bound
        socket.create_connection(("127.0.0.2", port), timeout=5).close()
    other = _other_ipv4()
    if other is not None:
        with pytest.raises(OSError):
            socket.create_connection((other, port), timeout=5).close()
    status, headers, body = raw_get(port, "/")
    assert status == 200 and b"loss-spike sandbox" in body
    assert "default-src 'self'" in headers["content-security-policy"]


def test_busy_port_is_reported(server, capsys):
    from spikeguard.sandbox.server import serve

    assert serve(server[1]) == 2
    assert "cannot listen on 127.0.0.1" in capsys.readouterr().err
    assert serve(70000) == 2
    assert "--port 70000 must be an integer in 0..65535" in capsys.readouterr().err


def test_static_files_and_the_vendored_chart_library(server):
    _, port, _ = server
    status, headers, body = raw_get(port, "/static/vendor/uPlot.iife.min.js")
    assert status == 200 and body.startswith(b"/*! https://github.com/leeoniya/uPlot")
    assert headers["content-type"].startswith(("text/javascript", "application/javascript"))
    status, _, body = raw_get(port, "/static/vendor/uPlot.LICENSE")
    assert status == 200 and b"MIT License" in body


SECRET = ROOT / "pyproject.toml"
TRAVERSALS = [
    "/static/../../../../pyproject.toml",
    "/static/../server.py",
    "/static/vendor/../../server.py",
    "/static/%2e%2e/%2e%2e/%2e%2e/%2e%2e/pyproject.toml",
    "/static/%2e%2e%2f%2e%2e%2f%2e%2e%2f%2e%2e%2fpyproject.toml",
    "/static/..%2f..%2fserver.py",
    "/static/%252e%252e%252f%252e%252e%252fserver.py",
    "/static/%25252e%25252e%25252fserver.py",
    "/static/..%5c..%5cserver.py",
    "/static/vendor/%2e%2e%5c%2e%2e%5cserver.py",
    "/static/%2e/sandbox.js",
    "/static//etc/passwd",
    "/static/%2fetc%2fpasswd",
    "/static/sandbox.js%00.html",
    "/../../pyproject.toml",
    "/%2e%2e/%2e%2e/pyproject.toml",
]


@pytest.mark.parametrize("path", TRAVERSALS)
def test_path_traversal_gets_a_4xx_with_a_message(server, path):
    _, port, _ = server
    status, _, body = raw_get(port, path)
    assert 400 <= status < 500, (path, status)
    assert json.loads(body)["error"]
    assert b"[build-system]" not in body and b"root:" not in body and b"FastAPI" not in body


@pytest.mark.parametrize("query,name", [
    ("/api/simulate?peak_lr=abc", "peak_lr"),
    ("/api/simulate?peak_lr=5", "peak_lr"),
    ("/api/simulate?peak_lr=nan", "peak_lr"),
    ("/api/simulate?peak_lr=-inf", "peak_lr"),
    ("/api/simulate?steps=100000000", "steps"),
    ("/api/simulate?steps=1.5", "steps"),
    ("/api/simulate?seed=-3", "seed"),
    ("/api/simulate?clip=maybe", "clip"),
    ("/api/simulate?spike_rate=1", "spike_rate"),
    ("/api/simulate?warmup_steps=20000", "warmup_steps"),
    ("/api/simulate?bogus=1", "bogus"),
    ("/api/simulate?seed=1&seed=2", "seed"),
    ("/api/simulate?seed=" + "9" * 40, "seed"),
    ("/api/clipping?c=0", "c"),
    ("/api/clipping?ranks=1000", "ranks"),
    ("/api/clipping?local=2", "local"),
    ("/api/clipping?start=-1", "start"),
])
def test_bad_parameters_get_a_400_naming_them(server, query, name):
    _, port, _ = server
    status, headers, body = raw_get(port, query)
    assert status == 400, (query, status, body)
    assert headers["content-type"].startswith("application/json")
    assert name in json.loads(body)["error"]


def test_foreign_host_header_is_refused(server):
    _, port, _ = server
    status, _, body = raw_get(port, "/api/simulate", headers={"Host": "attacker.example"})
    assert status == 400 and "Host header" in json.loads(body)["error"]
    assert raw_get(port, "/", headers={"Host": f"localhost:{port}"})[0] == 200


REAL_BAD = [
    ("steps=5000", "steps"),
    ("steps=10", "steps"),
    ("steps=1e3", "steps"),
    ("outlier_step=-1", "outlier_step"),
    ("steps=120&outlier_step=120", "outlier_step"),
    ("seed=-2", "seed"),
    ("seed=99999999999", "seed"),
    ("clip=maybe", "clip"),
    ("rollback=2", "rollback"),
    ("z_loss=0.5", "z_loss"),
    ("tier2=rollback", "tier2"),
    ("steps=100&steps=200", "steps"),
]


@pytest.mark.parametrize("query,name", REAL_BAD)
def test_real_mode_bad_parameters_get_a_400_naming_them(server, query, name):
    _, port, _ = server
    status, _, body = raw_request(port, "POST", "/api/real?" + query)
    assert status == 400, (query, status, body)
    assert name in json.loads(body)["error"]
    assert json.loads(raw_get(port, "/api/real")[2])["running"] is False  # nothing started


def sse_events(port: int, path: str, headers: dict | None = None) -> list[tuple[str, dict]]:
    """(event name, parsed data) of every event of a server-sent event stream, to its end."""
    status, head, body = raw_get(port, path, headers)
    assert status == 200 and head["content-type"].startswith("text/event-stream"), (status, body)
    events = []
    for block in body.decode().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line
                      and not line.startswith(":"))
        if "data" in fields:
            events.append((fields.get("event", "message"), json.loads(fields["data"])))
    return events


def test_real_mode_runs_one_at_a_time(server):
    """A second start while a run is going gets 409 with a message; other sites cannot start or
    stop runs; stopping ends the run's event stream with status "stopped"."""
    _, port, _ = server
    status, _, body = raw_request(port, "POST", "/api/real?steps=2000&outlier_step=10&seed=3")
    assert status == 202, body
    run = json.loads(body)
    assert run["running"] and run["config"]["steps"] == 2000 and run["config"]["seed"] == 3
    try:
        status, _, body = raw_request(port, "POST", "/api/real?steps=50&outlier_step=10")
        assert status == 409
        msg = json.loads(body)["error"]
        assert f"already running (run {run['run']}:" in msg and "of 2000 steps" in msg
        for headers in ({"Origin": "http://attacker.example"}, {"Sec-Fetch-Site": "cross-site"}):
            for path in ("/api/real?steps=50&outlier_step=10", "/api/real/stop"):
                status, _, body = raw_request(port, "POST", path, headers)
                assert status == 403 and "refused" in json.loads(body)["error"], (path, body)
        status, _, body = raw_get(port, f"/api/real/events?run={run['run'] + 1}")
        assert status == 404 and f"current run is {run['run']}" in json.loads(body)["error"]
        for bad in ("x", "%C2%B2", "1&run=2", "9" * 30):
            assert raw_get(port, f"/api/real/events?run={bad}")[0] == 400, bad
        current = json.loads(raw_get(port, "/api/real")[2])
        assert current["run"] == run["run"] and current["running"]
    finally:
        status, _, body = raw_request(port, "POST", "/api/real/stop",
                                      {"Origin": f"http://127.0.0.1:{port}"})
    assert status == 200 and json.loads(body)["running"] is False
    events = sse_events(port, run["events"])
    assert events[-1][0] == "end" and events[-1][1]["status"] == "stopped"
    assert {e for e, _ in events[:-1]} <= {"config", "message"}
    status, _, body = raw_request(port, "POST", "/api/real/stop")
    assert status == 409 and "no real run is running" in json.loads(body)["error"]


def test_simulate_endpoint_serves_the_python_simulation(server):
    _, port, _ = server
    status, _, body = raw_get(port, "/api/simulate?seed=5&clip=1&clip_c=0.8&warmup=on")
    assert status == 200
    got = json.loads(body)
    want = json.loads(json.dumps(simulate(SimConfig(seed=5, clip=True, clip_c=0.8,
                                                    warmup=True)).to_json()))
    assert got == want
    assert got["survived"] and len(got["loss"]) == 10_000


def test_benchmark_smoke(server, capsys):
    """benchmarks/bench_sandbox.py against this server: its share of the 50 ms target parses
    as a finite number (the latency itself is never asserted in tests)."""
    from benchmarks import bench_sandbox

    results = bench_sandbox.main(["--smoke", "--url", server[0]])
    out = capsys.readouterr().out
    shares = [float(x) for x in re.findall(r"share of 50 ms: (\S+)", out)]
    assert len(shares) == 10 and all(math.isfinite(s) and s > 0 for s in shares), out
    assert {f"{a}/{c}" for a in ("simulate", "encode", "http") for c in ("clip", "default")} \
        <= set(results)


def test_package_data_covers_every_page_file():
    """pyproject's package-data globs (relative to the package folder, as setuptools reads
    them) name every file the page serves, so a wheel has them."""
    tomllib = pytest.importorskip("tomllib")
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = cfg["tool"]["setuptools"]["package-data"]["spikeguard.sandbox"]
    pkg = ROOT / "src" / "spikeguard" / "sandbox"
    files = [p.relative_to(pkg).as_posix() for p in (pkg / "static").rglob("*") if p.is_file()]
    assert "static/vendor/uPlot.LICENSE" in files and "static/index.html" in files
    covered = {p.relative_to(pkg).as_posix() for g in globs for p in pkg.glob(g)}
    missing = sorted(set(files) - covered)
    assert not missing, f"add these to [tool.setuptools.package-data]: {missing}"

"""Latency of the sandbox's simulation endpoint: GET /api/simulate for a 10,000-step run.

The target is absolute (the page must answer a slider move in under 50 ms), so each arm prints
milliseconds and its share of 50 ms: wall-clock, and CPU time (``time.process_time`` in this
process; the server process's utime + stime from /proc for ``http``), which a shared, overloaded
machine inflates far less than wall-clock. Arms, each over the same configs:

- ``simulate``: ``simulate()`` alone, in this process;
- ``encode``: ``simulate()`` + ``to_json()`` + ``json.dumps`` (what the endpoint computes);
- ``http``: the whole request over HTTP/1.1 keep-alive to a real server: the CLI's
  ``python -m spikeguard sandbox --port 0`` in a subprocess, or ``--url`` to measure one that
  is already running.

Configs: ``clip`` (clipping on: the run survives, so all 10,000 steps are computed; the worst
case) and ``default`` (every defense off: the page's first view, which goes NaN early).

    PYTHONPATH=src:. python benchmarks/bench_sandbox.py            # 50 requests per config
    PYTHONPATH=src:. python benchmarks/bench_sandbox.py --smoke    # 3 requests per config
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlencode, urlsplit

from spikeguard.sandbox import SimConfig, simulate

__all__ = ["main"]

TARGET_MS = 50.0
CONFIGS = {"clip": {"clip": "1"}, "default": {}}
ROOT = Path(__file__).resolve().parents[1]


def _cpu_seconds(pid: int) -> float:
    """utime + stime of process ``pid`` (Linux /proc; NaN elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def _server() -> Iterator[tuple[str, int]]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen([sys.executable, "-m", "spikeguard", "sandbox", "--port", "0"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # "spikeguard sandbox: http://127.0.0.1:P/ ..."
        url = line.split()[2].rstrip("/")
        port = urlsplit(url).port
        for _ in range(600):
            with contextlib.suppress(OSError):
                http.client.HTTPConnection("127.0.0.1", port, timeout=1).connect()
                break
            time.sleep(0.05)
        yield url, proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        proc.stdout.close()


def _stats(name: str, config: str, ms: list[float], cpu_ms: float) -> float:
    med = statistics.median(ms)
    p95 = sorted(ms)[min(len(ms) - 1, int(0.95 * len(ms)))]
    cpu = (f"cpu {cpu_ms:6.2f} ms  cpu share of 50 ms: {cpu_ms / TARGET_MS:.3f}"
           if cpu_ms == cpu_ms else "cpu n/a (a server this run did not start)")
    print(f"{name:9s} {config:8s} wall median {med:7.2f} ms  p95 {p95:7.2f} ms  "
          f"share of 50 ms: {med / TARGET_MS:.3f}  |  {cpu}")
    return med


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="3 requests per config: checks it runs")
    p.add_argument("--reps", type=int, default=50, help="requests per config and arm")
    p.add_argument("--url", default=None, help="a running sandbox (default: start one)")
    args = p.parse_args(argv)
    reps = 3 if args.smoke else args.reps
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"bench_sandbox: {reps} requests per config, 10,000 steps, load average {load:.1f}")
    results: dict[str, float] = {}
    for config, query in CONFIGS.items():
        cfg = SimConfig(clip=query.get("clip") == "1")
        sim_ms, enc_ms, sim_cpu, enc_cpu = [], [], [], []
        for _ in range(reps):
            c0, t0 = time.process_time(), time.perf_counter()
            r = simulate(cfg)
            c1, t1 = time.process_time(), time.perf_counter()
            json.dumps(r.to_json())
            c2, t2 = time.process_time(), time.perf_counter()
            sim_ms.append(1e3 * (t1 - t0))
            enc_ms.append(1e3 * (t2 - t0))
            sim_cpu.append(1e3 * (c1 - c0))
            enc_cpu.append(1e3 * (c2 - c0))
        results[f"simulate/{config}"] = _stats("simulate", config, sim_ms,
                                               statistics.median(sim_cpu))
        results[f"encode/{config}"] = _stats("encode", config, enc_ms,
                                             statistics.median(enc_cpu))
    with contextlib.ExitStack() as stack:
        url, pid = (args.url, None) if args.url else stack.enter_context(_server())
        parts = urlsplit(url)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
        for config, query in CONFIGS.items():
            path = "/api/simulate?" + urlencode(query)
            ms = []
            cpu0 = float("nan")
            for i in range(reps + 1):
                if i == 1:  # the first request warms the connection
                    cpu0 = _cpu_seconds(pid) if pid else float("nan")
                t0 = time.perf_counter()
                conn.request("GET", path)
                resp = conn.getresponse()
                body = resp.read()
                if i:
                    ms.append(1e3 * (time.perf_counter() - t0))
                if resp.status != 200:
                    raise SystemExit(f"GET {path}: {resp.status} {body[:200]!r}")
            cpu = (_cpu_seconds(pid) - cpu0) * 1e3 / reps if pid else float("nan")
            results[f"http/{config}"] = _stats("http", config, ms, cpu)
            results[f"http_cpu/{config}"] = cpu
        conn.close()
    worst, cpu = results["http/clip"], results["http_cpu/clip"]
    verdict = "PASS" if worst < TARGET_MS else "FAIL"
    print(f"http 10,000-step surviving run: {worst:.2f} ms wall median (target < {TARGET_MS:g} "
          f"ms: {verdict}); server CPU {cpu:.2f} ms per request at load average {load:.1f}")
    return results


if __name__ == "__main__":
    main()

"""SpikeDetector throughput: 1M updates, printed as updates per second.

A later ``spikeguard diagnose`` replays the detector over whole logs, so it must stay cheap:
the target is 1M updates in under 5 s of CPU on the 2-core dev machine. The baseline, measured in the
same run and interleaved chunk by chunk, is the bare host RunningMedian (update + value) that any
grad-norm gate needs: the ratio says what the full triage costs on top of it.

    PYTHONPATH=src:. python benchmarks/bench_detector.py [--smoke]
    PYTHONPATH=src:. python benchmarks/bench_detector.py --against /path/to/other/checkout/src

``--against SRC`` runs the same benchmark on the spikeguard in SRC too (a subprocess, the
chunks of the two interleaved run by run) and prints the two side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from spikeguard.detector.detector import Action, SpikeDetector
from spikeguard.measure.stats import RunningMedian
from spikeguard.testing.scenarios import clean_run, data_anomaly, logit_drift

__all__ = ["main"]


def _stream(n: int, scenarios: bool = True) -> list:
    """A healthy run with the data-anomaly and logit-drift scenarios spliced in, cycled to ``n``."""
    base = clean_run(0, steps=min(n, 50_000)).metrics
    if scenarios:
        base += data_anomaly(0).metrics + logit_drift(0).metrics
    return (base * (n // len(base) + 1))[:n]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--updates", type=int, default=1_000_000)
    p.add_argument("--chunks", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="10k updates: checks it runs")
    p.add_argument("--against", metavar="SRC", help="also run on the spikeguard in SRC")
    p.add_argument("--json", action="store_true", help="print one JSON line of results")
    args = p.parse_args(argv)
    if args.against:
        return _side_by_side(args)
    if args.smoke:
        args.updates, args.chunks = 10_000, 2
    size = args.updates // args.chunks
    stream = _stream(size, scenarios=not args.smoke)
    detector = SpikeDetector()
    median = RunningMedian(detector.config.median_window)
    t_det, t_med, cpu, counts = [], [], [], dict.fromkeys(Action, 0)
    for _ in range(args.chunks):  # interleaved: both see the same machine load
        t0, c0 = time.perf_counter(), time.process_time()
        for m in stream:
            counts[detector.update(m).action] += 1
        t1 = time.perf_counter()
        cpu.append(time.process_time() - c0)
        for m in stream:
            median.update(m.grad_norm)
            _ = median.value
        t2 = time.perf_counter()
        t_det.append(t1 - t0)
        t_med.append(t2 - t1)
    total = sum(t_det)
    n = size * args.chunks
    if args.json:
        print(json.dumps({"updates": n, "wall_s": total, "cpu_s": sum(cpu),
                          "median_s": sum(t_med),
                          "actions": {a.value: c for a, c in counts.items()}}))
        return 0
    ratios = [d / m for d, m in zip(t_det, t_med)]
    print(f"detector: {n:,} updates in {total:.2f} s = {n / total:,.0f} updates/s "
          f"({1e6 * total / n:.1f} us/update); target: 1M in < 5 s of CPU")
    print(f"detector CPU time: {sum(cpu):.2f} s ({1e6 * sum(cpu) / n:.1f} us/update; wall "
          "exceeds it when other processes share the cores)")
    print(f"baseline RunningMedian(update+value): {n / sum(t_med):,.0f} updates/s")
    print(f"ratio detector / RunningMedian: median {statistics.median(ratios):.2f}x "
          f"(chunks: {min(ratios):.2f}-{max(ratios):.2f})")
    print("actions:", {a.value: c for a, c in counts.items()})
    return 0


def _side_by_side(args: argparse.Namespace) -> int:
    """This checkout and ``args.against``, each in a subprocess, alternately, ``args.chunks``
    times; per-chunk CPU seconds scaled to 1M updates."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    mine = os.path.join(here, "src")
    cmd = [sys.executable, os.path.abspath(__file__), "--json", "--chunks", "1",
           "--updates", str(args.updates // args.chunks)]
    runs: dict[str, list[dict]] = {"this": [], "against": []}
    for _ in range(args.chunks):
        for name, src in (("this", mine), ("against", args.against)):
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, here])}
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    scale = 1e6 / (args.updates // args.chunks)
    print(f"{'':10s} {'CPU s / 1M updates':>20s} {'wall s / 1M':>12s} {'RunningMedian s / 1M':>22s}")
    for name in ("against", "this"):
        cpu = statistics.median(r["cpu_s"] for r in runs[name]) * scale
        wall = statistics.median(r["wall_s"] for r in runs[name]) * scale
        med = statistics.median(r["median_s"] for r in runs[name]) * scale
        label = "before" if name == "against" else "after"
        print(f"{label:10s} {cpu:20.2f} {wall:12.2f} {med:22.2f}")
    before = statistics.median(r["cpu_s"] for r in runs["against"])
    after = statistics.median(r["cpu_s"] for r in runs["this"])
    print(f"speed-up (CPU): {before / after:.2f}x; actions before "
          f"{runs['against'][0]['actions']}, after {runs['this'][0]['actions']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""How many CPU threads `spikeguard train` should use: wall time of the same short run with
``--threads 1``, ``2`` and torch's default (``--threads 0``: one per core), interleaved round by
round so that the other jobs of a shared machine weigh on every arm alike, quiet and under a load
of ``--load K`` busy Python processes started by this script. Prints each run's seconds with the
load average beside it, then the median per arm and its ratio to torch's default.

    PYTHONPATH=src:. python benchmarks/bench_threads.py --steps 60 --rounds 3 --load 0 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(threads: int, steps: int, model: str, out: Path) -> float:
    cmd = [sys.executable, "-m", "spikeguard", "train", "--model", model, "--steps", str(steps),
           "--threads", str(threads), "--no-progress", "--no-plot", "--eval-batches", "1",
           "--fresh", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    start = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--model", default="demo", choices=("tiny", "demo", "bench"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--arms", type=int, nargs="+", default=[1, 2, 0],
                    help="--threads values; 0 is torch's default (one per core)")
    ap.add_argument("--load", type=int, nargs="+", default=[0, 2],
                    help="busy processes beside the runs, one block of rounds each")
    a = ap.parse_args()
    print(f"cores {os.cpu_count()}; spikeguard train --model {a.model} --steps {a.steps}")
    for load in a.load:
        hogs = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(load)]
        try:
            time.sleep(2 if load else 0)
            times: dict[int, list[float]] = {t: [] for t in a.arms}
            with tempfile.TemporaryDirectory() as tmp:
                for r in range(a.rounds):
                    arms = a.arms if r % 2 == 0 else a.arms[::-1]  # ABC CBA: drift cancels
                    for t in arms:
                        before = os.getloadavg()[0]
                        s = _run(t, a.steps, a.model, Path(tmp) / f"t{t}")
                        times[t].append(s)
                        print(f"  load {load}: round {r} --threads {t}: {s:6.1f} s "
                              f"(load avg {before:.1f} -> {os.getloadavg()[0]:.1f})", flush=True)
        finally:
            for h in hogs:
                h.kill()
                h.wait()
        base = statistics.median(times[0]) if 0 in times else None
        for t in a.arms:
            med = statistics.median(times[t])
            ratio = f"  {med / base:.2f}x torch's default" if base else ""
            print(f"load {load}: --threads {t}: median {med:6.1f} s{ratio}")


if __name__ == "__main__":
    main()

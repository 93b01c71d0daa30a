"""Losses: time and peak memory of spikeguard's losses against torch's, each variant in its own
subprocess so its peak RSS can be read, rounds interleaved, medians reported.

1. cross_entropy with z-loss and log Z vs F.cross_entropy alone (fwd + bwd), plus the naive way
   to add z-loss (a second logsumexp over the logits). Issue target: time <= 1.10x.
2. linear_cross_entropy vs torch.nn.functional.linear_cross_entropy with options=None (its
   reference path, i.e. the naive matmul + cross-entropy), plus torch's chunked path
   (LinearCrossEntropyOptions()). Targets: time <= 1.1x, peak memory above the inputs <= 0.25x.
   Also reduction="none" (per-token losses; backward recomputes the logits: one matmul more).

Each table is followed by one line per variant, "time ratio VARIANT / BASELINE: R", which the
smoke test parses (the memory column is n/a with --smoke, which runs in-process).

    PYTHONPATH=src:. python benchmarks/bench_losses.py            # full size (needs ~20 GB free)
    PYTHONPATH=src:. python benchmarks/bench_losses.py --ce-v 32768   # CE at V=32k
    PYTHONPATH=src:. python benchmarks/bench_losses.py --smoke    # tiny, in-process, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

__all__ = ["lce_variants", "main"]

CE_VARIANTS = ("F.cross_entropy", "sg.cross_entropy", "F.cross_entropy+logsumexp z-loss")
LCE_VARIANTS = ("F.linear_cross_entropy(options=None)", "sg.linear_cross_entropy",
                "F.linear_cross_entropy(LinearCrossEntropyOptions())",
                "sg.linear_cross_entropy(reduction='none')")


def lce_variants() -> tuple[str, ...]:
    """LCE_VARIANTS this torch can run: F.linear_cross_entropy is new (absent from torch 2.11,
    the GPU machine's); without it sg.linear_cross_entropy is the baseline."""
    import torch.nn.functional as F

    if hasattr(F, "linear_cross_entropy"):
        return LCE_VARIANTS
    return tuple(v for v in LCE_VARIANTS if not v.startswith("F."))


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _ce_step(variant: str, x, t):
    import torch
    import torch.nn.functional as F

    import spikeguard as sg

    if variant == "F.cross_entropy":
        loss = F.cross_entropy(x, t)
        loss.backward()
        return float(loss.detach()), None
    if variant == "sg.cross_entropy":
        out = sg.cross_entropy(x, t, z_loss=1e-4)
        out.loss.backward()
        return float(out.ce), float(out.log_z)
    ce = F.cross_entropy(x, t)
    lse = torch.logsumexp(x, dim=-1)
    (ce + 1e-4 * lse.square().mean()).backward()
    return float(ce.detach()), float(lse.detach().mean())


def _lce_step(variant: str, h, w, t):
    import torch
    import torch.nn.functional as F

    import spikeguard as sg

    if variant == "sg.linear_cross_entropy":
        out = sg.linear_cross_entropy(h, w, t, z_loss=1e-4)
        out.loss.backward()
        return float(out.ce), float(out.log_z)
    if variant == "sg.linear_cross_entropy(reduction='none')":
        out = sg.linear_cross_entropy(h, w, t, z_loss=1e-4, reduction="none")
        out.loss.mean().backward()
        return float(out.ce.mean()), float(out.log_z.mean())
    options = None if variant.endswith("(options=None)") else torch.nn.LinearCrossEntropyOptions()
    loss = F.linear_cross_entropy(h, w, t, options=options)
    loss.backward()
    return float(loss.detach()), None


def _measure(args: argparse.Namespace) -> dict:
    """One variant: build inputs, warm up on a slice, time full-size fwd+bwd calls."""
    import torch

    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    t = torch.randint(0, args.v, (args.n,), generator=gen)
    if args.group == "ce":
        x = (torch.randn(args.n, args.v, generator=gen) * 2).requires_grad_()
        inputs = (x,)

        def step(rows=None):
            xs = x if rows is None else x[:rows].detach().requires_grad_()
            return _ce_step(args.variant, xs, t[: xs.shape[0]])
    else:
        h = torch.randn(args.n, args.h, generator=gen).requires_grad_()
        w = (torch.randn(args.v, args.h, generator=gen) * args.h**-0.5).requires_grad_()
        inputs = (h, w)

        def step(rows=None):
            hs = h if rows is None else h[:rows].detach().requires_grad_()
            return _lce_step(args.variant, hs, w, t[: hs.shape[0]])
    step(rows=min(8, args.n))  # load kernels on a slice; the full-size timed call stays cold
    for p in inputs:
        p.grad = None
    base = _rss_bytes()
    times = []
    for _ in range(args.iters):
        start = time.perf_counter()
        ce, log_z = step()
        times.append(time.perf_counter() - start)
        for p in inputs:
            p.grad = None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"time": statistics.median(times), "peak_above_inputs": peak - base, "ce": ce,
            "log_z": log_z}


def _run_variant(group: str, variant: str, n: int, v: int, h: int, iters: int, threads: int,
                 in_process: bool) -> dict:
    if in_process:  # --smoke: no subprocess start-up; the peak RSS column is then meaningless
        return _measure(argparse.Namespace(group=group, variant=variant, n=n, v=v, h=h,
                                           iters=iters, threads=threads))
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", group, "--variant", variant,
           "--n", str(n), "--v", str(v), "--h", str(h), "--iters", str(iters),
           "--threads", str(threads)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"{variant} failed (rc={res.returncode}):\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _bench(group: str, variants: tuple[str, ...], *, n: int, v: int, h: int, rounds: int,
           iters: int, threads: int, in_process: bool = False) -> dict[str, dict]:
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    for _ in range(rounds):  # interleaved: one subprocess per variant per round
        for name in variants:
            runs[name].append(_run_variant(group, name, n, v, h, iters, threads, in_process))
    base = variants[0]
    t0 = statistics.median(r["time"] for r in runs[base])
    m0 = statistics.median(r["peak_above_inputs"] for r in runs[base])
    shape = f"N={n}, V={v}" + (f", H={h}" if group == "lce" else "")
    print(f"\n{group}: {shape}, threads={threads}, {rounds} rounds x {iters} iters (fwd+bwd)")
    print(f"{'variant':<52} {'time s':>8} {'x base':>7} {'peak GiB':>9} {'x base':>7}  ce")
    summary = {}
    for name in variants:
        t = statistics.median(r["time"] for r in runs[name])
        m = statistics.median(r["peak_above_inputs"] for r in runs[name])
        ce = runs[name][-1]["ce"]
        # in-process (--smoke) the RSS peak belongs to the whole process: no per-variant memory
        mem_ratio = float("nan") if in_process else m / m0
        summary[name] = {"time_ratio": t / t0, "mem_ratio": mem_ratio}
        mem = f"{'n/a':>9} {'n/a':>7}" if in_process else f"{m / 2**30:9.3f} {mem_ratio:7.2f}"
        print(f"{name:<52} {t:8.3f} {t / t0:7.2f} {mem}  {ce:.5f}")
    for name in variants:
        print(f"time ratio {name} / {base}: {summary[name]['time_ratio']:.4f}")
    return summary


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one round")
    ap.add_argument("--ce-n", type=int, default=8192)
    ap.add_argument("--ce-v", type=int, default=131072)
    ap.add_argument("--lce-n", type=int, default=2048)
    ap.add_argument("--lce-h", type=int, default=512)
    ap.add_argument("--lce-v", type=int, default=131072)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=2, help="timed calls per subprocess (median)")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("BENCH_THREADS", "0"))
                    or os.cpu_count() or 1)
    ap.add_argument("--only", choices=("ce", "lce"), default=None)
    ap.add_argument("--worker", choices=("ce", "lce"), help=argparse.SUPPRESS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--v", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--h", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        args.group = args.worker
        print(json.dumps(_measure(args)))
        return
    if args.smoke:
        args.ce_n, args.ce_v, args.lce_n, args.lce_h, args.lce_v = 64, 1024, 64, 32, 1024
        args.rounds, args.iters = 1, 1
    if args.only in (None, "ce"):
        _bench("ce", CE_VARIANTS, n=args.ce_n, v=args.ce_v, h=0, rounds=args.rounds,
               iters=args.iters, threads=args.threads, in_process=args.smoke)
    if args.only in (None, "lce"):
        variants = lce_variants()
        if variants != LCE_VARIANTS:
            import torch

            print(f"torch {torch.__version__} has no F.linear_cross_entropy: its rows are left out")
        _bench("lce", variants, n=args.lce_n, v=args.lce_v, h=args.lce_h,
               rounds=args.rounds, iters=args.iters, threads=args.threads, in_process=args.smoke)


if __name__ == "__main__":
    main()

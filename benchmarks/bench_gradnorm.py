"""grad_stats + clip vs torch.nn.utils.clip_grad_norm_(foreach=True), one process.

~100M fp32 gradient elements in ~300 tensors of mixed sizes (about 800 MB with the parameters).
The two are timed alternately in the same process, 20 runs each after a warm-up; the ratio of
medians is the result (target <= 1.10x). A single _foreach_norm pass is printed for scale.
``--norm-type`` other than 2 times ``sg.clip_grad_norm_`` on its exact path against torch's
function with the same norm type instead.

    PYTHONPATH=src:. python benchmarks/bench_gradnorm.py [--smoke] [--norm-type inf]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import spikeguard as sg

__all__ = ["main", "make_params"]


def make_params(total: int, count: int, seed: int = 0) -> list[torch.nn.Parameter]:
    """``count`` parameters whose sizes (a 1:10 spread) add up to about ``total`` elements,
    each with a random gradient."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.rand(count, generator=g) * 9 + 1
    sizes = (weights / weights.sum() * total).long().clamp(min=1).tolist()
    params = []
    for n in sizes:
        p = torch.nn.Parameter(torch.empty(n))
        p.grad = torch.randn(n, generator=g) * 1e-4
        params.append(p)
    return params


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="1M elements, 3 runs: a quick check")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads; 1 by default because on a shared 2-core machine "
                         "multi-threaded kernels stall for whole seconds when a core is taken")
    ap.add_argument("--norm-type", type=float, default=2.0,
                    help="2 (default): grad_stats + clip_; otherwise sg.clip_grad_norm_")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    total, count, runs = (1_000_000, 30, 3) if args.smoke else (100_000_000, 300, 20)
    params = make_params(total, count)
    grads = [p.grad for p in params]

    p = args.norm_type

    def ours() -> None:
        if p == 2.0:
            sg.grad_stats(params).clip_(1.0)
        else:
            sg.clip_grad_norm_(params, 1.0, p)

    def theirs() -> None:
        torch.nn.utils.clip_grad_norm_(params, 1.0, p, foreach=True)

    def norm_only() -> None:
        torch._foreach_norm(grads, p)

    for fn in (ours, theirs, norm_only):  # warm-up
        fn()
    times: dict[str, list[float]] = {"ours": [], "torch": [], "foreach_norm": []}
    for _ in range(runs):
        times["ours"].append(_time(ours))
        times["torch"].append(_time(theirs))
        times["foreach_norm"].append(_time(norm_only))
    med = {k: statistics.median(v) for k, v in times.items()}
    n = sum(g.numel() for g in grads)
    print(f"{n / 1e6:.1f}M elements in {len(grads)} tensors, {args.threads} thread(s), "
          f"median of {runs} alternating runs")
    for k, v in med.items():
        print(f"  {k:13s} {v * 1e3:8.2f} ms")
    ours_name = "grad_stats+clip" if p == 2.0 else f"clip_grad_norm_(norm_type={p:g})"
    print(f"ratio {ours_name} / torch clip_grad_norm_(foreach=True): "
          f"{med['ours'] / med['torch']:.3f}x")


if __name__ == "__main__":
    main()

"""Checks that need a CUDA GPU; on a machine without one it says so and exits 0.

Each check is a function returning (passed, detail); add yours to CHECKS.

- flex_softcap_speed: soft-capped flex_attention (cap 50, causal) fwd+bwd at >= 0.9 of the
  throughput of uncapped flex_attention (causal), bf16, interleaved runs;
- flex_softcap_matches_eager: the capped flex output and gradients equal the eager fp32 path.

    PYTHONPATH=src:. python benchmarks/gpu_check.py [--smoke]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable

import torch

import spikeguard as sg

__all__ = ["CHECKS", "flex_softcap_matches_eager", "flex_softcap_speed", "main"]


def _qkv(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(shape, device="cuda", dtype=dtype, generator=gen).mul_(2).requires_grad_()
            for _ in range(3)]


def _cuda_medians(cases: dict[str, Callable[[], None]], reps: int, warmup: int = 3) -> dict[str, float]:
    for _ in range(warmup):  # the first calls compile
        for fn in cases.values():
            fn()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(reps):
        for name, fn in cases.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end))
    return {name: statistics.median(ts) for name, ts in times.items()}


def flex_softcap_speed(smoke: bool = False) -> tuple[bool, str]:
    shape = (2, 4, 256, 64) if smoke else (8, 16, 2048, 128)
    q, k, v = _qkv(shape, torch.bfloat16)
    grad = torch.randn_like(q)

    def case(cap: float | None, backend: str) -> Callable[[], None]:
        def run() -> None:
            out = sg.attention(q, k, v, causal=True, softcap=cap, backend=backend)
            torch.autograd.grad(out, (q, k, v), grad)
        return run

    ms = _cuda_medians({"flex capped": case(50.0, "flex"), "flex uncapped": case(None, "flex"),
                        "sdpa uncapped": case(None, "sdpa")}, reps=5 if smoke else 20)
    ratio = ms["flex uncapped"] / ms["flex capped"]
    detail = (f"shape {shape} bf16 fwd+bwd: flex capped {ms['flex capped']:.3f} ms, flex uncapped "
              f"{ms['flex uncapped']:.3f} ms, sdpa uncapped {ms['sdpa uncapped']:.3f} ms; "
              f"capped/uncapped flex throughput {ratio:.3f} (target >= 0.9), "
              f"vs sdpa {ms['sdpa uncapped'] / ms['flex capped']:.3f}")
    return ratio >= 0.9, detail


def flex_softcap_matches_eager(smoke: bool = False) -> tuple[bool, str]:
    q, k, v = _qkv((2, 4, 256, 64), torch.float32, seed=1)
    grad = torch.randn_like(q)
    out_f = sg.attention(q, k, v, softcap=5.0, backend="flex")
    gf = torch.autograd.grad(out_f, (q, k, v), grad)
    out_e = sg.attention(q, k, v, softcap=5.0, backend="eager")
    ge = torch.autograd.grad(out_e, (q, k, v), grad)
    errs = [float((a - b).abs().max()) for a, b in zip((out_f, *gf), (out_e, *ge))]
    return max(errs) < 1e-3, f"fp32 max |flex - eager| over out, dq, dk, dv: {max(errs):.2e} (< 1e-3)"


CHECKS: dict[str, Callable[[bool], tuple[bool, str]]] = {
    "flex_softcap_speed": flex_softcap_speed,
    "flex_softcap_matches_eager": flex_softcap_matches_eager,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="small shapes, few repetitions")
    ap.add_argument("--only", nargs="*", default=None, help="run only these checks")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; skipping every GPU check")
        return 0
    print(f"gpu_check on {torch.cuda.get_device_name()} (torch {torch.__version__})")
    failed = 0
    for name, check in CHECKS.items():
        if args.only is not None and name not in args.only:
            continue
        try:
            ok, detail = check(args.smoke)
        except Exception as exc:  # report every check, even when one breaks
            ok, detail = False, f"raised {type(exc).__name__}: {exc}"
        failed += not ok
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

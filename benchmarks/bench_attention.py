"""Cost of bounding the attention logits, as ratios from interleaved runs in one process.

1. attention fwd+bwd at GPTConfig.bench() shapes (6 heads x 64, T = 256): the capped eager path
   (cap 50) against the same eager path uncapped, and against SDPA uncapped; and the capped eager
   path with grouped-query heads (half as many K/V heads) against the same with all heads;
2. one bench training step (forward, backward, AdamW) with QK-norm against without.

Ratios are throughput ratios (baseline time / candidate time): 1.0 means free, 0.5 half speed.

    PYTHONPATH=src:. python benchmarks/bench_attention.py [--smoke] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import spikeguard as sg
from spikeguard.prevent.attention import attention

__all__ = ["interleaved_medians", "main"]


def interleaved_medians(cases: dict[str, Callable[[], None]], reps: int, warmup: int = 2
                        ) -> dict[str, float]:
    """Median seconds per case, running the cases round-robin so machine noise hits all alike."""
    for _ in range(warmup):
        for fn in cases.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(reps):
        for name, fn in cases.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _attention_cases(cfg: sg.GPTConfig, batch: int) -> dict[str, Callable[[], None]]:
    gen = torch.Generator().manual_seed(0)
    shape = (batch, cfg.n_head, cfg.seq_len, cfg.head_dim)
    q, k, v = (torch.randn(shape, generator=gen).requires_grad_() for _ in range(3))
    grad = torch.randn(shape, generator=gen)
    h_kv = max(1, cfg.n_head // 2)  # GQA: each K/V head serves two query heads (if H is even)
    k_g, v_g = (x[:, :h_kv].detach().clone().requires_grad_() for x in (k, v))

    def case(cap: float | None, backend: str, kv=(k, v)) -> Callable[[], None]:
        def run() -> None:
            out = attention(q, *kv, causal=True, softcap=cap, backend=backend)
            torch.autograd.grad(out, (q, *kv), grad)
        return run

    return {"eager capped 50": case(50.0, "eager"), "eager uncapped": case(None, "eager"),
            "sdpa uncapped": case(None, "sdpa"), "eager capped gqa": case(50.0, "eager", (k_g, v_g))}


def _step_case(cfg: sg.GPTConfig, batch: int) -> Callable[[], None]:
    torch.manual_seed(0)
    model = sg.GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=gen)
    x, y = idx[:, :-1], idx[:, 1:]

    def run() -> None:
        out = model.loss(model(x), y)
        loss = getattr(out, "loss", out)  # a LossOutput once GPT.loss returns one
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return run


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, few repetitions")
    ap.add_argument("--reps", type=int, default=15, help="interleaved repetitions per case")
    ap.add_argument("--batch", type=int, default=8, help="sequences per batch")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg, batch, reps = sg.GPTConfig.bench(), args.batch, args.reps
    if args.smoke:
        cfg, batch, reps = sg.GPTConfig.tiny(), 2, 3
    print(f"shapes: batch {batch}, {cfg.n_head} heads x {cfg.head_dim}, T = {cfg.seq_len}, "
          f"{cfg.n_layer} layers, d = {cfg.d_model}; {torch.get_num_threads()} threads, {reps} reps")

    att = interleaved_medians(_attention_cases(cfg, batch), reps)
    results = {
        "capped_vs_eager_uncapped": att["eager uncapped"] / att["eager capped 50"],
        "capped_vs_sdpa_uncapped": att["sdpa uncapped"] / att["eager capped 50"],
        "gqa_vs_mha_capped": att["eager capped 50"] / att["eager capped gqa"],
    }
    for name, sec in att.items():
        print(f"  attention fwd+bwd {name:<16} {sec * 1e3:8.2f} ms")
    print(f"capped eager vs uncapped eager: {results['capped_vs_eager_uncapped']:.3f} (target >= 0.75)")
    print(f"capped eager vs uncapped SDPA:  {results['capped_vs_sdpa_uncapped']:.3f}")
    print(f"capped eager GQA vs capped eager MHA: {results['gqa_vs_mha_capped']:.3f} "
          f"({cfg.n_head} query heads on {max(1, cfg.n_head // 2)} K/V heads)")

    steps = interleaved_medians({"plain": _step_case(cfg, batch),
                                 "qk_norm": _step_case(sg.GPTConfig(**{**vars(cfg), "qk_norm": True}), batch)},
                                max(3, reps // 3), warmup=1)
    results["qk_norm_step_ratio"] = steps["plain"] / steps["qk_norm"]
    print(f"  training step plain {steps['plain'] * 1e3:8.1f} ms, qk_norm {steps['qk_norm'] * 1e3:8.1f} ms")
    print(f"QK-norm training step vs plain: {results['qk_norm_step_ratio']:.3f} "
          f"({(1 / results['qk_norm_step_ratio'] - 1) * 100:+.1f}% time)")
    return results


if __name__ == "__main__":
    main()

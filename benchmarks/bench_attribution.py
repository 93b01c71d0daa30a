"""What attribution costs a healthy step: the per-sequence values of the loss and the guard's
bookkeeping of them, on GPTConfig.bench() training steps.

Three guarded arms take turns step by step (rotating order). ``plain`` and ``plain2`` take the
loss with ``per_sequence=False`` and call ``guard.step(out)``: the A/A pair whose difference is the
noise floor. ``attr`` takes the loss as the README's loop does (``per_sequence=True``, the GPT's
default) and calls ``guard.step(out, rerun=...)`` with the attribution on (its default). Whole-step
ratios on this machine move +-10% run to run, so the target is measured inside our code:

- inside Guard.step: (median time of attr's guard.step - median of the plain arms') / median
  plain step, target <= 1%, beside the same number for plain2 against plain (A/A);
- inside the loss: the per-sequence reduction itself (``_sequences`` on the step's per-token
  values, timed alone over many calls) / median plain step.

    PYTHONPATH=src:. python benchmarks/bench_attribution.py            # 30 bench() steps per arm
    PYTHONPATH=src:. python benchmarks/bench_attribution.py --smoke    # tiny model, a few steps
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import spikeguard as sg
from spikeguard.prevent.losses import LossOutput, _sequences

__all__ = ["main"]


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny model, 4 steps: checks it runs")
    p.add_argument("--steps", type=int, default=30, help="measured steps per arm")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=1, help="CPU threads (1 keeps timings steady)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    steps, warmup = (4, 1) if args.smoke else (args.steps, 3)
    cfg = sg.GPTConfig.tiny() if args.smoke else sg.GPTConfig.bench()
    gen = torch.Generator().manual_seed(0)

    def setup(name: str):
        torch.manual_seed(0)
        model = sg.GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, sg.schedules.warmup_cosine(warmup_steps=5, total_steps=10_000))
        attribution = sg.AttributionConfig(rerun=name == "attr")
        guard = sg.Guard(model, opt, scheduler=sched, config=sg.GuardConfig(
            detector=sg.DetectorConfig(arm_after=2), attribution=attribution))
        return model, guard

    arms = {name: setup(name) for name in ("plain", "plain2", "attr")}
    times: dict[str, list[float]] = {a: [] for a in arms}
    inside: dict[str, list[float]] = {a: [] for a in arms}

    def step(arm: str, record: bool) -> None:
        model, guard = arms[arm]
        x = torch.randint(0, cfg.vocab_size, (args.batch_size, cfg.seq_len + 1), generator=gen)
        per_sequence = arm == "attr"
        t0 = time.perf_counter()
        out = model.loss(model(x[:, :-1]), x[:, 1:], per_sequence=per_sequence)
        out.loss.backward()

        def rerun(keep: torch.Tensor | None = None) -> LossOutput:
            xs = x if keep is None else x[keep]
            o = model.loss(model(xs[:, :-1]), xs[:, 1:])
            o.loss.backward()
            return o

        t1 = time.perf_counter()
        (v,) = guard.step(out, rerun=rerun if per_sequence else None)
        t2 = time.perf_counter()
        assert not v.skip, "a healthy step was skipped: the benchmark is void"
        if record:
            times[arm].append(t2 - t0)
            inside[arm].append(t2 - t1)

    names = list(arms)
    for r in range(warmup + steps):
        for arm in names[r % 3:] + names[: r % 3]:
            step(arm, record=r >= warmup)
    for _, guard in arms.values():
        guard.close()

    med = {a: statistics.median(t) for a, t in times.items()}
    ins = {a: statistics.median(t) for a, t in inside.items()}
    base_step = statistics.median(times["plain"] + times["plain2"])
    base_inside = statistics.median(inside["plain"] + inside["plain2"])
    share = (ins["attr"] - base_inside) / base_step
    aa = (ins["plain2"] - ins["plain"]) / base_step

    # the per-sequence reduction alone, on the per-token values of one step's loss
    n = args.batch_size * cfg.seq_len
    ce, lse = torch.rand(n), torch.rand(n) + 5.0
    mask = torch.ones(n, dtype=torch.bool)
    reps = 20 if args.smoke else 500
    for _ in range(10):
        _sequences(ce, lse, mask, (args.batch_size, cfg.seq_len))
    t0 = time.perf_counter()
    for _ in range(reps):
        _sequences(ce, lse, mask, (args.batch_size, cfg.seq_len))
    reduce_share = (time.perf_counter() - t0) / reps / base_step

    print(f"\n{cfg.n_layer} layers d={cfg.d_model} T={cfg.seq_len} batch {args.batch_size}, fused "
          f"AdamW, {torch.get_num_threads()} CPU thread(s); {steps} interleaved steps per arm")
    for a in names:
        print(f"  {a:6s} median step {med[a] * 1e3:9.2f} ms   inside guard.step "
              f"{ins[a] * 1e3:8.3f} ms")
    print(f"  attribution inside guard.step / median step: {share:.3%} "
          f"(target <= 1%: {'PASS' if share <= 0.01 else 'FAIL'}); A/A plain2-plain {aa:.3%}")
    print(f"  per-sequence reduction in the loss / median step: {reduce_share:.3%}")
    print(f"  step ratio attr/plain {med['attr'] / med['plain']:.4f}   A/A plain2/plain "
          f"{med['plain2'] / med['plain']:.4f}")
    return {"share": share, "aa": aa, "reduce_share": reduce_share,
            "ratio": med["attr"] / med["plain"], "aa_ratio": med["plain2"] / med["plain"]}


if __name__ == "__main__":
    main()

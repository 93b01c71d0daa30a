"""Overhead of Guard.step on GPTConfig.bench() training steps, beyond what a plain loop pays.

Three arms take turns step by step (rotating order): ``base`` and ``base2`` are the plain loop
(forward, backward, torch's clip_grad_norm_, fused AdamW step, scheduler step, zero_grad: the
A/A pair whose difference is the noise floor), ``guard`` replaces the last four with
``guard.step(out)``. The target is measured inside the step, because whole-step ratios on this
machine move +-10% run to run: (median time inside guard.step - median time of the plain
loop's clip + step + schedule + zero_grad) / median base step, target <= 2%. The interleaved
step ratios guard/base and base2/base are printed beside it.

    PYTHONPATH=src:. python benchmarks/bench_guard.py                  # 30 bench() steps per arm
    PYTHONPATH=src:. python benchmarks/bench_guard.py --probes --checkpoint-every 10
    PYTHONPATH=src:. python benchmarks/bench_guard.py --no-signals     # probes=False
    PYTHONPATH=src:. python benchmarks/bench_guard.py --update-bound 3  # the update bound on
    PYTHONPATH=src:. python benchmarks/bench_guard.py --smoke          # tiny model, a few steps
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

import spikeguard as sg
from spikeguard.prevent.clipping import ClipConfig

__all__ = ["main"]


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny model, 4 steps: checks it runs")
    p.add_argument("--steps", type=int, default=30, help="measured steps per arm")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="CPU threads (1 keeps timings steady)")
    p.add_argument("--probes", action="store_true", help="turn every probe of the guard on")
    p.add_argument("--no-signals", action="store_true",
                   help="build the guard with probes=False (no signals either: the old default)")
    p.add_argument("--checkpoint-every", type=int, default=0, help="checkpoint interval (0: off)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (inductor)")
    p.add_argument("--tokens", action="store_true",
                   help="pass guard.step(tokens=x): the input-token check on (guard/tokens.py)")
    p.add_argument("--update-bound", type=float, default=0.0,
                   help="the guard arm's ClipConfig.update_bound (0: off, the default)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    steps, warmup = (4, 1) if args.smoke else (args.steps, 3)
    cfg = sg.GPTConfig.tiny() if args.smoke else sg.GPTConfig.bench()
    gen = torch.Generator().manual_seed(0)

    def setup():
        torch.manual_seed(0)
        model = sg.GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, sg.schedules.warmup_cosine(warmup_steps=5, total_steps=10_000))
        fwd = torch.compile(model) if args.compile else model
        return model, fwd, opt, sched

    arms = {name: setup() for name in ("base", "base2", "guard")}
    model, _, opt, sched = arms["guard"]
    ckpt = (sg.CheckpointManager(tempfile.mkdtemp(prefix="bench_guard_"),
                                 every=args.checkpoint_every, keep=2)
            if args.checkpoint_every else None)
    probes = True if args.probes else False if args.no_signals else None  # None: the signals
    guard = sg.Guard(model, opt, scheduler=sched, checkpoints=ckpt, probes=probes,
                     config=sg.GuardConfig(detector=sg.DetectorConfig(arm_after=2),
                                           clipping=ClipConfig(update_bound=args.update_bound)))
    times: dict[str, list[float]] = {a: [] for a in arms}
    tails: dict[str, list[float]] = {a: [] for a in arms}

    def step(arm: str, record: bool) -> None:
        model, fwd, opt, sched = arms[arm]
        x = torch.randint(0, cfg.vocab_size, (args.batch_size, cfg.seq_len + 1), generator=gen)
        t0 = time.perf_counter()
        out = model.loss(fwd(x[:, :-1]), x[:, 1:])
        out.loss.backward()
        t1 = time.perf_counter()
        if arm == "guard":
            guard.step(out, tokens=x[:, :-1] if args.tokens else None)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        if record:
            times[arm].append(t2 - t0)
            tails[arm].append(t2 - t1)

    names = list(arms)
    for r in range(warmup + steps):
        for arm in names[r % 3:] + names[: r % 3]:
            step(arm, record=r >= warmup)
    guard.close()

    med = {a: statistics.median(t) for a, t in times.items()}
    tail = {a: statistics.median(t) for a, t in tails.items()}
    base_tail = statistics.median(tails["base"] + tails["base2"])
    share = (tail["guard"] - base_tail) / med["base"]
    print(f"\n{cfg.n_layer} layers d={cfg.d_model} T={cfg.seq_len} batch {args.batch_size}, fused "
          f"AdamW, {torch.get_num_threads()} CPU thread(s); {steps} interleaved steps per arm; "
          f"probes {'on' if args.probes else 'off' if args.no_signals else 'signals only'}, "
          f"checkpoints "
          f"{f'every {args.checkpoint_every}' if args.checkpoint_every else 'off'}"
          f"{', compiled' if args.compile else ''}"
          f"{f', update bound {args.update_bound:g}' if args.update_bound else ''}"
          f"{', tokens checked' if args.tokens else ''}")
    for a in names:
        print(f"  {a:6s} median step {med[a] * 1e3:9.2f} ms   after backward {tail[a] * 1e3:8.2f} ms")
    print(f"  guard.step beyond clip+step+schedule / median step: {share:.3%} "
          f"(target <= 2%: {'PASS' if share <= 0.02 else 'FAIL'})")
    print(f"  step ratio guard/base {med['guard'] / med['base']:.4f}   A/A base2/base "
          f"{med['base2'] / med['base']:.4f}")
    return {"share": share, "ratio": med["guard"] / med["base"], "aa": med["base2"] / med["base"]}


if __name__ == "__main__":
    main()

"""Probe overhead on GPTConfig.bench() training steps (CPU).

Arms, interleaved run by run: no probes (baseline, twice: the A/A pair shows the noise),
probes at their default intervals, and every probe on every step. Prints the median step
time of each arm and the ratios to the baseline; the target is <= 1.03 at the default intervals.
It also prints the time of one ``layer_grad_norms`` call as a share of the fwd+bwd step it
follows (timed interleaved: robust to load, unlike the step ratios).

    PYTHONPATH=src:. python benchmarks/bench_probes.py            # 5 runs x 30 steps, 1 thread
    PYTHONPATH=src:. python benchmarks/bench_probes.py --smoke    # a quick check that it runs
    PYTHONPATH=src:. python benchmarks/bench_probes.py --share-only  # the grad-norm probe's share
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import spikeguard as sg
from spikeguard.measure.probes import ProbeConfig, Probes, layer_grad_norms


def run_arm(config: ProbeConfig | None, *, steps: int, batch: int, model_cfg: sg.GPTConfig) -> float:
    torch.manual_seed(0)
    model = sg.GPT(model_cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    probes = Probes(model, config) if config is not None else None
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, model_cfg.vocab_size, (batch, model_cfg.seq_len), generator=gen)
    y = torch.randint(0, model_cfg.vocab_size, (batch, model_cfg.seq_len), generator=gen)
    times = []
    for step in range(steps + 2):  # two warm-up steps, not timed
        t0 = time.perf_counter()
        if probes:
            probes.start_step(step)
        loss = model.loss(model(x), y).loss
        loss.backward()
        if probes:
            probes.collect()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step >= 2:
            times.append(time.perf_counter() - t0)
    if probes:
        probes.remove()
    return statistics.median(times)


def grad_norms_share(*, reps: int, batch: int, model_cfg: sg.GPTConfig) -> tuple[float, float]:
    """Median time of ``layer_grad_norms`` and of the fwd+bwd it follows, interleaved: the probe's
    own cost as a share of a step, which load on the machine affects alike."""
    torch.manual_seed(0)
    model = sg.GPT(model_cfg)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, model_cfg.vocab_size, (batch, model_cfg.seq_len), generator=gen)
    step_t, probe_t = [], []
    for i in range(reps + 1):  # the first round warms up
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        model.loss(model(x), x).loss.backward()
        t1 = time.perf_counter()
        layer_grad_norms(model)
        t2 = time.perf_counter()
        if i:
            step_t.append(t1 - t0)
            probe_t.append(t2 - t1)
    return statistics.median(probe_t), statistics.median(step_t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--smoke", action="store_true", help="tiny model, 1 run of 3 steps")
    ap.add_argument("--share-only", action="store_true",
                    help="only the share of a fwd+bwd step that layer_grad_norms takes")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads; 1 by default because on a shared machine multi-threaded "
                         "kernels stall whenever a core is taken")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_cfg = sg.GPTConfig.bench()
    if args.smoke:
        args.runs, args.steps, args.batch, model_cfg = 1, 3, 2, sg.GPTConfig.tiny()
    arms = {
        "baseline": None,
        "baseline-again": None,  # A/A: the noise between two identical arms
        "default": ProbeConfig(),
        "every-step": ProbeConfig(activation_every=1, grad_norms_every=1),
    }
    probe, step = grad_norms_share(reps=3 if args.smoke else 10, batch=args.batch,
                                   model_cfg=model_cfg)
    share = (f"layer_grad_norms {probe * 1e3:.2f} ms = {probe / step:.2%} of a fwd+bwd of "
             f"{step * 1e3:.1f} ms (median of interleaved reps)")
    if args.share_only:
        print(share)
        return
    medians: dict[str, list[float]] = {k: [] for k in arms}
    for _ in range(args.runs):
        for name, cfg in arms.items():
            medians[name].append(run_arm(cfg, steps=args.steps, batch=args.batch, model_cfg=model_cfg))
    base = statistics.median(medians["baseline"])
    print(f"model {'tiny' if args.smoke else 'bench'}, batch {args.batch}, {args.runs} interleaved "
          f"runs x {args.steps} steps, {args.threads} thread(s); baseline median step "
          f"{base * 1e3:.1f} ms")
    for name in arms:
        m = statistics.median(medians[name])
        ratios = [a / b for a, b in zip(medians[name], medians["baseline"])]
        print(f"  {name:<11} {m * 1e3:8.1f} ms  ratio {m / base:.3f}  "
              f"(per-run ratios {', '.join(f'{r:.3f}' for r in ratios)})")
    print(share)


if __name__ == "__main__":
    main()

"""The cost of spikeguard train's defenses on GPTConfig.bench(), precision equal in both arms.

Four arms take turns step by step (rotating order), fp32 everywhere: ``none`` and ``none2`` (the
A/A pair: no z-loss, no QK-norm, a plain fused-AdamW step, no clipping), ``defended`` (z-loss
1e-4 and the Guard as spikeguard train runs it: clipping, the gate, the detector, the probes at
their default intervals, the record) and ``qk`` (``defended`` plus
QK-norm). Whole-step ratios on this machine move +-10% run to run, so the target is measured
inside the defenses, as bench_sinks does: the time inside guard.step beyond the plain step, plus
the z-loss's own cost (linear cross-entropy forward+backward with and without it, interleaved in
the same run), as a share of the median ``none`` step. Target: 1 / (1 + share) >= 0.93 in
tokens/s terms. QK-norm's cost is its own row (the step ratio qk / defended).

    PYTHONPATH=src:. python benchmarks/bench_defenses.py             # 20 bench() steps per arm
    PYTHONPATH=src:. python benchmarks/bench_defenses.py --smoke     # tiny model, a few steps
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import spikeguard as sg
from spikeguard.measure.probes import Probes

__all__ = ["main"]


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny model, 3 steps: checks it runs")
    p.add_argument("--steps", type=int, default=20, help="measured steps per arm")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="CPU threads (1 keeps timings steady)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    steps, warmup = (3, 1) if args.smoke else (args.steps, 2)
    shape = sg.GPTConfig.tiny() if args.smoke else sg.GPTConfig.bench()
    gen = torch.Generator().manual_seed(0)
    knobs = {"none": dict(z_loss=0.0), "none2": dict(z_loss=0.0),
             "defended": dict(z_loss=1e-4), "qk": dict(z_loss=1e-4, qk_norm=True)}
    arms = {}
    for name, kw in knobs.items():
        torch.manual_seed(0)
        model = sg.GPT(sg.GPTConfig(**{**shape.__dict__, **kw}))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        guard = (sg.Guard(model, opt, probes=True,
                          config=sg.GuardConfig(detector=sg.DetectorConfig(arm_after=2)))
                 if name in ("defended", "qk") else None)
        arms[name] = (model, opt, guard)
    times = {a: [] for a in arms}
    tails = {a: [] for a in arms}

    def step(name: str, record: bool) -> None:
        model, opt, guard = arms[name]
        x = torch.randint(0, shape.vocab_size, (args.batch_size, shape.seq_len + 1), generator=gen)
        t0 = time.perf_counter()
        out = model.loss(model(x[:, :-1]), x[:, 1:])
        out.loss.backward()
        t1 = time.perf_counter()
        if guard is not None:
            guard.step(out)
        else:
            opt.step()
            opt.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        if record:
            times[name].append(t2 - t0)
            tails[name].append(t2 - t1)

    names = list(arms)
    for r in range(warmup + steps):
        for name in names[r % 4:] + names[: r % 4]:
            step(name, r >= warmup)

    # the z-loss's own cost: the fused output layer + loss, forward and backward, with and without
    h = torch.randn(args.batch_size, shape.seq_len, shape.d_model, generator=gen, requires_grad=True)
    w = (torch.randn(shape.vocab_size, shape.d_model, generator=gen) * 0.02).requires_grad_()
    y = torch.randint(0, shape.vocab_size, (args.batch_size, shape.seq_len), generator=gen)
    loss_t: dict[float, list[float]] = {0.0: [], 1e-4: []}
    for r in range(warmup + 3 * steps):
        for alpha in ((0.0, 1e-4) if r % 2 else (1e-4, 0.0)):
            t0 = time.perf_counter()
            sg.linear_cross_entropy(h, w, y, z_loss=alpha).loss.backward()
            if r >= warmup:
                loss_t[alpha].append(time.perf_counter() - t0)
    # the probes' forward hooks run inside the forward: time a forward with and without them
    plain, hooked = sg.GPT(shape), sg.GPT(shape)
    probes = Probes(hooked, sg.ProbeConfig())
    xb = torch.randint(0, shape.vocab_size, (args.batch_size, shape.seq_len), generator=gen)
    fwd_t: dict[str, list[float]] = {"plain": [], "hooked": []}
    with torch.no_grad():
        for r in range(warmup + 2 * steps):
            for name in (("plain", "hooked") if r % 2 else ("hooked", "plain")):
                m = plain if name == "plain" else hooked
                probes.start_step(0)
                t0 = time.perf_counter()
                m(xb)
                if name == "hooked":
                    probes.collect()
                if r >= warmup:
                    fwd_t[name].append(time.perf_counter() - t0)
    med = {a: statistics.median(t) for a, t in times.items()}
    base_tail = statistics.median(tails["none"] + tails["none2"])
    guard_share = (statistics.median(tails["defended"]) - base_tail) / med["none"]
    z_share = (statistics.median(loss_t[1e-4]) - statistics.median(loss_t[0.0])) / med["none"]
    # a reading costs this much on the steps it is due: every activation_every-th step
    reading_share = (statistics.median(fwd_t["hooked"]) - statistics.median(fwd_t["plain"])) / \
        med["none"]
    probe_share = reading_share / probes.config.activation_every
    share = guard_share + z_share + probe_share
    tps = 1.0 / (1.0 + share)
    print(f"\n{shape.n_layer} layers d={shape.d_model} T={shape.seq_len} batch {args.batch_size}, "
          f"fp32 in every arm, {torch.get_num_threads()} CPU thread(s); {steps} interleaved steps "
          f"per arm")
    for a in names:
        print(f"  {a:8s} median step {med[a] * 1e3:9.2f} ms")
    print(f"  guard (clip, gate, detector, probes, record) beyond a plain step: {guard_share:.3%}"
          " of a step")
    print(f"  z-loss 1e-4 inside the fused loss: {z_share:.3%} of a step")
    print(f"  probes' forward hooks: {reading_share:.3%} of a step when due, every "
          f"{probes.config.activation_every} steps: {probe_share:.3%} per step")
    print(f"  every defense but QK-norm: tokens/s ratio {tps:.4f} (target >= 0.93: "
          f"{'PASS' if tps >= 0.93 else 'FAIL'})")
    print(f"  step ratio defended/none {med['defended'] / med['none']:.4f}   A/A none2/none "
          f"{med['none2'] / med['none']:.4f}")
    print(f"  QK-norm on top: step ratio qk/defended {med['qk'] / med['defended']:.4f}")
    return {"tps": tps, "guard_share": guard_share, "z_share": z_share, "probe_share": probe_share,
            "qk": med["qk"] / med["defended"]}


if __name__ == "__main__":
    main()

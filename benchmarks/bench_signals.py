"""Cost of the early-warning signals (update ratio, spike share, logit bound) on GPTConfig.bench()
training steps, as a share of the step, beside an A/A arm.

Four arms take turns step by step (rotating order), each a guarded step (forward, backward,
``guard.step``) with the probes on and the probes' other readings off: ``off`` and ``off2``
record no signal (the A/A pair: their difference is the noise floor), ``every`` records all
three at every step (the update ratio from its default sample), ``defaults`` records them at
``SignalConfig()``'s intervals (the update ratio every step, the others every tenth). The time
inside the signals is measured where it is spent (the optimizer's pre- and post-step hooks and
``gather``, timed around each call; on CPU the work is synchronous); its mean per step over the
median ``off`` step is the arm's share. Target: the defaults together <= 0.5% of a step.

    PYTHONPATH=src:. nice -n 5 python benchmarks/bench_signals.py            # 12 steps per arm
    PYTHONPATH=src:. python benchmarks/bench_signals.py --smoke              # tiny model
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import spikeguard as sg
from spikeguard.measure.probes import ProbeConfig, Probes
from spikeguard.measure.signals import SignalConfig, Signals

__all__ = ["main"]


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny model, 4 steps: checks it runs")
    p.add_argument("--steps", type=int, default=12, help="measured steps per arm")
    p.add_argument("--batch-size", type=int, default=8)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    steps, warmup = (4, 1) if args.smoke else (args.steps, 2)
    cfg = sg.GPTConfig.tiny() if args.smoke else sg.GPTConfig.bench()
    gen = torch.Generator().manual_seed(0)
    every = SignalConfig(update_ratio_every=1, spike_share_every=1, logit_bound_every=1)
    off = SignalConfig(update_ratio_every=0, spike_share_every=0, logit_bound_every=0)
    defaults = SignalConfig()
    timed_arms = (every, defaults)
    inside: list[float] = [0.0]

    def timed(fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                inside[0] += time.perf_counter() - t0
        return wrapper

    def setup(signals: SignalConfig):
        torch.manual_seed(0)
        model = sg.GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        probes = Probes(model, ProbeConfig(activation_max=False, layer_grad_norms=False,
                                              signals=signals), optimizer=opt)
        sig = probes.signals
        if any(signals is a for a in timed_arms):  # hooks registered bound: re-register timed
            sig.remove()
            sig._hooks = [opt.register_step_pre_hook(timed(sig._pre)),
                          opt.register_step_post_hook(timed(sig._post))]
            sig.gather = timed(Signals.gather.__get__(sig))
        guard = sg.Guard(model, opt, probes=probes,
                         config=sg.GuardConfig(detector=sg.DetectorConfig(arm_after=2)))
        return model, guard

    arms = {"off": setup(off), "off2": setup(off), "every": setup(every),
            "defaults": setup(defaults)}
    times: dict[str, list[float]] = {a: [] for a in arms}
    spent: dict[str, list[float]] = {"every": [], "defaults": []}

    def step(arm: str, record: bool) -> None:
        model, guard = arms[arm]
        x = torch.randint(0, cfg.vocab_size, (args.batch_size, cfg.seq_len + 1), generator=gen)
        inside[0] = 0.0
        t0 = time.perf_counter()
        out = model.loss(model(x[:, :-1]), x[:, 1:])
        out.loss.backward()
        guard.step(out)
        t1 = time.perf_counter()
        if record:
            times[arm].append(t1 - t0)
            if arm in spent:
                spent[arm].append(inside[0])

    names = list(arms)
    for r in range(warmup + steps):
        for arm in names[r % len(names):] + names[: r % len(names)]:
            step(arm, record=r >= warmup)
    med = {a: statistics.median(t) for a, t in times.items()}
    # the mean: the defaults arm spends most of its time on one step in ten
    share = {a: statistics.mean(t) / med["off"] for a, t in spent.items()}
    print(f"\n{cfg.n_layer} layers d={cfg.d_model} T={cfg.seq_len} batch {args.batch_size}, fused "
          f"AdamW, 1 CPU thread; {steps} interleaved steps per arm; the update ratio's stride "
          f"{defaults.sample_stride}")
    for a in names:
        print(f"  {a:8s} median step {med[a] * 1e3:9.2f} ms ({med[a] / med['off']:.4f}x off)")
    for a, t in spent.items():
        print(f"  inside the signals, {a}: mean {statistics.mean(t) * 1e3:.2f} ms a step = "
              f"{share[a]:.3%} of a step")
    print(f"  target: the defaults <= 0.5% of a step: "
          f"{'PASS' if share['defaults'] <= 0.005 else 'FAIL'}")
    return {"share_every_step": share["every"], "share_default": share["defaults"],
            "ratio": med["every"] / med["off"], "aa": med["off2"] / med["off"]}


if __name__ == "__main__":
    main()

"""Overhead of the default sinks (JsonlSink + ConsoleSink) on GPTConfig.bench() training steps.

Three arms take turns step by step (rotating order): `base` and `base2` train without sinks (the
A/A pair: how much two identical arms differ is the noise floor), `sinks` builds the metrics
record from the step's device tensors and logs it. Prints the time spent inside the sinks' log()
calls per step as a fraction of the median step (target <= 1%), and the interleaved step-time
ratios sinks/base beside base2/base.

    PYTHONPATH=src:. python benchmarks/bench_sinks.py            # 30 bench() steps per arm
    PYTHONPATH=src:. python benchmarks/bench_sinks.py --smoke    # tiny model, a few steps
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from spikeguard.model import GPT, GPTConfig
from spikeguard.record import StepMetrics, metrics_record
from spikeguard.sinks import ConsoleSink, JsonlSink

__all__ = ["main"]


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny model, 4 steps: checks it runs")
    p.add_argument("--steps", type=int, default=30, help="measured steps per arm")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None, help="directory for metrics.jsonl (default: a temp dir)")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads (1 keeps timings steady on a shared machine)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    steps, warmup = (4, 1) if args.smoke else (args.steps, 3)
    cfg = GPTConfig.tiny() if args.smoke else GPTConfig.bench()
    dev = torch.device(args.device)

    torch.manual_seed(0)
    model = GPT(cfg).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_sinks_"))
    jsonl = JsonlSink(out / "metrics.jsonl", mode="w")
    console = ConsoleSink(every=10)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    arms = ["base", "base2", "sinks"]
    times: dict[str, list[float]] = {a: [] for a in arms}
    log_times: list[float] = []

    def step(arm: str, n: int, record: bool) -> None:
        x = torch.randint(0, cfg.vocab_size, (args.batch_size, cfg.seq_len + 1), generator=gen)
        x = x.to(dev)
        sync()
        t0 = time.perf_counter()
        loss = model.loss(model(x[:, :-1]), x[:, 1:]).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if arm == "sinks":
            rec = metrics_record(StepMetrics(step=n, loss=loss.detach(), grad_norm=norm,
                                             nan_frac=0.0, lr=opt.param_groups[0]["lr"]))
            t1 = time.perf_counter()
            jsonl.log(rec, n)
            console.log(rec, n)
            if record:
                log_times.append(time.perf_counter() - t1)
        sync()
        if record:
            times[arm].append(time.perf_counter() - t0)

    for r in range(warmup + steps):
        for arm in arms[r % 3:] + arms[: r % 3]:
            step(arm, r, record=r >= warmup)
    jsonl.close()
    console.close()

    med = {a: statistics.median(t) for a, t in times.items()}
    log_frac = statistics.mean(log_times) / med["base"]
    print(f"\n{cfg.n_layer} layers d={cfg.d_model} T={cfg.seq_len} batch {args.batch_size} on "
          f"{dev.type} ({torch.get_num_threads()} CPU threads); {steps} interleaved steps per arm")
    for a in arms:
        print(f"  {a:6s} median step {med[a] * 1e3:9.2f} ms")
    print(f"  log() time / median step: {log_frac:.4%} (mean log() {statistics.mean(log_times) * 1e6:.0f} us;"
          f" target <= 1%: {'PASS' if log_frac <= 0.01 else 'FAIL'})")
    print(f"  step ratio sinks/base {med['sinks'] / med['base']:.4f}   A/A base2/base "
          f"{med['base2'] / med['base']:.4f}")
    return {"log_frac": log_frac, "ratio": med["sinks"] / med["base"], "aa": med["base2"] / med["base"]}


if __name__ == "__main__":
    main()

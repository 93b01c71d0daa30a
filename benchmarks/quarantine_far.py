"""How often a clean batch holds an "outlier sequence", and whether the ones at a grad spike cause it.

Attribution quarantines the rows of a skipped batch whose loss or log Z has a robust z-score
(median and MAD over the batch's rows) above ``AttributionConfig.quarantine_z`` (5), and the
guard lets a reproduced grad-norm spike at an ordinary loss through only when no row is
quarantined. This measures that bar on clean runs, in a plain loop (clipping at 1.0, no guard)
over the zoo's settings, the pydoc corpus, 300 steps, seeds 0-1 (tuning) and 2-3 (held-out):

- **per batch**, from step 40 on: the largest row z-score; the share of batches over the bar
  (what the bar would quarantine were every batch skipped) and the 99th percentile;
- **at each grad spike** (grad norm past 3x the median of the 64 before it, from step 40): the
  row with the largest z-score, and the grad norm of the same batch without it under the same
  weights (the row *causes* the spike when the grad norm falls back under 3x without it);
- **planted**: every 25th step from 50, the batch's first row replaced by random bytes and
  judged under the same weights, not trained on (the run itself trains on its real batch): the
  z-score such a garbage row gets.

    PYTHONPATH=src:. python benchmarks/quarantine_far.py [--settings base llama] [--workers 2]
"""

from __future__ import annotations

import argparse
import statistics
from multiprocessing import Pool
from typing import Any

from benchmarks.zoo import SEEDS, setting

__all__ = ["main", "measure"]

SETTINGS = ("base", "b4", "b32", "llama", "sgd")
FROM = 40
"""Steps before this are left out (the warmup and the grad norm's turbulence after it)."""
SPIKE = 3.0
"""A grad spike: past this multiple of the median of the last ``WINDOW`` grad norms."""
WINDOW = 64


def measure(job: tuple[str, int]) -> dict[str, Any]:
    """One clean run of setting ``job[0]`` with seed ``job[1]``: its per-batch numbers."""
    import torch

    import spikeguard as sg
    from benchmarks.zoo_models import build, schedule
    from spikeguard.guard.outliers import row_scores
    from spikeguard.train.data import load_train_data

    name, seed = job
    torch.set_num_threads(1)
    s = setting(name)
    data = load_train_data(corpus="pydoc", data=None, tokenizer="bytes", vocab_size=None)
    torch.manual_seed(seed)
    model, opt = build(s["model"], data.vocab_size, dropout=s["dropout"], qk_norm=s["qk_norm"],
                       z_loss=s["z_loss"], optimizer=s["optimizer"], lr=s["lr"])
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, schedule(s["schedule"], warmup=s["warmup"], steps=s["steps"]))
    stream = sg.TokenStream(data.train, batch_size=s["batch"], seq_len=64, seed=seed)
    gen = torch.Generator().manual_seed(10_000 + seed)

    def judge(x: torch.Tensor, y: torch.Tensor) -> tuple[float, list[float]]:
        """(grad norm, each row's largest z-score); the gradients are left in place."""
        opt.zero_grad(set_to_none=True)
        out = model.loss(model(x), y)
        out.loss.backward()
        norm = torch.linalg.vector_norm(torch.stack(
            [p.grad.norm() for p in model.parameters() if p.grad is not None]))
        sq = out.sequences
        return float(norm), row_scores(sq.ce.tolist(), sq.log_z.tolist())

    grads: list[float] = []
    top: list[float] = []
    spikes: list[dict[str, float]] = []
    planted: list[float] = []
    for t in range(s["steps"]):
        x, y = next(stream)
        if t >= 50 and t % 25 == 0:
            xg = x.clone()
            xg[0] = torch.randint(0, data.vocab_size, x[0].shape, generator=gen)
            planted.append(judge(xg, y)[1][0])
        g, z = judge(x, y)
        if t >= FROM:
            top.append(max(z))
            med = statistics.median(grads[-WINDOW:])
            if g > SPIKE * med:
                row = max(range(len(z)), key=z.__getitem__)
                keep = [i for i in range(len(z)) if i != row]
                g_without = judge(x[keep], y[keep])[0]
                judge(x, y)  # the batch's own gradients back for its update
                spikes.append({"step": t, "ratio": g / med, "z": z[row],
                               "without": g_without / med})
        grads.append(g)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    return {"setting": name, "seed": seed, "batch": s["batch"], "top": top, "spikes": spikes,
            "planted": planted}


def _pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


def report(runs: list[dict[str, Any]], bar: float) -> str:
    lines = ["| setting (batch) | half | batches | largest row z > "
             f"{bar:g}, per 1,000 | largest row z: median / 99th pct | grad spikes "
             f"(>{SPIKE:g}x) | with a row over {bar:g} | that row causes it | planted "
             f"random-bytes row: z min / median, over {bar:g} |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name in dict.fromkeys(r["setting"] for r in runs):
        for half, seeds in SEEDS.items():
            rs = [r for r in runs if r["setting"] == name and r["seed"] in seeds]
            if not rs:
                continue
            top = [z for r in rs for z in r["top"]]
            sp = [e for r in rs for e in r["spikes"]]
            over = [e for e in sp if e["z"] > bar]
            causal = [e for e in over if e["without"] <= SPIKE]
            pl = [z for r in rs for z in r["planted"]]
            lines.append(
                f"| {name} ({rs[0]['batch']}) | {half} | {len(top)} | "
                f"{1000 * sum(z > bar for z in top) / len(top):.0f} | "
                f"{statistics.median(top):.1f} / {_pct(top, 0.99):.1f} | {len(sp)} | "
                f"{len(over)} | {len(causal)} | {min(pl):.1f} / {statistics.median(pl):.1f}, "
                f"{sum(z > bar for z in pl)}/{len(pl)} |")
    spikes = [(r["setting"], r["seed"], e) for r in runs for e in r["spikes"]]
    lines.append("")
    lines.append("grad spikes (setting, seed, step: grad / median, the top row's z, grad / "
                 "median without that row):")
    lines += [f"  {n} s{seed} {e['step']}: {e['ratio']:.2f}x, z {e['z']:.1f}, without it "
              f"{e['without']:.2f}x" for n, seed, e in spikes]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--settings", nargs="*", default=list(SETTINGS))
    p.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2, 3])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--bar", type=float, default=None,
                   help="the z bar (default: AttributionConfig.quarantine_z)")
    args = p.parse_args(argv)
    from spikeguard.guard.attribution import AttributionConfig

    bar = AttributionConfig().quarantine_z if args.bar is None else args.bar
    jobs = [(n, s) for n in args.settings for s in args.seeds]
    with Pool(args.workers) as pool:
        runs = []
        for r in pool.imap(measure, jobs):
            runs.append(r)
            print(f"{r['setting']} seed {r['seed']}: {len(r['spikes'])} grad spike(s)",
                  flush=True)
    print(report(runs, bar))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

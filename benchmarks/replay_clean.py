"""The detector replayed over recorded clean runs: Tier 2 pages, false skips, and a logit drift.

Host only (no training): ``SpikeDetector.update`` is fed each recorded step's loss, grad norm,
log Z and update ratio, with ``DetectorConfig.for_run(steps)`` given the warmup and not given it.
The runs: the 240 unguarded clean runs of the detection matrix (``lead_time_clean_matrix.jsonl``:
AdamW, tiny and demo, 20-1,000 steps, peak LR 1e-3 to 1e-2, warmup 20) and 24 tiny runs of 300
steps under other optimizers (``clean_optimizers.jsonl``, made by ``--generate``: SGD with
momentum 0.9 at lr 3e-2 and 1e-1, Adam with beta2 0.999, Adafactor, AdamW without warmup; a
plain loop with clipping at 1.0, seeds 0-3). Runs shorter than 60 steps are left out.
``--drift`` adds a log Z drift of 0.05 a step from mid-run to every run of 300 or 1,000 steps
and reports how many updates in the first Tier 2 came.

    PYTHONPATH=src:. python benchmarks/replay_clean.py [--drift]
    PYTHONPATH=src:. python benchmarks/replay_clean.py --generate   # re-make the optimizer runs
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import statistics
from pathlib import Path

from spikeguard.detector import DetectorConfig, SpikeDetector
from spikeguard.record import StepMetrics

__all__ = ["clean_runs", "main"]

RESULTS = Path(__file__).parent / "results"
SPECS = (("sgd", 0.03, 20), ("sgd", 0.1, 20), ("adam999", 0.003, 20), ("adamw", 0.003, 0),
         ("adafactor", 0.01, 20), ("sgd", 0.1, 0))


def clean_runs() -> list[dict]:
    """The recorded clean runs of 60 steps or more: name (ending in /s<seed>), steps, warm, s."""
    runs = []
    for line in open(RESULTS / "lead_time_clean_matrix.jsonl"):
        r = json.loads(line)
        runs.append({"name": f"{r['model']}/adamw/lr{r['lr']}/T{r['steps']}/s{r['seed']}",
                     "steps": r["steps"], "warm": min(20, r["steps"] - 1), "s": r["series"]})
    for line in open(RESULTS / "clean_optimizers.jsonl"):
        r = json.loads(line)
        runs.append({"name": f"tiny/{r['opt']}/lr{r['lr']}/w{r['warm']}/s{r['seed']}",
                     "steps": r["steps"], "warm": r["warm"], "s": r["series"]})
    return [r for r in runs if r["steps"] >= 60]


def _replay(run: dict, warm_given: bool, drift_from: int | None = None) -> list:
    warm = {"warmup_steps": run["warm"]} if warm_given else {}
    d = SpikeDetector(DetectorConfig.for_run(run["steps"], **warm))
    s, out = run["s"], []
    for t in range(run["steps"]):
        lz = s["log_z"][t]
        lz = math.nan if lz is None else lz
        if drift_from is not None and t >= drift_from:
            lz += 0.05 * (t - drift_from + 1)
        v = d.update(StepMetrics(step=t, loss=s["loss"][t], grad_norm=s["grad_norm"][t],
                                 log_z=lz), update_ratio=s["update_ratio"][t])
        out.append((v, d.armed))
    return out


def _optimizer(torch, opt: str, ps: list, lr: float):
    if opt == "sgd":
        return torch.optim.SGD(ps, lr=lr, momentum=0.9)
    if opt == "adam999":
        return torch.optim.Adam(ps, lr=lr, betas=(0.9, 0.999))
    if opt == "adafactor":
        return torch.optim.Adafactor(ps, lr=lr)
    return torch.optim.AdamW(ps, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)


def _generate() -> None:
    import torch

    import spikeguard as sg

    torch.set_num_threads(1)
    with open(RESULTS / "clean_optimizers.jsonl", "w") as f:
        for seed in range(4):
            for opt, lr, warm in SPECS:
                torch.manual_seed(seed)
                cfg = sg.GPTConfig.tiny(z_loss=1e-4)
                model = sg.GPT(cfg)
                ps = list(model.parameters())
                o = _optimizer(torch, opt, ps, lr)
                sch = torch.optim.lr_scheduler.LambdaLR(o, sg.schedules.warmup_cosine(
                    warmup_steps=warm, total_steps=300, min_ratio=0.1))
                data = sg.TokenStream.from_corpus("pydoc", batch_size=8, seq_len=cfg.seq_len,
                                                  seed=seed)
                s: dict[str, list[float]] = {"loss": [], "grad_norm": [], "log_z": [],
                                             "update_ratio": []}
                for _ in range(300):
                    x, y = next(data)
                    out = model.loss(model(x), y)
                    out.loss.backward()
                    g = sg.clip_grad_norm_(ps, 1.0)
                    before = [p.detach().clone() for p in ps]
                    o.step()
                    sch.step()
                    o.zero_grad(set_to_none=True)
                    with torch.no_grad():
                        num = sum(((p - b) ** 2).sum() for p, b in zip(ps, before))
                        den = sum((b ** 2).sum() for b in before)
                    for k, v in (("loss", out.ce), ("grad_norm", g), ("log_z", out.log_z),
                                 ("update_ratio", (num / den).sqrt())):
                        s[k].append(float(f"{float(v):.6g}"))
                f.write(json.dumps({"opt": opt, "lr": lr, "seed": seed, "warm": warm,
                                    "series": s, "model": "tiny", "batch_size": 8,
                                    "steps": 300}) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--generate", action="store_true")
    p.add_argument("--drift", action="store_true")
    args = p.parse_args(argv)
    if args.generate:
        _generate()
        return 0
    runs = clean_runs()
    for warm_given in (True, False):
        armed = skips = 0
        pages: collections.Counter = collections.Counter()
        for run in runs:
            for v, a in _replay(run, warm_given):
                armed += a
                skips += v.tier == 1 and v.skip
                if v.tier >= 2:
                    pages[f"{run['name'].rsplit('/s', 1)[0]}: {v.reasons[0]}"] += 1
        print(f"warmup given={warm_given}: {len(runs)} runs, {armed:,} armed steps, "
              f"{skips} Tier 1 skips ({1000 * skips / armed:.2f} per 1,000), "
              f"{sum(pages.values())} Tier 2: {dict(pages)}")
    if args.drift:
        delays, missed = [], 0
        for run in (r for r in runs if r["steps"] in (300, 1000)):
            t0 = run["steps"] // 2
            d = next((v.step - t0 for v, _ in _replay(run, False, t0)[t0:] if v.tier >= 2), None)
            missed += d is None
            delays += [] if d is None else [d]
        print(f"log Z drift 0.05/step from mid-run: {len(delays) + missed} runs, {missed} not "
              f"paged; paged {min(delays)}-{max(delays)} updates in (median "
              f"{statistics.median(delays)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

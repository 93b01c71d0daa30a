"""The guard on losses that are not a language model's: a user's own loop, as README writes it.

A language model's batch loss averages thousands of token losses and is nearly Gaussian about
its level; these settings average a few dozen heavy-tailed example losses. Each is a plain loop
through ``sg.Guard`` with ``GuardConfig(detector=DetectorConfig.for_run(steps), clip=1.0)``, a
0-d loss, and ``rerun=``; no data stream is given to the guard:

- ``mlp-sgd``: an MLP (20-256-256-10) classifying a 10-class Gaussian mixture with 10% of its
  labels flipped, batch 32, SGD with momentum 0.9 (LR 0.05), warmup 50 + cosine, 1,000 steps;
- ``cnn-adamw``: a 2-layer CNN telling four shapes apart in noisy 16x16 images, batch 32,
  AdamW 2e-3, warmup 30 + cosine, 600 steps (most examples fitted: one hard one stands out);
- ``diffusion``: an MLP denoiser predicting the noise of a cosine schedule at a random noise
  level per example (16-d mixture), batch 64, AdamW 1e-3, 1,000 steps;
- ``lstm-lm``: a 2-layer LSTM language model on pydoc bytes, batch 16 x 64, AdamW 3e-3, 600
  steps (the control: a language model's loss);
- ``reg-t2``: a regression whose targets carry Student-t noise with 2 degrees of freedom, MSE,
  batch 64, Adam 1e-3, 1,000 steps: a squared t(2) has no mean, so its batch loss has a power
  law's tail (the loss tail's Pareto fit; the slow rule still pages it once in four seeds).

Seeds 0-3 are the tuning half, 4-7 held out. Three modes:

    PYTHONPATH=src:. python benchmarks/beyond_lm.py --generate   # unguarded series, 3 min
    PYTHONPATH=src:. python benchmarks/beyond_lm.py              # each rule replayed on them
    PYTHONPATH=src:. python benchmarks/beyond_lm.py --guarded --seeds 4 5 6 7  # pairs, 10 min

``--guarded`` runs each setting guarded (the default policy) beside the same run with
``respond=False`` and prints skips, alerts, Tier 2 pages and the held-out loss ratio
(``--results`` keeps the lines; a rerun skips what is there).
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import math
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

SETTINGS = ("mlp-sgd", "cnn-adamw", "diffusion", "lstm-lm", "reg-t2")
RESULTS = Path(__file__).parent / "results"
SERIES = RESULTS / "beyond_lm_series.jsonl"


def _gauss(seed: int, n: int = 20000) -> tuple[Any, Any]:
    import torch
    g = torch.Generator().manual_seed(1000 + seed)
    centers = torch.randn(10, 20, generator=g) * 1.5
    y = torch.randint(0, 10, (n,), generator=g)
    x = centers[y] + torch.randn(n, 20, generator=g)
    flip = torch.rand(n, generator=g) < 0.1
    return x, torch.where(flip, torch.randint(0, 10, (n,), generator=g), y)


def _shapes(seed: int, n: int = 8000) -> tuple[Any, Any]:
    import torch
    g = torch.Generator().manual_seed(2000 + seed)
    y = torch.randint(0, 4, (n,), generator=g)
    x = torch.randn(n, 1, 16, 16, generator=g) * 0.5
    pos = torch.randint(2, 10, (n, 2), generator=g)
    for i in range(n):
        r, c, k = int(pos[i, 0]), int(pos[i, 1]), int(y[i])
        if k == 0:
            x[i, 0, r:r + 4, c:c + 4] += 1
        elif k == 1:
            x[i, 0, r:r + 4, c + 1:c + 2] += 2
        elif k == 2:
            x[i, 0, r + 1:r + 2, c:c + 4] += 2
        else:
            x[i, 0, r:r + 4, c:c + 4] += torch.eye(4) * 2
    return x, y


def _regression(seed: int, n: int = 20000) -> tuple[Any, Any]:
    import torch
    g = torch.Generator().manual_seed(3000 + seed)
    w = torch.randn(32, generator=g)
    x = torch.randn(n, 32, generator=g)
    noise = torch.distributions.StudentT(2.0).sample((n,))
    return x, (x @ w + torch.tanh(x[:, 0] * 3) + 0.5 * noise).unsqueeze(1)


def _lm_windows(seed: int) -> tuple[Any, Any, Any, Any]:
    import torch

    from spikeguard.train.data import load_train_data
    data = load_train_data(corpus="pydoc", data=None, tokenizer="bytes", vocab_size=None)
    g = torch.Generator().manual_seed(seed)

    def windows(ids: Any, n: int) -> tuple[Any, Any]:
        t = torch.as_tensor(ids[:2_000_000]).long()
        starts = torch.randint(0, len(t) - 65, (n,), generator=g).tolist()
        w = torch.stack([t[j:j + 65] for j in starts])
        return w[:, :-1], w[:, 1:]
    return (*windows(data.train, 16 * 600), *windows(data.val, 256))


def build(name: str, seed: int) -> dict[str, Any]:
    """The setting's model, optimizer, loss, batches (``batch(i, gen)``), held-out batch,
    steps and warmup, seeded."""
    import torch
    from torch import nn
    from torch.nn import functional as F
    torch.manual_seed(seed)
    ce = F.cross_entropy
    if name == "mlp-sgd":
        x, y = _gauss(seed)
        model = nn.Sequential(nn.Linear(20, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                              nn.Linear(256, 10))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
        return _sampled(model, opt, ce, x, y, 2000, 32, 1000, 50)
    if name == "cnn-adamw":
        x, y = _shapes(seed)
        model = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                              nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                              nn.Flatten(), nn.Linear(32 * 16, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
        return _sampled(model, opt, ce, x, y, 1000, 32, 600, 30)
    if name == "reg-t2":
        x, y = _regression(seed)
        model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 1))
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        return _sampled(model, opt, F.mse_loss, x, y, 2000, 64, 1000, 0)
    if name == "diffusion":
        return _diffusion(seed)
    if name == "lstm-lm":
        return _lstm(seed)
    raise ValueError(f"unknown setting {name!r}; one of {', '.join(SETTINGS)}")


def _sampled(model: Any, opt: Any, loss: Any, x: Any, y: Any, held: int, batch: int,
             steps: int, warmup: int) -> dict[str, Any]:
    import torch
    xt, yt = x[:-held], y[:-held]

    def draw(i: int, gen: Any) -> tuple[Any, Any]:
        idx = torch.randint(0, len(xt), (batch,), generator=gen)
        return xt[idx], yt[idx]
    return {"model": model, "opt": opt, "loss": loss, "forward": model, "batch": draw,
            "val": (x[-held:], y[-held:]), "steps": steps, "warmup": warmup}


def _diffusion(seed: int) -> dict[str, Any]:
    import torch
    from torch import nn
    from torch.nn import functional as F
    g = torch.Generator().manual_seed(4000 + seed)
    centers = torch.randn(8, 16, generator=g) * 2
    x0 = centers[torch.randint(0, 8, (40000,), generator=g)] + 0.3 * torch.randn(40000, 16,
                                                                                 generator=g)
    net = nn.Sequential(nn.Linear(17, 256), nn.SiLU(), nn.Linear(256, 256), nn.SiLU(),
                        nn.Linear(256, 16))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)

    def noised(x: Any, gen: Any) -> tuple[Any, Any]:
        t = torch.rand(len(x), generator=gen)
        e = torch.randn(x.shape, generator=gen)
        a, s = torch.cos(t * math.pi / 2)[:, None], torch.sin(t * math.pi / 2)[:, None]
        return torch.cat([a * x + s * e, t[:, None]], 1), e

    def draw(i: int, gen: Any) -> tuple[Any, Any]:
        return noised(x0[:-4000][torch.randint(0, 36000, (64,), generator=gen)], gen)
    val = noised(x0[-4000:], torch.Generator().manual_seed(seed + 99))
    return {"model": net, "opt": opt, "loss": F.mse_loss, "forward": net, "batch": draw,
            "val": val, "steps": 1000, "warmup": 50}


def _lstm(seed: int) -> dict[str, Any]:
    import torch
    from torch import nn
    from torch.nn import functional as F

    class LSTMLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.out = nn.Embedding(256, 128), nn.Linear(128, 256)
            self.lstm = nn.LSTM(128, 128, 2, batch_first=True)

        def forward(self, x: Any) -> Any:
            return self.out(self.lstm(self.embed(x))[0])
    x, y, xv, yv = _lm_windows(seed)
    model = LSTMLM()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)

    def loss(out: Any, target: Any) -> Any:
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))

    def draw(i: int, gen: Any) -> tuple[Any, Any]:
        return x[i * 16 % len(x):i * 16 % len(x) + 16], y[i * 16 % len(y):i * 16 % len(y) + 16]
    return {"model": model, "opt": opt, "loss": loss, "forward": model, "batch": draw,
            "val": (xv, yv), "steps": 600, "warmup": 30}


def run(name: str, seed: int, respond: bool) -> dict[str, Any]:
    """One run through the guard (``respond=False``: every response off); its records'
    non-continue actions, armed steps, held-out loss and per-step series."""
    import torch

    import spikeguard as sg
    from spikeguard.sinks import read_metrics
    s = build(name, seed)
    model, opt, lossf, steps = s["model"], s["opt"], s["loss"], s["steps"]
    sched = (torch.optim.lr_scheduler.LambdaLR(opt, sg.schedules.warmup_cosine(
        warmup_steps=s["warmup"], total_steps=steps, min_ratio=0.1)) if s["warmup"] else None)
    out = Path(tempfile.mkdtemp(prefix="sg-beyond-"))
    try:
        guard = sg.Guard(model, opt, scheduler=sched, sinks=[sg.JsonlSink(out / "m.jsonl")],
                         config=sg.GuardConfig(detector=sg.DetectorConfig.for_run(steps),
                                               clip=1.0, respond=respond))

        def fb(xb: Any, yb: Any, keep: Any = None) -> Any:
            if keep is not None:
                xb, yb = xb[keep], yb[keep]
            loss = lossf(s["forward"](xb), yb)
            guard.backward(loss)
            return loss
        gen, i = torch.Generator().manual_seed(seed + 77), 0
        while guard.step_index < steps + min(guard.withheld, 100):
            xb, yb = s["batch"](i, gen)
            i += 1
            guard.step(fb(xb, yb), rerun=functools.partial(fb, xb, yb))
        guard.close()
        with torch.no_grad():
            val = float(lossf(s["forward"](s["val"][0]), s["val"][1]))
        recs = read_metrics(out / "m.jsonl")
    finally:
        shutil.rmtree(out, ignore_errors=True)
    acts = [(r["step"], r.get("action"), r.get("tier"), (r.get("reasons") or [""])[0])
            for r in recs if r.get("action") not in (None, "continue")]
    return {"acts": acts, "armed": sum(1 for r in recs if r.get("armed")), "val": val,
            "steps": steps, "warmup": s["warmup"],
            "series": {k: [r.get(k) for r in recs] for k in ("loss", "grad_norm",
                                                             "update_ratio", "log_z")}}


def generate(path: Path, seeds: list[int]) -> None:
    """Record each setting's unguarded run per seed (the replay's input)."""
    with open(path, "w") as f:
        for name in SETTINGS:
            for seed in seeds:
                r = run(name, seed, respond=False)
                f.write(json.dumps({"cell": name, "seed": seed, "steps": r["steps"],
                                    "warm": r["warmup"], "series": _rounded(r["series"])})
                        + "\n")
                f.flush()
                print(f"{name} seed {seed}: {len(r['series']['loss'])} steps", flush=True)


def _rounded(series: dict[str, list]) -> dict[str, list]:
    """Six significant digits (the replay reads no further)."""
    return {k: [v if v is None else float(f"{v:.6g}") for v in vals]
            for k, vals in series.items()}


def replay_runs(path: Path) -> list[dict[str, Any]]:
    """The recorded series in ``rule_far``'s form (no vocabulary size, no log Z)."""
    out = []
    for line in open(path):
        r = json.loads(line)
        s = r["series"]
        s["update_ratio"] = [math.nan if v is None else v for v in s["update_ratio"]]
        out.append({"name": f"beyond/{r['cell']}/s{r['seed']}", "steps": r["steps"],
                    "warm": r["warm"], "s": s, "vocab": None})
    return out


def far_table(path: Path) -> list[str]:
    """Each rule's flags per 1,000 armed steps, per setting and half (seeds 0-3 / 4-7)."""
    from benchmarks import rule_far
    runs = replay_runs(path)
    lines = ["| setting | half | armed steps | flags per 1,000 armed steps, by rule |",
             "|---|---|---|---|"]
    for name in SETTINGS:
        for half, seeds in (("tuning", range(4)), ("held-out", range(4, 8))):
            sub = [r for r in runs if r["name"].split("/")[1] == name
                   and int(r["name"].rsplit("/s", 1)[1]) in seeds]
            if not sub:
                continue
            res = rule_far.far(sub, False)
            steps, alarms = res["tuning"]["steps"] + res["held-out"]["steps"], \
                res["tuning"]["alarms"] + res["held-out"]["alarms"]
            rates = ", ".join(f"{k} {1000 * v / max(1, steps[rule_far._steps_for(k)]):.1f}"
                              for k, v in sorted(alarms.items())) or "none"
            lines.append(f"| {name} | {half} | {steps['armed']} | {rates} |")
    return lines


def guarded(names: list[str], seeds: list[int], results: Path | None) -> None:
    """Each setting guarded beside unguarded; prints (and keeps) one line a pair."""
    done = set()
    if results is not None and results.exists():
        done = {(d["name"], d["seed"]) for d in map(json.loads, open(results))}
    for name in names:
        for seed in seeds:
            if (name, seed) in done:
                continue
            g, u = run(name, seed, True), run(name, seed, False)
            kinds = collections.Counter(f"{a}{'' if t is None else t}" for _, a, t, _ in g["acts"])
            line = {"name": name, "seed": seed, "armed": g["armed"], "val": g["val"],
                    "unguarded_val": u["val"], "ratio": round(g["val"] / u["val"], 4),
                    "skips": kinds.get("skip1", 0), "alerts": kinds.get("alert1", 0),
                    "pages": kinds.get("alert2", 0), "acts": g["acts"][:40]}
            print(json.dumps({k: v for k, v in line.items() if k != "acts"}), flush=True)
            if results is not None:
                with open(results, "a") as f:
                    f.write(json.dumps(line) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--generate", action="store_true", help="record the unguarded series")
    p.add_argument("--series", type=Path, default=SERIES)
    p.add_argument("--guarded", action="store_true", help="guarded beside unguarded runs")
    p.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=SETTINGS)
    p.add_argument("--seeds", nargs="*", type=int, default=list(range(8)))
    p.add_argument("--results", type=Path, help="--guarded: keep (and resume) the lines here")
    args = p.parse_args(argv)
    import torch
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # the models have no attention for the logit bound
    if args.generate:
        generate(args.series, args.seeds)
    elif args.guarded:
        guarded(args.settings, args.seeds, args.results)
    else:
        print("\n".join(far_table(args.series)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

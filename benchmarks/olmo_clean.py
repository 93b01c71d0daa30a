"""OLMo-core clean runs, guarded beside unguarded: the guard's false skips and what they cost.

Each seed trains OLMo-core's own one-layer Transformer (tests/test_integrations_olmo.py's CPU
set-up: d_model 32, the corpus' bytes from an offset of its own, two micro-batches a step) for
``--steps`` steps twice: with ``SpikeguardCallback`` at its defaults (``DetectorConfig.for_run``,
the weights check and attribution through the train module's re-run, the input-token check on
the ids ``model_forward`` gets, skips made up) and with
the guard only measuring (``GuardConfig(respond=False)``: the unguarded run, the same records).
No fault is injected, so every skip is a false one. Prints, per seed, the skips, the armed steps,
and the held-out loss of both (mean cross-entropy of 256 fixed validation windows of 32
bytes, float64).

    PYTHONPATH=src:. python benchmarks/olmo_clean.py --steps 150 --seeds 0 1 2 --out /tmp/olmo_clean
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from tests.test_integrations_olmo import ROWS, SEQ, make_trainer

import spikeguard as sg
from spikeguard.data import load_corpus
from spikeguard.sinks import read_metrics


def held_out_loss(trainer, windows: int = 256) -> float:
    """Cross-entropy of the trained model on ``windows`` fixed validation windows (float64)."""
    val = load_corpus("pydoc").val
    x = torch.from_numpy(val[:windows * (SEQ + 1)].astype(np.int64)).view(windows, SEQ + 1)
    with torch.no_grad():
        logits = trainer.train_module.model(x[:, :-1]).double()
    return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()))


def run(seed: int, steps: int, out: Path, respond: bool) -> tuple[int, int, float, int]:
    """(skips, armed steps, held-out loss, skips that name the input ids) of one run."""
    folder = out / f"seed{seed}-{'guarded' if respond else 'unguarded'}"
    det = sg.DetectorConfig.for_run(steps)
    # the guard's defaults, the input-token check included (the tests turn it off)
    trainer, _ = make_trainer(folder, steps=steps, seed=seed, detector=det, respond=respond,
                              token_z=sg.GuardConfig().token_z)
    loader = trainer.data_loader
    # each seed reads the corpus from an offset of its own (100,000 bytes apart, wrapping round
    # where a run would read past its end: seed 4 starts at byte 18,754)
    span = len(loader.tokens) - steps * ROWS * SEQ
    loader.tokens = loader.tokens[seed * 100_000 % span:]
    trainer.fit()
    records = read_metrics(folder / "metrics.jsonl")
    skips = sum(bool(r.get("skipped")) for r in records)
    armed = sum(r["step"] > det.arm_after for r in records)
    by_ids = sum(bool(r.get("skipped")) and any(str(w).startswith("tokens")
                                                for w in r.get("reasons") or ())
                 for r in records)
    return skips, armed, held_out_loss(trainer), by_ids


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", type=Path, default=Path("/tmp/olmo_clean"))
    a = p.parse_args()
    print("seed | skips (guarded) | of them for the input ids | armed steps | held-out guarded "
          "| unguarded | ratio")
    total = armed_total = 0
    for seed in a.seeds:
        skips, armed, g, by_ids = run(seed, a.steps, a.out, True)
        u = run(seed, a.steps, a.out, False)[2]
        total, armed_total = total + skips, armed_total + armed
        print(f"{seed} | {skips} | {by_ids} | {armed} | {g:.4f} | {u:.4f} | {g / u:.4f}",
              flush=True)
    print(f"all | {total} | {armed_total} | false skips per 1,000 armed steps: "
          f"{1000 * total / max(armed_total, 1):.2f}")


if __name__ == "__main__":
    main()

"""A plain PyTorch training loop with spikeguard: the loop you already have, plus the Guard.

Read top to bottom: every spikeguard line is marked ``# sg``. The reference GPT trains on the
Python docs that ship with the interpreter; ``--inject-at S`` replaces batch S with random bytes
(a data outlier) so you can watch the guard skip it. A halt (Tier 3) writes ``report.txt`` into
``--out`` and exits with status 3, as ``spikeguard train`` does.

    PYTHONPATH=src python examples/train_loop.py --steps 200 --inject-at 120 --out runs/example
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

import spikeguard as sg
from spikeguard.integrations.exits import exit_status  # sg


def main(steps: int = 200, out: str = "runs/example", inject_at: int | None = None,
         seed: int = 0, lr: float = 3e-3) -> list:
    """Train for ``steps`` updates, resuming from ``out``'s newest checkpoint when it has one;
    returns the guard's verdict at every step run."""
    torch.manual_seed(seed)
    cfg = sg.GPTConfig.tiny(z_loss=1e-4)                                 # sg: z-loss (PaLM)
    model = sg.GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95),
                                  weight_decay=0.1, fused=True)
    schedule = sg.schedules.warmup_cosine(warmup_steps=20, total_steps=steps, min_ratio=0.1)  # sg
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    data = sg.TokenStream.from_corpus("pydoc", batch_size=8, seq_len=cfg.seq_len, seed=seed)  # sg
    guard = sg.Guard(                                                    # sg: one call per step
        model, optimizer, scheduler=scheduler, data=data,                # sg
        config=sg.GuardConfig(detector=sg.DetectorConfig.for_run(steps), clip=1.0),  # sg
        checkpoints=sg.CheckpointManager(Path(out) / "checkpoints", every=50, keep=3),  # sg
        sinks=[sg.JsonlSink(Path(out) / "metrics.jsonl")])              # sg
    guard.resume()                  # sg: continue after a crash; the metrics file continues too

    def forward_backward(x, y, keep=None):  # sg: the guard re-runs it (keep: rows to keep)
        if keep is not None:
            x, y = x[keep], y[keep]
        out = model.loss(model(x), y)    # LossOutput: .loss to backprop, .ce and .log_z detached
        guard.backward(out)                 # sg: out.loss.backward(), weighed on a re-run
        return out

    verdicts = []
    while guard.step_index < steps:                                      # a rollback replays steps
        x, y = next(data)
        if guard.step_index == inject_at:
            x = torch.randint(0, cfg.vocab_size, x.shape, generator=torch.Generator().manual_seed(1))
        out = forward_backward(x, y)
        rerun = functools.partial(forward_backward, x, y)                # sg: holds this batch
        # sg: clip, skip or step, decide, log, save; tokens: the ids, checked against the run's
        for verdict in guard.step(out, rerun=rerun, tokens=x):
            verdicts.append(verdict)
            if verdict.action is not sg.Action.CONTINUE or verdict.step % 50 == 0:
                e = verdict.evidence
                print(f"step {verdict.step:4d} loss {e['loss']:.3f} |g| {e['grad_norm']:.3f} "
                      f"-> {verdict.action.value} {list(verdict.reasons)}")
    verdicts += guard.close()                                            # sg
    return verdicts


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default="runs/example")
    ap.add_argument("--inject-at", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=3e-3)
    a = ap.parse_args()
    try:
        main(a.steps, a.out, a.inject_at, a.seed, a.lr)
    except sg.TrainingHalted as halt:                 # sg: Tier 3: the report, exit status 3
        report = Path(a.out) / "report.txt"
        report.write_text(f"{halt.report}\n")
        print(f"{halt.report}\nreport: {report}", file=sys.stderr)
        raise SystemExit(exit_status(halt)) from None  # 3, as spikeguard train

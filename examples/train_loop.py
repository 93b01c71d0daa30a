"""A plain PyTorch training loop with spikeguard's defenses added by hand.

Read top to bottom: every spikeguard line is marked ``# sg``. The reference GPT trains on the
Python docs that ship with the interpreter; ``--inject-at S`` replaces batch S with random bytes
(a data outlier) so you can watch the detector skip it.

    PYTHONPATH=src python examples/train_loop.py --steps 200 --inject-at 120 --out runs/example
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import spikeguard as sg


def main(steps: int = 200, out: str = "runs/example", inject_at: int | None = None,
         seed: int = 0) -> list:
    """Train for ``steps`` updates; returns the detector's verdict at every step."""
    torch.manual_seed(seed)
    cfg = sg.GPTConfig.tiny(z_loss=1e-4)                                 # sg: z-loss on by default
    model = sg.GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    schedule = sg.schedules.warmup_cosine(warmup_steps=20, total_steps=steps, min_ratio=0.1)  # sg
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    data = sg.TokenStream.from_corpus("pydoc", batch_size=8, seq_len=cfg.seq_len, seed=seed)  # sg
    detector = sg.SpikeDetector(sg.DetectorConfig.for_run(steps))        # sg: the seeds' triage
    checkpoints = sg.CheckpointManager(Path(out) / "checkpoints", every=50, keep=3)  # sg
    sink = sg.JsonlSink(Path(out) / "metrics.jsonl")                     # sg

    verdicts = []
    for step, (x, y) in zip(range(steps), data):
        if step == inject_at:
            x = torch.randint(0, cfg.vocab_size, x.shape, generator=torch.Generator().manual_seed(step))
        out_ = model.loss(model(x), y)   # LossOutput: .loss to backprop, .ce and .log_z detached
        out_.loss.backward()
        stats = sg.grad_stats(model.parameters(), extras=torch.stack([out_.ce, out_.log_z]))  # sg
        metrics = sg.StepMetrics(step=step, loss=float(stats.extras[0]), grad_norm=float(stats.norm),
                                 log_z=float(stats.extras[1]), lr=scheduler.get_last_lr()[0],
                                 nan_frac=0.0 if bool(stats.finite) else stats.nan_frac)
        verdict = detector.update(metrics)                               # sg: decide
        verdicts.append(verdict)
        if verdict.action is sg.Action.HALT:
            print(f"step {step}: HALT {verdict.reasons}")
            break
        if not verdict.skip:                                             # sg: a skip changes nothing
            stats.clip_(1.0)
            optimizer.step()
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        sink.log(sg.metrics_record(metrics, tier=verdict.tier, action=verdict.action,
                                   reasons=verdict.reasons), step)      # sg
        if verdict.action is not sg.Action.CONTINUE or step % 50 == 0:
            print(f"step {step:4d} loss {metrics.loss:.3f} |g| {metrics.grad_norm:.3f} "
                  f"logZ {metrics.log_z:.2f} -> {verdict.action.value} {list(verdict.reasons)}")
        checkpoints.maybe_save(step, model=model, optimizer=optimizer, scheduler=scheduler,
                               data=data, extra_state={"detector": detector},
                               healthy=verdict.tier == 0)                # sg
    sink.close()
    checkpoints.close()
    return verdicts


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default="runs/example")
    ap.add_argument("--inject-at", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    main(a.steps, a.out, a.inject_at, a.seed)

"""One rank of the accelerate test (tests/test_integrations_accelerate.py), launched by
``accelerate launch`` (2 processes, gloo on CPU) or run alone. The tiny Llama of tests/_hf_llama.py
in docs/integrations.md's loop: prepared model, optimizer, dataloader and scheduler,
``accelerator.accumulate``, the guard's step. Phases, each with a fresh model and guard:

- clean: no action;
- outlier: step 10's samples a run of NUL bytes on every rank: skipped, cause data, the
  weights and AdamW moments bit-identical across it, the schedule held;
- nan: the second block's MLP outputs NaN from step 8: halt naming the module;
- accumulate: 2 micro-batches a step, attention dropout 0.1, step 10's samples NUL: skipped,
  cause data or unknown, never transient;
- corrupt: drop_sequences, one sample of step 10 (rank 1's row 1) has inf embeddings: that row
  quarantined, the step applied without it on both ranks, no halt.

Writes ``OUT/rank<r>.json`` with what each phase saw."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import numpy as np
import torch

import spikeguard as sg
from spikeguard.data import load_corpus
from spikeguard.integrations.accelerate import guard_accelerator
from tests._hf_llama import CORRUPT, SEQ, corrupt_embeddings, llama, poison_mlp, snapshot

BATCH, STEPS, BAD = 4, 14, 10


class Windows(torch.utils.data.Dataset):
    """Consecutive windows of the corpus' bytes; the samples in ``bad`` are NUL bytes."""

    def __init__(self, n: int, bad: range = range(0), corrupt: int | None = None) -> None:
        tokens = load_corpus("pydoc").train
        self.seqs = [torch.from_numpy(tokens[i * SEQ:(i + 1) * SEQ].astype(np.int64))
                     for i in range(n)]
        for i in bad:
            self.seqs[i] = torch.zeros(SEQ, dtype=torch.int64)
        if corrupt is not None:
            self.seqs[corrupt] = torch.full((SEQ,), CORRUPT, dtype=torch.int64)

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.seqs[i], "labels": self.seqs[i].clone()}


def phase(out: Path, name: str, *, ga: int = 1, dropout: float = 0.0, bad: int | None = None,
          nan_at: int | None = None, corrupt: int | None = None) -> dict:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ga)
    world = accelerator.num_processes
    per_step = BATCH * world * ga
    bad_range = range(bad * per_step, (bad + 1) * per_step) if bad is not None else range(0)
    model = llama(dropout=dropout)
    switch = {"on": False}
    poison_mlp(model, switch)
    corrupt_embeddings(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    corrupt_at = corrupt * per_step + BATCH + 1 if corrupt is not None else None  # rank 1 row 1
    loader = torch.utils.data.DataLoader(Windows(STEPS * per_step, bad_range, corrupt_at),
                                         batch_size=BATCH)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    # arm_quiet=2: the grad rule turns on 2 quiet updates after arm_after (5), before BAD; these
    # phases test the skip, the rerun and the drop, not arming, and 20 more steps a phase on 2
    # ranks would double the launch's time
    det = sg.DetectorConfig.for_run(STEPS, arm_after=5, grad_z=0.01, arm_quiet=2)
    guard = guard_accelerator(accelerator, model, optimizer, scheduler=scheduler,  # sg
                              config=sg.GuardConfig(detector=det, attribution=sg.AttributionConfig(
                                  drop_sequences=corrupt is not None)), out_dir=out / name)

    def forward_backward(batch, keep=None):  # sg: the guard re-runs it
        if keep is not None:
            batch = {k: v[keep] for k, v in batch.items()}
        logits = model(input_ids=batch["input_ids"]).logits
        o = sg.cross_entropy(logits[:, :-1], batch["labels"][:, 1:], per_sequence=True)
        accelerator.backward(o.loss)  # divides by gradient_accumulation_steps
        return o

    seen: dict = {"name": name, "rank": accelerator.process_index, "world": world}
    inner = optimizer.optimizer
    try:
        for i, batch in enumerate(loader):
            step = i // ga
            switch["on"] = nan_at is not None and step >= nan_at
            if step in (bad, corrupt) and i % ga == 0:
                before = (*snapshot(model, inner), scheduler.scheduler.last_epoch)
            with accelerator.accumulate(model):
                o = forward_backward(batch)
                guard.accumulate(o, rerun=functools.partial(forward_backward, batch))  # sg
                if accelerator.sync_gradients:
                    guard.step()  # sg: optimizer.step(), scheduler.step(), zero_grad()
            if step in (bad, corrupt) and accelerator.sync_gradients:
                after = (*snapshot(model, inner), scheduler.scheduler.last_epoch)
                seen["untouched"] = (all(torch.equal(before[0][k], after[0][k])
                                         for k in before[0])
                                     and all(torch.equal(x, y) for a, b in
                                             zip(before[1].values(), after[1].values())
                                             for x, y in zip(a.values(), b.values())
                                             if torch.is_tensor(x)))
                seen["held"] = before[2] == after[2]
    except sg.TrainingHalted as halt:
        seen["halt"] = {"step": halt.report.step, "first_forward": halt.report.first_forward}
    finally:
        guard.close()
    seen["applied"] = guard.applied
    seen["finite"] = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    seen["last_epoch"] = scheduler.scheduler.last_epoch
    accelerator.wait_for_everyone()
    return seen


def main(out: Path) -> None:
    torch.set_num_threads(1)
    results = [phase(out, "clean"), phase(out, "outlier", bad=BAD),
               phase(out, "nan", nan_at=8),
               phase(out, "accumulate", ga=2, dropout=0.1, bad=BAD),
               phase(out, "corrupt", corrupt=BAD)]
    rank = results[0]["rank"]
    (out / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]))

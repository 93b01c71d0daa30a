"""An ``accelerate`` loop with spikeguard: a small Llama (built from its config, no download) on
the Python docs' bytes, with gradient accumulation. Every line spikeguard adds or changes is
marked ``# sg`` (tests/test_adapters_glue.py counts them for docs/adapters.md); the loop is
docs/integrations.md's. One process, or several under ``accelerate launch``:

    PYTHONPATH=src python examples/accelerate_loop.py
    PYTHONPATH=src accelerate launch --num_processes 2 examples/accelerate_loop.py
"""

from __future__ import annotations

import functools  # sg
import sys

import numpy as np
import torch
import transformers
from accelerate import Accelerator

import spikeguard as sg  # sg
from spikeguard.data import load_corpus
from spikeguard.integrations.accelerate import guard_accelerator  # sg
from spikeguard.integrations.exits import exit_status  # sg


class Bytes(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int = 64) -> None:
        tokens = load_corpus("pydoc").train
        self.rows = [torch.from_numpy(tokens[i * seq:(i + 1) * seq].astype(np.int64))
                     for i in range(n)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i].clone()}


def main(steps: int = 100, out: str = "runs/accelerate", accumulate: int = 2) -> sg.Guard:
    accelerator = Accelerator(gradient_accumulation_steps=accumulate)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        attention_dropout=0.1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, sg.schedules.warmup_cosine(warmup_steps=max(1, steps // 10), total_steps=steps))
    loader = torch.utils.data.DataLoader(
        Bytes(steps * 8 * accumulate * accelerator.num_processes), batch_size=8)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    guard = guard_accelerator(accelerator, model, optimizer, scheduler=scheduler, out_dir=out,  # sg
                              config=sg.GuardConfig(detector=sg.DetectorConfig.for_run(steps)))  # sg

    def forward_backward(batch, keep=None):  # sg: the guard re-runs it (keep: rows to keep)
        if keep is not None:
            batch = {k: v[keep] for k, v in batch.items()}
        logits = model(input_ids=batch["input_ids"]).logits
        out = sg.cross_entropy(logits[:, :-1], batch["labels"][:, 1:])  # sg: z-loss, log Z
        accelerator.backward(out.loss)  # divides by gradient_accumulation_steps
        return out

    for batch in loader:
        with accelerator.accumulate(model):
            out = forward_backward(batch)
            guard.accumulate(out, rerun=functools.partial(forward_backward, batch))  # sg
            if accelerator.sync_gradients:  # sg
                guard.step()  # sg: instead of optimizer.step(), scheduler.step(), zero_grad()
    guard.close()  # sg
    return guard


if __name__ == "__main__":
    try:
        main()
    except sg.TrainingHalted as halt:  # sg: Tier 3: the report, exit status 3
        print(halt.report, file=sys.stderr)
        raise SystemExit(exit_status(halt)) from None  # 3, as spikeguard train

"""HF Trainer with spikeguard: a small GPT-2 (built from its config, no download) on the Python
docs' bytes. Every line spikeguard adds or changes is marked ``# sg``
(tests/test_adapters_glue.py counts them for docs/adapters.md).

    PYTHONPATH=src python examples/hf_trainer.py
"""

from __future__ import annotations

import numpy as np
import torch
import transformers

import spikeguard as sg  # sg
from spikeguard.data import load_corpus
from spikeguard.integrations.hf import SpikeguardLoss, guard_trainer  # sg


class Bytes(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int = 64) -> None:
        tokens = load_corpus("pydoc").train
        self.rows = [torch.from_numpy(tokens[i * seq:(i + 1) * seq].astype(np.int64))
                     for i in range(n)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i].clone()}


def main(steps: int = 100, out: str = "runs/hf") -> transformers.Trainer:
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=2))
    args = transformers.TrainingArguments(
        output_dir=out, max_steps=steps, per_device_train_batch_size=8, learning_rate=1e-3,
        max_grad_norm=0,  # sg: the guard clips, after it measured
        logging_nan_inf_filter=False,  # sg: keep a NaN loss visible in the Trainer's log
        report_to="none", use_cpu=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Bytes(steps * 8),
                                   compute_loss_func=SpikeguardLoss(z_loss=1e-4))  # sg
    guard_trainer(trainer, config=sg.GuardConfig(detector=sg.DetectorConfig.for_run(steps)))  # sg
    trainer.train()  # a halt stops the Trainer, writes the report, raises sg.TrainingHalted
    return trainer


if __name__ == "__main__":
    main()

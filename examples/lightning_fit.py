"""Lightning with spikeguard: the reference GPT (tiny preset) as a LightningModule on the Python
docs' bytes. Every line spikeguard adds or changes is marked ``# sg``
(tests/test_adapters_glue.py counts them for docs/adapters.md).

    PYTHONPATH=src python examples/lightning_fit.py
"""

from __future__ import annotations

import lightning.pytorch as L
import numpy as np
import torch

import spikeguard as sg
from spikeguard.data import load_corpus
from spikeguard.integrations.lightning import SpikeguardCallback  # sg

STEPS = 100
guard_cb = SpikeguardCallback(config=sg.GuardConfig(detector=sg.DetectorConfig.for_run(STEPS)))  # sg


class LitGPT(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = sg.GPT(sg.GPTConfig.tiny(seq_len=64))

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.net.loss(self.net(x), y)  # loss, ce and log Z from one pass
        guard_cb.accumulate(out, tokens=x)  # sg: the input ids too (the input-token check)
        return out.loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
        return guard_cb.configure_optimizers(self, opt, sched)  # sg


def batches(n: int, rows: int = 8, seq: int = 64) -> list[tuple[torch.Tensor, torch.Tensor]]:
    t = torch.from_numpy(load_corpus("pydoc").train[:n * rows * seq + 1].astype(np.int64))
    return [(t[i:i + rows * seq].view(rows, seq), t[i + 1:i + rows * seq + 1].view(rows, seq))
            for i in range(0, n * rows * seq, rows * seq)]


def main(out: str = "runs/lightning") -> L.Trainer:
    trainer = L.Trainer(max_steps=STEPS, accelerator="cpu", default_root_dir=out,
                        callbacks=[guard_cb], gradient_clip_val=None)  # sg: the guard clips
    trainer.fit(LitGPT(), torch.utils.data.DataLoader(batches(STEPS), batch_size=None))
    return trainer


if __name__ == "__main__":
    main()

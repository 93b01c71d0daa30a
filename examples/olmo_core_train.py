"""OLMo-core's Trainer with spikeguard: a one-layer llama-like Transformer of OLMo-core's own on
the Python docs' bytes, on CPU. Every line spikeguard adds or changes is marked ``# sg``
(tests/test_adapters_glue.py counts them for docs/adapters.md); tests/test_integrations_olmo.py
runs the same calls with faults injected.

A Tier 2 cancels the run and exits 75 ("relaunch me"); the same command run again makes the
rollback (``next_config``: from the newest healthy checkpoint, the anomaly's steps left out), so
a job script reruns it while it exits 75. A halt exits 3 with ``report.txt`` in the run folder:

    PYTHONPATH=src python examples/olmo_core_train.py; s=$?
    while [ $s -eq 75 ]; do PYTHONPATH=src python examples/olmo_core_train.py; s=$?; done
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from olmo_core.data.data_loader import DataLoaderBase
from olmo_core.nn.transformer import TransformerConfig
from olmo_core.optim import AdamWConfig, CosWithWarmup
from olmo_core.train import Duration, TrainerConfig
from olmo_core.train.callbacks import CheckpointerCallback
from olmo_core.train.train_module import TransformerTrainModuleConfig

import spikeguard as sg
from spikeguard.data import load_corpus
from spikeguard.integrations.exits import exit_status  # sg
from spikeguard.integrations.olmo_core import SpikeguardCallback, next_config  # sg

SEQ, ROWS, STEPS = 64, 8, 100


class Bytes(DataLoaderBase):
    """Consecutive windows of the corpus' bytes; resumable by the batches processed."""

    def __init__(self, work_dir: str) -> None:
        super().__init__(work_dir=work_dir, global_batch_size=ROWS * SEQ)
        self.tokens = load_corpus("pydoc").train

    @property
    def total_batches(self) -> int:
        return len(self.tokens) // (ROWS * SEQ)

    def state_dict(self):
        return {"batches_processed": self.batches_processed, "epoch": self._epoch}

    def load_state_dict(self, state) -> None:
        self.batches_processed, self._epoch = state["batches_processed"], state["epoch"]

    def reshuffle(self, epoch=None, **kwargs) -> None:
        self._epoch = epoch or 1

    def _iter_batches(self):
        for i in range(self.batches_processed, self.total_batches):
            ids = self.tokens[i * ROWS * SEQ:(i + 1) * ROWS * SEQ].astype(np.int64)
            yield {"input_ids": torch.from_numpy(ids).view(ROWS, SEQ)}

    def get_mock_batch(self):
        return {"input_ids": torch.ones(ROWS, SEQ, dtype=torch.long)}

    def global_num_tokens_in_batch(self, batch) -> int:
        return batch["input_ids"].numel()


def main(out: str = "runs/olmo") -> int:
    """Train (or make the rollback the last launch asked for); returns the exit status."""
    model = TransformerConfig.llama_like(vocab_size=256, d_model=64, n_layers=1,
                                         n_heads=2).build(init_device="cpu")
    train_module = TransformerTrainModuleConfig(
        rank_microbatch_size=ROWS * SEQ, max_sequence_length=SEQ, optim=AdamWConfig(lr=3e-3),
        scheduler=CosWithWarmup(warmup_steps=10),
        max_grad_norm=None,  # sg: the guard clips (GuardConfig.clip), after it measured
    ).build(model, device=torch.device("cpu"))
    config = TrainerConfig(
        save_folder=out, save_overwrite=True, max_duration=Duration.steps(STEPS), device="cpu",
        callbacks={"checkpointer": CheckpointerCallback(save_interval=50)},
    )
    config = next_config(config)  # sg: this launch, or the rollback a Tier 2 asked for
    trainer = config.build(train_module, Bytes(f"{out}/work"))
    guard = SpikeguardCallback(  # sg
        config=sg.GuardConfig(detector=sg.DetectorConfig.for_run(STEPS)), cancel_on_tier2=True)  # sg
    trainer.add_callback("spikeguard", guard)  # sg
    try:
        trainer.fit()
    except sg.TrainingHalted as halt:  # sg: report.txt in the run's folder says why
        return exit_status(halt)  # sg: 3
    return exit_status(relaunch=guard.relaunch)  # sg: 75 after a Tier 2, else 0


if __name__ == "__main__":
    sys.exit(main())

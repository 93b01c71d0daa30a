"""torchtitan's ``train.py`` shape with spikeguard in it: the lines that differ from that shape
are marked ``# sg`` (docs/torchtitan.md walks through them).

The shape is torchtitan 0.3.0's entry point (github.com/pytorch/torchtitan, ``torchtitan/train.py``),
written anew here: a ``Trainer.Config`` from torchtitan's registry and command line
(``ConfigManager().parse_args()``), ``config.build()``, ``trainer.train()``, ``trainer.close()``
on the way out, whatever happened, and the process group destroyed. What the guard changes: the
config goes through ``guarded`` (the GuardConfig in it, torchtitan's cross-entropy replaced by
``SpikeguardLoss``: the same loss with log Z), so ``config.build()`` makes a ``GuardedTrainer``;
a halt raises ``TrainingHalted`` out of ``train()``, and the script exits 3 (as ``spikeguard
train`` does). Without a GPU it runs on CPU ranks through spikeguard's torchtitan CPU helper
(bytes as tokens, the Python docs as data: nothing to download):

    torchrun --standalone --nproc-per-node 2 examples/torchtitan_train.py --module llama3 \\
        --config llama3_debugmodel --checkpoint.enable --training.steps 20 \\
        --training.seq_len 64 --training.local_batch_size 2 --dump_folder runs/titan

tests/_titan_job.py runs ``main`` with those arguments and with the debug model's config.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

import spikeguard as sg  # sg

if not torch.cuda.is_available():  # sg: torchtitan on CPU ranks (before torchtitan is imported)
    from spikeguard.integrations import torchtitan_cpu  # sg
from spikeguard.integrations.exits import exit_status  # sg
from spikeguard.integrations.torchtitan import guarded  # sg

__all__ = ["main"]


def main(config: Any = None, *, guard: sg.GuardConfig | None = None,
         argv: list[str] | None = None) -> Any:
    """Train with ``config`` (a torchtitan ``Trainer.Config``; None: from the command line, or
    ``argv``) and the guard's ``guard`` config (default: roll back on a Tier 2). Returns the
    closed trainer."""
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger

    init_logger()
    if config is None:
        config = ConfigManager().parse_args(argv)
        if not torch.cuda.is_available():
            config = torchtitan_cpu.laptop(config)  # sg: bytes, the docs' text, fp32, gloo
    config = guarded(config, guard=guard or sg.GuardConfig(tier2="rollback"))  # sg
    trainer = config.build()
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer


if __name__ == "__main__":
    status = 0
    try:
        main()
    except sg.TrainingHalted as halt:  # sg: report.txt in dump_folder says why
        status = exit_status(halt)  # sg: 3
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    sys.exit(status)

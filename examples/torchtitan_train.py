"""torchtitan's ``train.py`` shape with spikeguard in it: the lines that differ from that shape
are marked ``# sg`` (docs/torchtitan.md walks through them).

The shape is torchtitan 0.3.0's entry point (github.com/pytorch/torchtitan, ``torchtitan/train.py``),
written anew here: a ``Trainer.Config`` from torchtitan's registry and command line
(``ConfigManager().parse_args()``), ``config.build()``, ``trainer.train()``, ``trainer.close()``
on the way out, whatever happened, and the process group destroyed. What the guard changes: the
config goes through ``guarded`` (the GuardConfig in it, torchtitan's cross-entropy replaced by
``SpikeguardLoss``: the same loss with log Z), so ``config.build()`` makes a ``GuardedTrainer``;
a halt raises ``TrainingHalted`` out of ``train()``, a non-zero exit under torchrun.

    torchrun --nproc-per-node 8 examples/torchtitan_train.py --module llama3 \\
        --config llama3_debugmodel

tests/_titan_job.py runs ``main`` with the debug model's config on 2 CPU ranks.
"""

from __future__ import annotations

from typing import Any

import torch

import spikeguard as sg  # sg
from spikeguard.integrations.torchtitan import guarded  # sg

__all__ = ["main"]


def main(config: Any = None, *, guard: sg.GuardConfig | None = None) -> Any:
    """Train with ``config`` (a torchtitan ``Trainer.Config``; None: from the command line) and
    the guard's ``guard`` config (default: roll back on a Tier 2). Returns the closed trainer."""
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger

    init_logger()
    if config is None:
        config = ConfigManager().parse_args()
    config = guarded(config, guard=guard or sg.GuardConfig(tier2="rollback"))  # sg
    trainer = config.build()
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()

"""The training entry point: the reference GPT on a real corpus through the Guard, every defense
on (``spikeguard train``; ``python -m spikeguard train``; torchrun-ready)."""

from .config import NO_DEFENSES, TrainConfig
from .faults import parse_fault
from .loop import TrainResult, evaluate, train
from .rundir import TrainInterrupted

__all__ = ["NO_DEFENSES", "TrainConfig", "TrainInterrupted", "TrainResult", "evaluate",
           "parse_fault", "train"]

"""spikeguard: keep large-model training runs from diverging.

``import spikeguard as sg`` gives the public API; see shared/DESIGN.md for the map.
"""

from .corpus import Corpus, load_corpus
from .detect.metrics import StepMetrics
from .model import GPT, GPTConfig
from .prevent import schedules
from .prevent.budget import MemoryBudget, memory_budget
from .respond.checkpoint import (
    CheckpointError,
    CheckpointInfo,
    CheckpointManager,
    CheckpointWarning,
)
from .respond.data import TokenStream

__version__ = "0.1.0"

__all__ = [
    "GPT",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointWarning",
    "Corpus",
    "GPTConfig",
    "MemoryBudget",
    "StepMetrics",
    "TokenStream",
    "__version__",
    "load_corpus",
    "memory_budget",
    "schedules",
]

"""spikeguard: keep large-model training runs from diverging.

``import spikeguard as sg`` gives the public API; see shared/DESIGN.md for the map.
"""

from .corpus import Corpus, load_corpus
from .detect.metrics import StepMetrics
from .model import GPT, GPTConfig
from .prevent import schedules
from .prevent.budget import MemoryBudget, memory_budget
from .prevent.losses import LossOutput, cross_entropy, linear_cross_entropy, router_z_loss

__version__ = "0.1.0"

__all__ = [
    "GPT",
    "Corpus",
    "GPTConfig",
    "LossOutput",
    "MemoryBudget",
    "StepMetrics",
    "__version__",
    "cross_entropy",
    "linear_cross_entropy",
    "load_corpus",
    "memory_budget",
    "router_z_loss",
    "schedules",
]

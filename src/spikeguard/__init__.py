"""spikeguard: keep large-model training runs from diverging.

``import spikeguard as sg`` gives the public API; see shared/DESIGN.md for the map.
"""

from .corpus import Corpus, load_corpus
from .detect.gradnorm import GradStats, clip_grad_norm_, grad_stats
from .detect.metrics import StepMetrics
from .model import GPT, GPTConfig
from .prevent import schedules
from .prevent.budget import MemoryBudget, memory_budget

__version__ = "0.1.0"

__all__ = [
    "GPT",
    "Corpus",
    "GPTConfig",
    "GradStats",
    "MemoryBudget",
    "StepMetrics",
    "__version__",
    "clip_grad_norm_",
    "grad_stats",
    "load_corpus",
    "memory_budget",
    "schedules",
]

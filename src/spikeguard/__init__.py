"""spikeguard: keep large-model training runs from diverging.

``import spikeguard as sg`` gives what a training loop calls; docs/design.md in the repository
maps the package. Building blocks that a loop does not call directly (the running statistics,
init constants, the attention-logit probe) stay importable from their modules:
``spikeguard.detect.stats``, ``spikeguard.prevent.init``, ``spikeguard.prevent.attention``.
"""

from . import schedules
from .checkpoint import (
    CheckpointError,
    CheckpointInfo,
    CheckpointManager,
    CheckpointWarning,
    verify_checkpoint,
)
from .data import Corpus, TokenStream, load_corpus
from .detect.fp8 import AmaxMonitor
from .detect.gradnorm import GradStats, clip_grad_norm_, grad_stats
from .detect.precision import PrecisionPolicy
from .detect.probes import ProbeConfig, Probes
from .detector import DetectorConfig, SpikeDetector, Verdict
from .guard import (
    AttributionConfig,
    Guard,
    GuardConfig,
    GuardedOptimizer,
    HaltReport,
    TrainingHalted,
)
from .model import GPT, GPTConfig
from .prevent.attention import QKNorm, StackedLogitBoundsWarning, attention, softcap
from .prevent.budget import MemoryBudget, memory_budget
from .prevent.init import fan_in_init_, gpt2_residual_init_
from .prevent.losses import (
    LossOutput,
    cross_entropy,
    linear_cross_entropy,
    router_z_loss,
)
from .prevent.mup import mup_param_groups
from .record import Action, StepMetrics, metrics_record
from .sinks import (
    ConsoleSink,
    JsonlSink,
    SinkDisabledWarning,
    Sinks,
    TensorBoardSink,
    WandbSink,
    read_metrics,
)

__version__ = "0.1.0"

__all__ = [
    "GPT",
    "Action",
    "AmaxMonitor",
    "AttributionConfig",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointWarning",
    "ConsoleSink",
    "Corpus",
    "DetectorConfig",
    "GPTConfig",
    "GradStats",
    "Guard",
    "GuardConfig",
    "GuardedOptimizer",
    "HaltReport",
    "JsonlSink",
    "LossOutput",
    "MemoryBudget",
    "PrecisionPolicy",
    "ProbeConfig",
    "Probes",
    "QKNorm",
    "SinkDisabledWarning",
    "Sinks",
    "SpikeDetector",
    "StackedLogitBoundsWarning",
    "StepMetrics",
    "TensorBoardSink",
    "TokenStream",
    "TrainingHalted",
    "Verdict",
    "WandbSink",
    "attention",
    "clip_grad_norm_",
    "cross_entropy",
    "fan_in_init_",
    "gpt2_residual_init_",
    "grad_stats",
    "linear_cross_entropy",
    "load_corpus",
    "memory_budget",
    "metrics_record",
    "mup_param_groups",
    "read_metrics",
    "router_z_loss",
    "schedules",
    "softcap",
    "verify_checkpoint",
]

"""spikeguard: keep large-model training runs from diverging.

``import spikeguard as sg`` gives the public API; see shared/DESIGN.md for the map.
"""

from .corpus import Corpus, load_corpus
from .detect.gradnorm import GradStats, clip_grad_norm_, grad_stats
from .detect.metrics import StepMetrics, metrics_record
from .detect.stats import EMA, DeviceEMA, DeviceRunningMedian, RunningMedian
from .model import GPT, GPTConfig
from .prevent import schedules
from .prevent.attention import QKNorm, StackedLogitBoundsWarning, attention, logit_p99, softcap
from .prevent.budget import MemoryBudget, memory_budget
from .prevent.init import (
    DeepNormConstants,
    deepnorm_constants,
    fan_in_init_,
    fan_in_std,
    gpt2_residual_init_,
    residual_scale,
)
from .prevent.losses import LossOutput, cross_entropy, linear_cross_entropy, router_z_loss
from .respond.checkpoint import (
    CheckpointError,
    CheckpointInfo,
    CheckpointManager,
    CheckpointWarning,
)
from .respond.data import TokenStream
from .respond.detector import Action, DetectorConfig, SpikeDetector, Verdict
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
    "EMA",
    "GPT",
    "Action",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointWarning",
    "ConsoleSink",
    "Corpus",
    "DeepNormConstants",
    "DetectorConfig",
    "DeviceEMA",
    "DeviceRunningMedian",
    "GPTConfig",
    "GradStats",
    "JsonlSink",
    "LossOutput",
    "MemoryBudget",
    "QKNorm",
    "RunningMedian",
    "SinkDisabledWarning",
    "Sinks",
    "SpikeDetector",
    "StackedLogitBoundsWarning",
    "StepMetrics",
    "TensorBoardSink",
    "TokenStream",
    "Verdict",
    "WandbSink",
    "__version__",
    "attention",
    "clip_grad_norm_",
    "cross_entropy",
    "deepnorm_constants",
    "fan_in_init_",
    "fan_in_std",
    "gpt2_residual_init_",
    "grad_stats",
    "linear_cross_entropy",
    "load_corpus",
    "logit_p99",
    "memory_budget",
    "metrics_record",
    "read_metrics",
    "residual_scale",
    "router_z_loss",
    "schedules",
    "softcap",
]

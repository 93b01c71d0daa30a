"""spikeguard: keep large-model training runs from diverging.

``import spikeguard as sg`` gives the public API; see shared/DESIGN.md for the map.
"""

from .corpus import Corpus, load_corpus
from .detect.metrics import StepMetrics, metrics_record
from .detect.stats import EMA, DeviceEMA, DeviceRunningMedian, RunningMedian
from .model import GPT, GPTConfig
from .prevent import schedules
from .prevent.budget import MemoryBudget, memory_budget
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
    "ConsoleSink",
    "Corpus",
    "DetectorConfig",
    "DeviceEMA",
    "DeviceRunningMedian",
    "GPTConfig",
    "JsonlSink",
    "MemoryBudget",
    "RunningMedian",
    "SinkDisabledWarning",
    "Sinks",
    "SpikeDetector",
    "StepMetrics",
    "TensorBoardSink",
    "Verdict",
    "WandbSink",
    "__version__",
    "load_corpus",
    "memory_budget",
    "metrics_record",
    "read_metrics",
    "schedules",
]

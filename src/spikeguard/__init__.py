"""spikeguard: keep large-model training runs from diverging.

``import spikeguard as sg`` gives what a training loop calls; docs/design.md in the repository
maps the package. Building blocks that a loop does not call directly (the running statistics,
init constants, the attention-logit probe) stay importable from their modules:
``spikeguard.detect.stats``, ``spikeguard.prevent.init``, ``spikeguard.prevent.attention``.
"""

import importlib
from typing import Any

# name -> the module that defines it; imported on first use (PEP 562), so that a command that
# needs no torch (``spikeguard diagnose`` on a CSV) does not pay for importing it
_EXPORTS = {
    "Corpus": ".data",
    "TokenStream": ".data",
    "load_corpus": ".data",
    "AmaxMonitor": ".detect.fp8",
    "GradStats": ".detect.gradnorm",
    "clip_grad_norm_": ".detect.gradnorm",
    "grad_stats": ".detect.gradnorm",
    "PrecisionPolicy": ".detect.precision",
    "ProbeConfig": ".detect.probes",
    "Probes": ".detect.probes",
    "AttributionConfig": ".guard",
    "DataSource": ".guard",
    "Decision": ".guard",
    "GuardMisuseWarning": ".guard",
    "Guard": ".guard",
    "GuardConfig": ".guard",
    "GuardedOptimizer": ".guard",
    "HaltReport": ".guard",
    "TrainingHalted": ".guard",
    "GPT": ".model",
    "GPTConfig": ".model",
    "QKNorm": ".prevent.attention",
    "StackedLogitBoundsWarning": ".prevent.attention",
    "attention": ".prevent.attention",
    "softcap": ".prevent.attention",
    "MemoryBudget": ".prevent.budget",
    "memory_budget": ".prevent.budget",
    "fan_in_init_": ".prevent.init",
    "gpt2_residual_init_": ".prevent.init",
    "LossOutput": ".prevent.losses",
    "cross_entropy": ".prevent.losses",
    "linear_cross_entropy": ".prevent.losses",
    "router_z_loss": ".prevent.losses",
    "mup_param_groups": ".prevent.mup",
    "Action": ".record",
    "StepMetrics": ".record",
    "metrics_record": ".record",
    "CheckpointError": ".checkpoint",
    "CheckpointInfo": ".checkpoint",
    "CheckpointManager": ".checkpoint",
    "CheckpointWarning": ".checkpoint",
    "verify_checkpoint": ".checkpoint",
    "DetectorConfig": ".detector.config",
    "SpikeDetector": ".detector.detector",
    "Verdict": ".detector.detector",
    "schedules": ".schedules",
    "ConsoleSink": ".sinks",
    "JsonlSink": ".sinks",
    "SinkDisabledWarning": ".sinks",
    "Sinks": ".sinks",
    "TensorBoardSink": ".sinks",
    "WandbSink": ".sinks",
    "read_metrics": ".sinks",
}

def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'spikeguard' has no attribute {name!r}")
    mod = importlib.import_module(module, __name__)
    value = mod if module == "." + name else getattr(mod, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


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
    "DataSource",
    "Decision",
    "DetectorConfig",
    "GPTConfig",
    "GradStats",
    "Guard",
    "GuardConfig",
    "GuardMisuseWarning",
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

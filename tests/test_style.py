import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff comes with the dev extra")
def test_ruff_clean():
    r = subprocess.run(["ruff", "check", "src", "tests", "benchmarks", "examples"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


PUBLIC = {
    # prevent
    "GPT", "GPTConfig", "LossOutput", "QKNorm", "StackedLogitBoundsWarning", "attention",
    "cross_entropy", "linear_cross_entropy", "router_z_loss", "softcap", "fan_in_init_",
    "gpt2_residual_init_", "mup_param_groups", "schedules", "MemoryBudget", "memory_budget",
    # detect
    "GradStats", "grad_stats", "clip_grad_norm_", "PrecisionPolicy", "Probes", "ProbeConfig",
    "AmaxMonitor", "StepMetrics", "metrics_record",
    # guard, detector, checkpoint
    "Guard", "GuardConfig", "AttributionConfig", "GuardedOptimizer", "TrainingHalted",
    "HaltReport", "Decision", "DataSource", "GuardMisuseWarning", "Action", "DetectorConfig", "SpikeDetector", "Verdict", "CheckpointManager",
    "CheckpointInfo", "CheckpointError", "CheckpointWarning", "verify_checkpoint",
    # data and sinks
    "Corpus", "TokenStream", "load_corpus", "JsonlSink", "ConsoleSink", "TensorBoardSink",
    "WandbSink", "Sinks", "SinkDisabledWarning", "read_metrics",
}
"""What a training loop calls. Building blocks stay in their modules (below)."""


def test_the_public_api_is_exactly_what_a_loop_calls():
    import spikeguard as sg

    assert set(sg.__all__) == PUBLIC
    assert len(sg.__all__) == len(set(sg.__all__))
    # the version is an attribute, not part of the API a loop calls
    assert isinstance(sg.__version__, str) and "__version__" not in sg.__all__
    # TrainingHalted.report's type is public beside it
    assert sg.HaltReport is sg.TrainingHalted(sg.HaltReport(step=0, reasons=())).report.__class__
    # model-building helpers are importable from their modules, the same objects
    import spikeguard.model
    import spikeguard.prevent.init

    assert spikeguard.model.GPT is sg.GPT and spikeguard.model.GPTConfig is sg.GPTConfig
    assert spikeguard.prevent.init.fan_in_init_ is sg.fan_in_init_
    assert spikeguard.prevent.init.gpt2_residual_init_ is sg.gpt2_residual_init_
    # left top level on purpose: importable from their own modules
    from spikeguard.detect.stats import EMA, DeviceEMA, DeviceRunningMedian, RunningMedian  # noqa: F401
    from spikeguard.prevent.attention import logit_p99  # noqa: F401
    from spikeguard.prevent.init import (  # noqa: F401
        DeepNormConstants,
        deepnorm_constants,
        fan_in_std,
        residual_scale,
    )

    for name in ("EMA", "RunningMedian", "DeepNormConstants", "logit_p99", "fan_in_std"):
        assert not hasattr(sg, name), name
    import spikeguard.schedules

    assert spikeguard.schedules.warmup_cosine is sg.schedules.warmup_cosine


def test_public_modules_declare_all():
    missing = [p for p in (ROOT / "src" / "spikeguard").rglob("*.py")
               if not p.name.startswith("_") and "__all__" not in p.read_text()]
    assert not missing, f"public modules without __all__: {missing}"

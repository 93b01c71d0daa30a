"""Checks that need a CUDA GPU; on a CPU-only machine each says so and skips.

    PYTHONPATH=src:. python benchmarks/gpu_check.py
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

import torch

__all__ = ["check_stats_and_sinks", "main"]


def check_stats_and_sinks() -> None:
    """Device running median / EMA equal the host versions bit for bit on CUDA, and the gate's
    calls plus a JsonlSink.log of CUDA tensors run under ``set_sync_debug_mode("error")``."""
    from spikeguard.detect.metrics import StepMetrics, metrics_record
    from spikeguard.detect.stats import EMA, DeviceEMA, DeviceRunningMedian, RunningMedian
    from spikeguard.sinks import JsonlSink, read_metrics

    dev = torch.device("cuda")
    rng = random.Random(0)
    med, ema = DeviceRunningMedian(500, device=dev), DeviceEMA(1e-3, device=dev)
    hmed, hema = RunningMedian(500), EMA(1e-3)
    xs = torch.tensor([rng.lognormvariate(0, 0.5) * (8 if rng.random() < 0.02 else 1)
                       for _ in range(3000)], dtype=torch.float32, device=dev)
    flags = []
    for x in xs:
        flag = med.exceeds(x, 3.0) | (ema.ratio(x) > 2.0)
        med.update(x, flag)
        ema.update(x, flag)
        flags.append(flag)
    host_x = xs.tolist()
    n_flag = 0
    for x, flag in zip(host_x, flags):
        # the same rules on host floats: x > 3 x median, x / EMA_{t-1} > 2 (history not empty)
        want = (len(hmed) > 0 and x > 3.0 * hmed.value) or (hema.count > 0 and x / hema.value > 2.0)
        assert bool(flag) == want
        n_flag += want
        if not want:
            hmed.update(x)
            hema.update(x)
    assert med.value.item() == hmed.value and ema.value.item() == hema.value
    assert med.values() == hmed.values()
    print(f"stats: device == host bit for bit over {len(host_x)} CUDA steps ({n_flag} flagged)")

    out = Path(tempfile.mkdtemp()) / "m.jsonl"
    sink = JsonlSink(out)
    loss = torch.ones((), device=dev)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(20):
            loss = loss * 1.01
            flag = med.exceeds(loss, 3.0) | (ema.ratio(loss) > 2.0)
            med.update(loss, flag)
            ema.update(loss, flag)
            sink.log(metrics_record(StepMetrics(step=step, loss=loss, grad_norm=loss * 2,
                                                nan_frac=0.0), tier=flag.to(torch.int64)), step)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    sink.close()
    got = read_metrics(out)
    assert [r["step"] for r in got] == list(range(20))
    assert abs(got[-1]["loss"] - 1.01 ** 20) < 1e-5
    print("sinks + gate: no synchronizing CUDA call in 20 steps; records read back")


def main() -> None:
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; skipping every GPU check")
        return
    check_stats_and_sinks()


if __name__ == "__main__":
    main()

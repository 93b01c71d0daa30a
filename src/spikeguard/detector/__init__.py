"""The detector: each step's host numbers in, a tiered verdict out (docs/design.md)."""

from typing import Any

from .config import DetectorConfig
from .detector import SpikeDetector, Verdict

__all__ = ["DetectorConfig", "DeviceGate", "SpikeDetector", "Verdict"]


def __getattr__(name: str) -> Any:
    # the gate runs on the device and needs torch; the host detector does not, so
    # ``spikeguard diagnose`` replays a log through it without importing torch
    if name == "DeviceGate":
        from .gate import DeviceGate

        return DeviceGate
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

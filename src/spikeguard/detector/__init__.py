"""The detector: each step's host numbers in, a tiered verdict out (docs/design.md)."""

from .config import DetectorConfig
from .detector import SpikeDetector, Verdict
from .gate import DeviceGate

__all__ = ["DetectorConfig", "DeviceGate", "SpikeDetector", "Verdict"]

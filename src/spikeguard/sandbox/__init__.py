"""The sandbox page (``spikeguard sandbox``): two widgets driven by Python.

- ``simulate(SimConfig(...))``: the loss-spike sandbox, plain SGD on one noisy parameter whose
  curvature grows with distance from the optimum (``simulation`` states the whole model);
- ``clipping_picture(ClipConfig(...))``: global-norm clipping as a collective, with the
  local-norm bug.

The web server lives in ``spikeguard.sandbox.server`` and needs the ``web`` extra (FastAPI,
uvicorn); importing this package does not import it.
"""

from .clipping import ClipConfig, clipping_picture
from .simulation import SimConfig, SimResult, simulate

__all__ = ["ClipConfig", "SimConfig", "SimResult", "clipping_picture", "simulate"]

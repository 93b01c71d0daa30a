"""The sandbox page (``spikeguard sandbox``): two widgets driven by Python, and one real run.

- ``simulate(SimConfig(...))``: the loss-spike sandbox, plain SGD on one noisy parameter whose
  curvature grows with distance from the optimum (``simulation`` states the whole model);
- ``clipping_picture(ClipPictureConfig(...))``: global-norm clipping as a collective, with the
  local-norm bug;
- ``RealConfig``: real mode, ``spikeguard train`` on ``GPTConfig.tiny()`` with the page's
  toggles, run by the server in a child process and streamed to the page (``real``).

The web server lives in ``spikeguard.sandbox.server`` and needs the ``web`` extra (FastAPI,
uvicorn); importing this package does not import it.
"""

from .clipping import ClipPictureConfig, clipping_picture
from .real import RealConfig
from .simulation import SimConfig, SimResult, simulate

__all__ = ["ClipPictureConfig", "RealConfig", "SimConfig", "SimResult", "clipping_picture",
           "simulate"]

"""What the guard does about a Tier 2 or Tier 3 verdict: one small object per response.

``base.py`` the interface (``Response``, ``Reply``, ``Incident``, ``ResponseConfig``);
``control.py`` what a response may act through (checkpoints, batch ledger, the rollback
budget); ``policy.py`` which responses a tier gets; ``alert.py``, ``rollback.py``,
``halt.py`` (with the reconfigure hook) and ``lower_lr.py`` the responses. docs/design.md,
"How to add a response", walks ``lower_lr.py``.
"""

from .base import Incident, Reply, Response, ResponseConfig
from .lower_lr import LowerLrConfig
from .policy import Policy

__all__ = ["Incident", "LowerLrConfig", "Policy", "Reply", "Response", "ResponseConfig"]

"""The on-call loop: a Tier 2 pages a person, and their answer reaches the running job.

``OnCallConfig`` (where pages go, how long to wait for an answer), ``OnCall`` (the incident, its
page and the decision every rank applies alike), the answer protocol of ``spikeguard respond``
(``answer``), the pager and the watch page (``spikeguard watch``). docs/on-call.md is the guide.
"""

from .answer import Answer, AnswerError, validate, write_answer
from .ask import Decision, OnCall
from .config import OnCallConfig
from .pager import Pager

__all__ = ["Answer", "AnswerError", "Decision", "OnCall", "OnCallConfig", "Pager",
           "validate", "write_answer"]

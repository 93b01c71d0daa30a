"""Post-hoc triage of any run's metrics log (``spikeguard diagnose``).

``diagnose(path)`` reads the log (:mod:`.readers`), finds its spikes (:mod:`.spikes`), replays
the spike detector over it to classify each one and say what to do (:mod:`.classify`,
:mod:`.evidence`, :mod:`.triage`), and :mod:`.report` prints or writes the result.
"""

from .classify import replay, replay_config, rollback_step
from .readers import MetricsLog, read_log, read_quarantine
from .report import print_summary, write_report
from .spikes import FindConfig, find_spikes
from .triage import Diagnosis, Spike, diagnose

__all__ = [
    "Diagnosis",
    "FindConfig",
    "MetricsLog",
    "Spike",
    "diagnose",
    "find_spikes",
    "print_summary",
    "read_log",
    "read_quarantine",
    "replay",
    "replay_config",
    "rollback_step",
    "write_report",
]

"""Where the metrics records go: JSONL (the default), the console, TensorBoard, W&B.

A sink is anything with ``log(record, step)`` (``close()`` is called when present); the record is
the dict of ``spikeguard.record.metrics_record``. The built-in sinks read device tensors one step
late without a sync, and a sink that fails is reported and disabled, never the run. Under
torch.distributed each built-in sink writes on one rank (``rank=0`` by default: one file, one
writer, one run per job); ``rank=None`` writes on every rank to paths holding ``{rank}``.
"""

from ._base import Sink, SinkDisabledWarning, SinkLike, Sinks, host_record
from ._console import ConsoleSink
from ._jsonl import JsonlSink, encode_record, read_metrics
from ._remote import TensorBoardSink, WandbSink

__all__ = [
    "ConsoleSink",
    "JsonlSink",
    "Sink",
    "SinkDisabledWarning",
    "SinkLike",
    "Sinks",
    "TensorBoardSink",
    "WandbSink",
    "encode_record",
    "host_record",
    "read_metrics",
]

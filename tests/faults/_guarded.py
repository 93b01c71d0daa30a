"""A short guarded run of the reference GPT, for the faults that hit what surrounds the step
(the metrics path); and its subprocess form under a file size limit.

python -m tests.faults._guarded PATH LIMIT STEPS: runs STEPS steps with a JsonlSink at PATH and a
collecting sink, with RLIMIT_FSIZE at LIMIT bytes and SIGXFSZ ignored (so a write past the limit
fails with EFBIG, as on a full disk), and prints the collected records and the warnings as one
JSON object on stdout (a pipe: no file size limit applies to it).
"""

from __future__ import annotations

import json
import sys
import warnings
from typing import Any

import torch

import spikeguard as sg
from spikeguard.sinks import encode_record

__all__ = ["Collect", "guarded_loop"]


class Collect:
    """A sink that keeps every record (a plain ``log``: the group hands it host values)."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def log(self, record: dict[str, Any], step: int) -> None:
        self.records.append(record)


def guarded_loop(steps: int, sinks: list[Any], *, seed: int = 0) -> sg.Guard:
    """``steps`` guarded steps of GPTConfig.tiny() on the Python docs corpus; returns the guard
    (closed: its sinks are flushed and closed)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(seed)
        cfg = sg.GPTConfig.tiny()
        model = sg.GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
        data = sg.TokenStream.from_corpus("pydoc", batch_size=4, seq_len=cfg.seq_len, seed=seed)
        guard = sg.Guard(model, opt, data=data, sinks=sinks, config=sg.GuardConfig(
            detector=sg.DetectorConfig.for_run(max(steps, 4)), read_lag=0))
        try:
            while guard.step_index < steps:
                x, y = next(data)
                out = model.loss(model(x), y)
                out.loss.backward()
                guard.step(out)
        finally:
            guard.close()
        return guard
    finally:
        torch.set_num_threads(threads)


def _main(path: str, limit: int, steps: int) -> None:
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    collect = Collect()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        guarded_loop(steps, [sg.JsonlSink(path), collect])
    print(json.dumps({"records": [json.loads(encode_record(r)) for r in collect.records],
                      "warnings": [f"{w.category.__name__}: {w.message}" for w in caught]}))


if __name__ == "__main__":
    _main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))

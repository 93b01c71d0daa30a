"""A guarded run of the reference GPT whose data holds planted garbage sequences, for the
attribution tests: the README's loop with a ``rerun(keep=None)`` closure.

The garbage is written into the token array itself, at the window that batch ``b`` puts in row
``r``: the fault is in the data, so re-running the step reproduces it, as a bad document would.
A gradient multiply (``grad_mult``) is applied after the backward, outside the closure: a
re-run does not reproduce it, as a transient fault would not be.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

import spikeguard as sg
from spikeguard.data import load_corpus
from spikeguard.guard import AttributionConfig, Guard, GuardConfig, TrainingHalted
from spikeguard.sinks import read_metrics


@dataclass
class Run:
    losses: dict[int, float] = field(default_factory=dict)
    verdicts: list[Any] = field(default_factory=list)
    guard: Guard | None = None
    model: Any = None
    stream: Any = None
    halted: TrainingHalted | None = None
    out: Path | None = None

    def final_loss(self, last: int = 20) -> float:
        steps = sorted(self.losses)[-last:]
        return sum(self.losses[s] for s in steps) / len(steps)

    def records(self) -> list[dict[str, Any]]:
        return read_metrics(self.out / "metrics.jsonl")

    def quarantine(self) -> list[dict[str, Any]]:
        path = self.out / "quarantine.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def plant(stream: sg.TokenStream, tokens: np.ndarray, index: int, row: int, *,
          kind: str = "random", seed: int = 0) -> None:
    """Overwrite the window that batch ``index`` puts in ``row`` (its inputs and all but its last
    target): random bytes, or one byte (0xFF) repeated."""
    w = int(stream._window_ids(index)[row]) * stream.seq_len
    gen = np.random.default_rng([seed, index, row])
    n = stream.seq_len
    tokens[w: w + n] = (gen.integers(0, 256, n) if kind == "random" else np.full(n, 0xFF))


def attributed_run(*, steps: int = 300, batch: int = 16, seed: int = 0, out: Path,
                   garbage: tuple[tuple[int, int], ...] = (), kind: str = "repeat",
                   grad_mult: tuple[int, float] | None = None, drop: bool = False,
                   read_lag: int = 0, attribution: AttributionConfig | None = None,
                   tier2: str = "alert", every: int | None = None,
                   rerun: bool = True, detector: dict[str, Any] | None = None) -> Run:
    torch.manual_seed(seed)
    cfg = sg.GPTConfig.tiny()
    model = sg.GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, sg.schedules.warmup_cosine(warmup_steps=20, total_steps=steps, min_ratio=0.1))
    tokens = load_corpus("pydoc").train.copy()
    stream = sg.TokenStream(tokens, batch_size=batch, seq_len=cfg.seq_len, seed=seed)
    for index, row in garbage:
        plant(stream, tokens, index, row, kind=kind, seed=seed)
    ckpt = sg.CheckpointManager(out / "ckpt", every=every, keep=20) if every else None
    attr = attribution or AttributionConfig(drop_sequences=drop)
    # what these runs test is what happens after a skip: the grad rule is held at the flat 3x
    # median (grad_z 1), since on a 60-step run the early spread of the grad norm would widen
    # the bar past the planted row (tests/test_do_no_harm.py and test_detector.py test the bar)
    det = {"grad_z": 1.0, **(detector or {})}
    guard = Guard(model, opt, scheduler=sched, data=stream, checkpoints=ckpt,
                  sinks=[sg.JsonlSink(out / "metrics.jsonl")],
                  config=GuardConfig(detector=sg.DetectorConfig.for_run(steps, **det),
                                     tier2=tier2,
                                     read_lag=read_lag, attribution=attr))
    run = Run(guard=guard, model=model, stream=stream, out=out)
    fired = False
    try:
        while guard.step_index < steps:
            t = guard.step_index
            x, y = next(stream)

            def again(keep: torch.Tensor | None = None, x: torch.Tensor = x,
                      y: torch.Tensor = y) -> Any:
                if keep is not None:
                    x, y = x[keep], y[keep]
                o = model.loss(model(x), y)
                o.loss.backward()
                return o

            o = model.loss(model(x), y)
            o.loss.backward()
            if grad_mult is not None and t == grad_mult[0] and not fired:
                fired = True
                for p in model.parameters():
                    p.grad.mul_(grad_mult[1])
            run.losses[t] = float(o.ce)
            run.verdicts += guard.step(o, rerun=again if rerun else None)
        run.verdicts += guard.flush()
    except TrainingHalted as e:
        run.halted = e
    finally:
        guard.close()
        if ckpt is not None:
            ckpt.close()
    return run

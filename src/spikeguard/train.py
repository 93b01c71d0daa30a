"""The training entry point: the reference GPT on a real corpus (``spikeguard train``).

This is the plain loop every later defense plugs into; it prints the loss as it goes and the
held-out loss at the end.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from ._validate import check_int
from .data import Corpus, load_corpus
from .model import GPT, GPTConfig
from .prevent.schedules import warmup_cosine

__all__ = ["TrainConfig", "TrainResult", "evaluate", "random_batch", "train"]


@dataclass(kw_only=True, frozen=True)
class TrainConfig:
    """One training run of the reference GPT."""

    steps: int = 200
    """Optimizer updates."""
    model: Literal["tiny", "demo", "bench"] = "demo"
    """GPTConfig preset."""
    corpus: Literal["pydoc", "stdlib"] = "pydoc"
    """Default corpus that ships with Python."""
    batch_size: int = 16
    """Sequences per step."""
    lr: float = 3e-3
    """Peak learning rate of AdamW."""
    warmup_steps: int = 20
    """Linear warmup steps before the peak learning rate."""
    min_lr_ratio: float = 0.1
    """Cosine decay floor as a fraction of the peak learning rate, reached at the last step."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value."""
    seed: int = 0
    """Seed for weights and batch order."""
    eval_batches: int = 8
    """Held-out batches for the final evaluation."""
    log_every: int = 10
    """Print the loss every this many steps."""
    out: str | None = None
    """Directory for the run summary (summary.json); none by default."""

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "eval_batches", "log_every"):
            check_int(getattr(self, name), f"TrainConfig.{name}", default=getattr(type(self), name))
        if not self.lr > 0:
            raise ValueError(f"--lr={self.lr} must be positive (3e-3 suits the demo model)")
        if self.warmup_steps < 0:
            raise ValueError(f"--warmup-steps={self.warmup_steps} must be >= 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"--min-lr-ratio={self.min_lr_ratio} must be in [0, 1] (0.1 is usual)")

    def gpt_config(self) -> GPTConfig:
        return getattr(GPTConfig, self.model)()


@dataclass
class TrainResult:
    """What a run measured: the train loss per step and the final held-out loss (nats)."""

    losses: list[float] = field(default_factory=list)
    val_loss: float = math.nan
    unigram_entropy: float = math.nan
    seconds: float = 0.0


def random_batch(tokens: np.ndarray, batch_size: int, seq_len: int, gen: torch.Generator
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of seq_len + 1 tokens: inputs and next-token targets, int64 [B, T]."""
    if len(tokens) <= seq_len + 1:
        raise ValueError(f"corpus of {len(tokens)} tokens is shorter than one window of {seq_len + 1}")
    starts = torch.randint(0, len(tokens) - seq_len - 1, (batch_size,), generator=gen)
    window = torch.from_numpy(np.stack([tokens[s: s + seq_len + 1] for s in starts.tolist()]))
    window = window.long()
    return window[:, :-1], window[:, 1:]


@torch.no_grad()
def evaluate(model: GPT, tokens: np.ndarray, *, batches: int, batch_size: int, seed: int = 1234) -> float:
    """Mean loss over fixed held-out windows (the same windows for a given seed)."""
    was_training = model.training
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    total = 0.0
    for _ in range(batches):
        x, y = random_batch(tokens, batch_size, model.cfg.seq_len, gen)
        total += float(model.loss(model(x), y).ce)
    model.train(was_training)
    return total / batches


def train(cfg: TrainConfig, *, corpus: Corpus | None = None, echo: bool = True) -> TrainResult:
    """Train the reference GPT for ``cfg.steps`` updates and evaluate on the held-out split."""
    from rich.console import Console

    console = Console(quiet=not echo, highlight=False, soft_wrap=True)
    corpus = corpus or load_corpus(cfg.corpus)
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.gpt_config())
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                                  weight_decay=cfg.weight_decay)
    warmup = cfg.warmup_steps
    if warmup >= cfg.steps:
        warmup = cfg.steps - 1
        warnings.warn(f"--warmup-steps={cfg.warmup_steps} is not below --steps={cfg.steps}; "
                      f"warming up over {warmup} steps instead", stacklevel=2)
    schedule = warmup_cosine(warmup_steps=warmup, total_steps=cfg.steps, min_ratio=cfg.min_lr_ratio)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    gen = torch.Generator().manual_seed(cfg.seed)
    result = TrainResult(unigram_entropy=corpus.unigram_entropy())
    console.print(f"{corpus.describe()}; model {cfg.model}: {model.num_params():,} params")
    start = time.perf_counter()
    for step in range(cfg.steps):
        x, y = random_batch(corpus.train, cfg.batch_size, model.cfg.seq_len, gen)
        loss = model.loss(model(x), y).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        scheduler.step()
        result.losses.append(float(loss.detach()))
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            console.print(f"step {step + 1:>5}/{cfg.steps}  loss {result.losses[-1]:.4f}")
    result.seconds = time.perf_counter() - start
    result.val_loss = evaluate(model, corpus.val, batches=cfg.eval_batches, batch_size=cfg.batch_size)
    console.print(f"held-out loss {result.val_loss:.4f} nats (unigram entropy "
                  f"{result.unigram_entropy:.4f}); {cfg.steps / result.seconds:.1f} steps/s")
    if cfg.out:
        out = Path(cfg.out)
        out.mkdir(parents=True, exist_ok=True)
        summary = {"config": asdict(cfg), "corpus_sha256": corpus.sha256, "val_loss": result.val_loss,
                   "unigram_entropy": result.unigram_entropy, "final_loss": result.losses[-1],
                   "seconds": result.seconds}
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return result

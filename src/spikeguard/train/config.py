"""``TrainConfig``: one training run of the reference GPT, every defense on by default.

It embeds the library's own configs rather than copying their defaults: ``gpt`` (the model's
stability knobs; the shape comes from the ``model`` preset) and ``guard`` (clipping, the Tier 2
policy, every detector threshold). The command line is generated from it, so ``--z-loss``,
``--no-qk-norm``, ``--no-clip``, ``--grad-k`` and ``--tier2`` are the same fields the library
reads. ``--defenses none`` is a documented set of overrides for a baseline (:data:`NO_DEFENSES`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from .._validate import check_int, check_positive
from ..detector.config import DetectorConfig
from ..guard import GuardConfig
from ..model import GPTConfig
from ..oncall.config import OnCallConfig
from .faults import parse_fault

__all__ = ["NO_DEFENSES", "SHAPE_FIELDS", "TrainConfig"]

SHAPE_FIELDS = ("vocab_size", "n_layer", "n_head", "n_kv_head", "d_model", "seq_len", "mlp_ratio")
"""GPTConfig fields the ``model`` preset and the data decide (not flags of their own)."""

NO_DEFENSES = {"gpt.z_loss": 0.0, "gpt.qk_norm": False, "guard.clip": None,
               "guard.respond": False}
"""What ``--defenses none`` turns off: z-loss, QK-norm, clipping, and every guard response
(the guard still measures and records). The LR schedule (warmup included) stays, so the two
arms of a comparison differ only in the defenses."""

# fields that may differ between a run and its resume (they do not change what is computed)
# (threads: how many CPU threads compute it, which changes float rounding at most)
_RESUMABLE = ("out", "fresh", "progress", "plot", "eval_batches", "print_every", "threads",
              "oncall")


@dataclass(kw_only=True, frozen=True)
class TrainConfig:
    """One training run of the reference GPT (``spikeguard train``)."""

    steps: int = 300
    """Updates to apply: the LR schedule's length (a loss-scaler overflow counts as one)."""
    make_up_skips: int = 100
    """Each update the guard withholds (a skip) is made up by one more batch, up to this many
    in a run: a skipped batch does not shorten training. 0: every step counts, skipped or not."""
    model: Literal["tiny", "demo", "bench"] = "demo"
    """GPTConfig preset for the shape: tiny (2x64), demo (4x128, T=128), bench (6x384, T=256)."""
    gpt: GPTConfig = field(default_factory=lambda: GPTConfig(qk_norm=True))
    """The model's stability knobs (z-loss, QK-norm, caps, init); the shape comes from model."""
    corpus: Literal["pydoc", "stdlib"] = "pydoc"
    """Text that ships with Python: the docs' topic pages or the standard library's sources."""
    data: str | None = None
    """A text file, a folder of text files or a uint16 .bin of token ids (overrides corpus)."""
    tokenizer: Literal["bytes", "bpe"] = "bytes"
    """Byte tokens (vocab 256) or a BPE trained on the training split (tokenizers library)."""
    vocab_size: int | None = None
    """Vocabulary: BPE size (default 4096), or for a .bin the largest token + 1 when unset."""
    batch_size: int = 16
    """Sequences per step on each rank."""
    lr: float = 3e-3
    """Peak learning rate of AdamW."""
    schedule: Literal["cosine", "wsd"] = "cosine"
    """Warmup then cosine decay, or warmup-stable-decay."""
    warmup_steps: int = 20
    """Linear warmup steps up to the peak learning rate."""
    min_lr_ratio: float = 0.1
    """Decay floor as a fraction of the peak LR, reached at step T = steps (one past the last)."""
    decay_fraction: float = 0.2
    """WSD only: share of the post-warmup steps spent decaying."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay."""
    precision: Literal["auto", "fp32", "bf16-mixed", "fp16-mixed"] = "auto"
    """auto: bf16-mixed on a GPU with bf16, fp32 on CPU."""
    guard: GuardConfig = field(default_factory=GuardConfig)
    """Clipping, the Tier 2 policy and every detector threshold (windows sized to the run)."""
    oncall: OnCallConfig = field(default_factory=OnCallConfig)
    """Where a Tier 2 page goes and, under --tier2 ask, how a person's answer reaches the run."""
    defenses: Literal["all", "none"] = "all"
    """none: a baseline without z-loss, QK-norm, clipping and guard responses."""
    ckpt_every: int = 50
    """Save a checkpoint every this many steps (DIR/checkpoints)."""
    keep: int = 5
    """Checkpoints kept (the newest healthy one is never deleted)."""
    seed: int = 0
    """Seed for weights and batch order."""
    inject: tuple[str, ...] = ()
    """A fault: outlier@S, storm@S:N, grad@S:MULT, nan@S, nan-data@S, lr@S:MULT:LEN, ... (docs)."""
    inject_rank: int | None = None
    """Inject faults on this rank only (default: every rank)."""
    parallel: Literal["none", "ddp", "fsdp"] = "none"
    """Data parallelism under torchrun: DDP or FSDP2 (fully_shard)."""
    out: str = "runs/train"
    """Run directory: config.json, metrics.jsonl, checkpoints/, the plot."""
    fresh: bool = False
    """Start over even when DIR holds a checkpoint of the same config."""
    eval_batches: int = 8
    """Held-out batches for the final evaluation."""
    progress: bool = True
    """Show a progress bar (rank 0)."""
    plot: bool = True
    """Write DIR/run.png at the end (needs matplotlib: the plot extra)."""
    print_every: int = 50
    """Print a line every this many steps when the progress bar is off."""
    threads: int = 1
    """CPU threads for torch's kernels; 0 keeps torch's default, one per core (slower on a
    busy machine: BENCHMARKS.md)."""

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "warmup_steps", "ckpt_every", "keep", "eval_batches",
                     "print_every", "make_up_skips"):
            check_int(getattr(self, name), f"TrainConfig.{name}",
                      minimum=0 if name in ("warmup_steps", "make_up_skips") else 1,
                      default=getattr(type(self), name, None))
        if self.steps < 4:
            raise ValueError(f"TrainConfig.steps={self.steps} must be >= 4 (the detector's "
                             "windows are a quarter of the run)")
        check_positive(self.lr, "TrainConfig.lr", hint="3e-3 suits the demo model")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"TrainConfig.min_lr_ratio={self.min_lr_ratio} must be in [0, 1] "
                             "(0.1 is usual)")
        if not 0.0 < self.decay_fraction <= 1.0:
            raise ValueError(f"TrainConfig.decay_fraction={self.decay_fraction} must be in (0, 1]")
        if self.weight_decay < 0:
            raise ValueError(f"TrainConfig.weight_decay={self.weight_decay} must be >= 0")
        if self.vocab_size is not None:
            check_int(self.vocab_size, "TrainConfig.vocab_size", minimum=2)
        if self.inject_rank is not None:
            check_int(self.inject_rank, "TrainConfig.inject_rank", minimum=0)
        check_int(self.threads, "TrainConfig.threads", minimum=0)
        for spec in self.inject:
            fault = parse_fault(spec)  # a bad spec fails here, before anything is built
            if fault.step >= self.steps:
                raise ValueError(f"--inject {spec}: step {fault.step} is past the run's last "
                                 f"step {self.steps - 1} (--steps {self.steps}), so it would "
                                 f"never fire; choose a step below {self.steps}")
            if fault.kind == "overflow" and self.precision != "fp16-mixed":
                raise ValueError(f"--inject {spec} overflows an fp16 gradient; it needs "
                                 f"--precision fp16-mixed (not {self.precision})")

    def resolved(self) -> TrainConfig:
        """The config as the run uses it: the ``--defenses`` overrides applied and the detector
        windows sized to the run and its warmup (DetectorConfig.for_run), keeping thresholds set
        explicitly."""
        cfg = self
        if cfg.defenses == "none":
            gpt = dataclasses.replace(cfg.gpt, z_loss=0.0, qk_norm=False)
            cfg = dataclasses.replace(cfg, gpt=gpt, guard=dataclasses.replace(
                cfg.guard, clip=None, respond=False))
        det, base = cfg.guard.detector, DetectorConfig()
        changed = {f.name: getattr(det, f.name) for f in dataclasses.fields(det)
                   if getattr(det, f.name) != getattr(base, f.name)}
        det = DetectorConfig.for_run(cfg.steps, warmup_steps=min(cfg.warmup_steps, cfg.steps - 1),
                                     **changed)  # idempotent: sized windows stay
        return dataclasses.replace(cfg, guard=dataclasses.replace(cfg.guard, detector=det))

    def gpt_config(self, vocab_size: int) -> GPTConfig:
        """The model: the preset's shape, this config's knobs, the data's vocabulary."""
        preset = getattr(GPTConfig, self.model)()
        knobs = {f.name: getattr(self.gpt, f.name) for f in dataclasses.fields(GPTConfig)
                 if f.name not in SHAPE_FIELDS}
        return dataclasses.replace(preset, vocab_size=vocab_size, **knobs)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def run_hash(self, data_sha256: str) -> str:
        """sha256 of what determines the computation: the resolved config without the fields a
        resume may change, plus the data's hash. A resume requires the same hash."""
        d = self.to_dict()
        for name in _RESUMABLE:
            d.pop(name, None)
        d["data_sha256"] = data_sha256
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()

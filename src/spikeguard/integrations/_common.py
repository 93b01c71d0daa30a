"""What the HF Trainer and Lightning integrations share: the guard they build (read at once,
scheduler left to the framework), the LR scheduler held on a withheld update, the guard's record
on its way to the framework's logger, and the halt report on disk."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import _dist
from ..guard import Guard, GuardConfig, GuardedOptimizer, TrainingHalted
from ..sinks import JsonlSink, encode_record

__all__ = ["METRICS", "GuardParts", "HeldScheduler", "RecordSink", "build_guard", "input_ids",
           "logger_metrics", "write_report", "write_run_config"]

METRICS = ("loss", "grad_norm", "log_z", "loss_ema_ratio", "nan_frac")
"""The five health metrics that reach the framework's logger, as ``spikeguard/<name>``."""
PREFIX = "spikeguard/"


def input_ids(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The token ids of a model call (``input_ids=``, else its first positional tensor) for the
    guard's input-token check, padding (``attention_mask`` 0) marked -1 without a host read;
    None when they are not integer ids (``inputs_embeds``) or the call has none."""
    ids = kwargs.get("input_ids")
    if ids is None:
        ids = next((a for a in args if torch.is_tensor(a)), None)
    if not torch.is_tensor(ids) or ids.is_floating_point() or ids.dtype == torch.bool:
        return None
    mask = kwargs.get("attention_mask")
    if torch.is_tensor(mask) and mask.shape == ids.shape:
        return ids.masked_fill(mask.to(ids.device) == 0, -1)
    return ids


class HeldScheduler(torch.optim.lr_scheduler.LRScheduler):
    """The framework's LR scheduler, held still on a step whose update the guard withheld.

    The framework calls ``step()`` once per optimizer step, right after it; when the guard's
    last step was skipped (``guard.last_skipped``) the wrapped scheduler is not stepped, so its
    position stays equal to the count of applied updates. ``hold=False`` passes every step
    through (an epoch-interval schedule). ``optimizer`` is the GuardedOptimizer the framework
    sees (Lightning checks that a scheduler belongs to a returned optimizer). Everything else,
    ``state_dict`` included, is the wrapped scheduler's.
    """

    def __init__(self, scheduler: Any, guard: Guard, optimizer: torch.optim.Optimizer, *,
                 hold: bool = True) -> None:
        # no LRScheduler.__init__: the wrapped scheduler owns the schedule and its state
        self.scheduler, self.guard, self.optimizer, self.hold = scheduler, guard, optimizer, hold
        self.held_steps = 0
        """Scheduler steps held back so far (one per withheld update)."""

    def step(self, epoch: Any = None) -> None:  # type: ignore[override]
        if self.hold and self.guard.last_skipped:
            self.held_steps += 1
            return
        if epoch is None:
            self.scheduler.step()
        else:
            self.scheduler.step(epoch)

    def get_last_lr(self) -> list[float]:  # type: ignore[override]
        return self.scheduler.get_last_lr()

    def get_lr(self) -> list[float]:  # type: ignore[override]
        return self.scheduler.get_lr()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        # only reached for names this object lacks (last_epoch, base_lrs, ...)
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def __repr__(self) -> str:
        return f"HeldScheduler({self.scheduler!r})"


class RecordSink:
    """A sink that keeps the guard's latest record for the framework's logger."""

    def __init__(self) -> None:
        self.last: dict[str, Any] | None = None
        self.records = 0
        self.skips = 0

    def log(self, record: dict[str, Any], step: int) -> None:
        self.last = record
        self.records += 1
        self.skips += bool(record.get("skipped"))


def logger_metrics(record: dict[str, Any], skips: int) -> dict[str, float]:
    """The numbers of one record for a framework logger: the five metrics (those known),
    whether the update was skipped, the tier, and the skips so far, under ``spikeguard/``."""
    out: dict[str, float] = {}
    for key in METRICS:
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[PREFIX + key] = float(value)
    out[PREFIX + "skipped"] = float(bool(record.get("skipped")))
    out[PREFIX + "tier"] = float(record.get("tier") or 0)
    out[PREFIX + "skips"] = float(skips)
    return out


@dataclasses.dataclass
class GuardParts:
    guard: Guard
    optimizer: GuardedOptimizer
    records: RecordSink


def build_guard(model: nn.Module, optimizer: torch.optim.Optimizer, config: GuardConfig | None,
                *, sinks: Iterable[Any] | None, out_dir: Path | None, framework: str,
                **guard_kwargs: Any) -> GuardParts:
    """A Guard for a framework's loop: read back at once (the framework steps the LR scheduler
    right after the optimizer), no scheduler of its own, halts deferred to the callback, and a
    ``metrics.jsonl`` in ``out_dir`` beside the given sinks."""
    config = config if config is not None else GuardConfig()
    if not isinstance(config, GuardConfig):
        raise ValueError(f"config must be a GuardConfig, got {type(config).__name__}")
    if config.read_lag == 1:
        raise ValueError(f"GuardConfig.read_lag=1 cannot work under {framework}: it steps the LR "
                         "scheduler right after the optimizer, so the guard must know at once "
                         "whether the update was withheld; leave read_lag=None (0 here)")
    if config.tier2 == "rollback":
        raise ValueError(f"GuardConfig.tier2='rollback' is not supported under {framework}: "
                         "its loop owns the data and the step count; use tier2='alert' (a storm "
                         f"halts) and resume from {framework}'s own checkpoints")
    if isinstance(optimizer, GuardedOptimizer):
        raise ValueError("pass the plain optimizer; the integration wraps it in GuardedOptimizer")
    config = dataclasses.replace(config, read_lag=0)
    records = RecordSink()
    all_sinks: list[Any] = [records, *(sinks or [])]
    if out_dir is not None:
        all_sinks.append(JsonlSink(Path(out_dir) / "metrics.jsonl"))
    guard = Guard(model, optimizer, config=config, scheduler=None, sinks=all_sinks,
                  **guard_kwargs)
    return GuardParts(guard, GuardedOptimizer(optimizer, guard, defer_halt=True), records)


def write_report(halt: TrainingHalted, folder: str | Path) -> Path | None:
    """Write ``report.json`` (strict JSON) and ``report.txt`` into ``folder`` on rank 0;
    returns the JSON path (None on other ranks)."""
    if _dist.rank() != 0:
        return None
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "report.json"
    path.write_text(encode_record(halt.report.to_dict()) + "\n")
    (folder / "report.txt").write_text(str(halt.report) + "\n")
    return path


def write_run_config(folder: str | Path, guard: GuardConfig, *, framework: str,
                     extra: dict[str, Any]) -> None:
    """``config.json`` in ``folder`` (rank 0), in the shape ``spikeguard train`` writes, so that
    ``spikeguard diagnose`` replays the thresholds the run used: ``config.guard`` (the whole
    GuardConfig), ``config.framework``, the run's settings in ``extra`` (``precision``,
    ``z_loss``, ``vocab_size``, ``ckpt_every``, ``steps``...) under ``config`` (z-loss and
    vocabulary also where ``spikeguard train`` puts them, ``config.gpt``) and ``precision`` at
    the top."""
    if _dist.rank() != 0:
        return
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {**extra, "guard": dataclasses.asdict(guard), "framework": framework,
           "gpt": {"z_loss": extra.get("z_loss"), "vocab_size": extra.get("vocab_size")}}
    doc = {"config": cfg, "precision": extra.get("precision"), "framework": framework}
    (folder / "config.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")

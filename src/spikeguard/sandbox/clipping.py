"""The data behind the page's second widget: global-norm clipping as a collective.

Per-step gradient norms over a window of steps. Every number is a pure function of the step
index (a splitmix64 hash), so the picture holds still while the threshold moves: most steps
have ``||g||`` between 0.5 and 0.8, about one in twelve is an outlier 2x to 8x that size.

The gradient is sharded over ``ranks`` ranks (FSDP, tensor parallel): rank r holds a shard with
local norm ``||g_r||`` and ``sum_r ||g_r||^2 = ||g||^2``. On an outlier step most of the excess
sits in one rank's shard (one bad layer). Global clipping scales every shard by the same
``min(1, c / ||g||)``, which needs ``||g||``: an all-reduce of the local sums of squares. The bug
is to clip each shard by its own ``min(1, c / ||g_r||)`` (calling a single-process clip on a
sharded model): the ranks then scale by different factors, the update changes direction, and
its norm can reach ``sqrt(ranks) * c``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from .._validate import check_int, check_positive

__all__ = ["OUTLIER_RATE", "ClipPictureConfig", "clipping_picture", "step_norm"]

OUTLIER_RATE = 0.08
"""Share of steps that are outliers."""

_MASK = (1 << 64) - 1


def _unit(step: int, salt: int) -> float:
    """A uniform number in [0, 1) from (step, salt): the splitmix64 finaliser."""
    x = (step * 0x9E3779B97F4A7C15 + (salt + 1) * 0xD1B54A32D192ED03) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return (x ^ (x >> 31)) / 2.0**64


def step_norm(step: int) -> float:
    """The global gradient norm ``||g||`` of ``step`` (a pure function of the index)."""
    base = 0.5 + 0.3 * _unit(step, 0)
    if _unit(step, 1) < OUTLIER_RATE:
        base *= 2.0 + 6.0 * _unit(step, 2)
    return base


def _shares(step: int, ranks: int) -> list[float]:
    """Each rank's share of ``||g||^2`` (they sum to 1)."""
    weights = [0.5 + _unit(step, 10 + r) for r in range(ranks)]
    norm = step_norm(step)
    quiet = 0.5 + 0.3 * _unit(step, 0)
    if norm > quiet:  # an outlier: the extra squared norm lands in one rank's shard
        total = sum(weights)
        weights = [w / total * quiet**2 for w in weights]
        weights[int(_unit(step, 3) * ranks)] += norm**2 - quiet**2
    total = sum(weights)
    return [w / total for w in weights]


@dataclass(kw_only=True, frozen=True)
class ClipPictureConfig:
    """The second widget's controls."""

    c: float = 1.0
    """Clipping threshold on the global norm (0 < c <= 100)."""
    ranks: int = 4
    """Ranks the gradient is sharded over (2 to 16)."""
    start: int = 0
    """First step of the window (0 to 10**6)."""
    steps: int = 80
    """Steps in the window (10 to 400)."""
    local: bool = False
    """Clip each rank's shard by its own local norm (the bug) instead of the global norm."""

    def __post_init__(self) -> None:
        check_positive(self.c, "c", default=1.0)
        if self.c > 100:
            raise ValueError(f"c={self.c!r} must be <= 100 (default 1.0)")
        check_int(self.ranks, "ranks", minimum=2, default=4)
        if self.ranks > 16:
            raise ValueError(f"ranks={self.ranks} must be <= 16 (default 4)")
        check_int(self.start, "start", minimum=0, default=0)
        if self.start > 10**6:
            raise ValueError(f"start={self.start} must be <= 1000000 (default 0)")
        check_int(self.steps, "steps", minimum=10, default=80)
        if self.steps > 400:
            raise ValueError(f"steps={self.steps} must be <= 400 (default 80)")
        if not isinstance(self.local, bool):
            raise ValueError(f"local={self.local!r} must be true or false")


def clipping_picture(cfg: ClipPictureConfig | None = None) -> dict[str, Any]:
    """The window's bars and per-rank scale factors, as plain JSON types.

    Keys: ``step``, ``norm`` (``||g||``), ``kept`` (``min(||g||, c)``), ``shaved``
    (``||g|| - kept``), ``rank_norm`` and ``scale`` (per step, one value per rank: the factor
    each rank multiplies its shard by), ``update_norm`` (the norm of the update after clipping:
    ``kept`` under global clipping, larger under the bug), ``selected`` (index of the window's
    largest norm), ``clipped`` (how many bars exceed c).
    """
    cfg = cfg or ClipPictureConfig()
    c = cfg.c
    steps = list(range(cfg.start, cfg.start + cfg.steps))
    norm = [step_norm(s) for s in steps]
    kept = [min(n, c) for n in norm]
    rank_norm: list[list[float]] = []
    scale: list[list[float]] = []
    update: list[float] = []
    for s, n in zip(steps, norm):
        local = [n * math.sqrt(p) for p in _shares(s, cfg.ranks)]
        if cfg.local:
            f = [min(1.0, c / g) for g in local]
        else:
            f = [min(1.0, c / n)] * cfg.ranks
        rank_norm.append(local)
        scale.append(f)
        update.append(math.sqrt(sum((fr * g) ** 2 for fr, g in zip(f, local))))
    return {"config": asdict(cfg), "step": steps, "norm": norm, "kept": kept,
            "shaved": [n - k for n, k in zip(norm, kept)], "rank_norm": rank_norm,
            "scale": scale, "update_norm": update, "selected": max(range(len(norm)),
                                                                     key=norm.__getitem__),
            "clipped": sum(n > c for n in norm)}

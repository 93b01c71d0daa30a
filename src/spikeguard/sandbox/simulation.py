"""The loss-spike sandbox's simulated run: plain SGD on one noisy parameter.

A picture of the mechanism, small enough to state in full (the constants below are the model):

- one parameter ``w`` with its optimum at 0 and excess loss
  ``E(w) = s(t) (H w^2 / 2 + K w^4 / 4)``. The curvature ``s(t) (H + 3 K w^2)`` grows with the
  distance from the optimum, so a big step lands where the gradient is bigger, and the next step
  is bigger still (positive feedback);
- ``s(t) = 1 + S0 exp(-t / TAU)``: the surface is sharper early in training, the fragile phase
  that warmup is for;
- a logit-scale state ``z >= 0`` multiplies every gradient by ``exp(z)`` (sharper logits give
  larger gradients). An update larger than ``D0`` raises ``z`` by ``BETA (|update| - D0)``;
  nothing pulls it back except z-loss, which shrinks it by ``ZL`` per step;
- the minibatch gradient is ``g = exp(z) (E'(w) + SIGMA n_t + x_t)`` with Gaussian noise ``n_t``
  and, at ``spike_rate`` per step, an outlier batch ``x_t = +-spike_size * P_t`` where ``P_t`` is
  Pareto(ALPHA) >= 1 (a heavy tail: one outlier in ten is 4.6x the spike size or more);
- SGD: ``w <- w - lr_t g``, ``lr_t = peak_lr * warmup_cosine(t)`` (floor 10% of the peak; no
  warmup means the cosine starts at the peak). Clipping rescales ``g`` to norm ``c`` when
  ``|g| > c``, so an SGD step is at most ``lr_t c``. (AdamW normalises its update, so there the
  step is bounded by the learning rate anyway and clipping does not cap it: this is an SGD
  picture, not a claim about AdamW.)
- the reported loss is ``L(t) + exp(z) E(w) + 0.05 |x_t| + 0.02 m_t``: ``L(t)`` a smooth
  power-law decay (the rest of the model learning), an outlier batch's own high loss, and batch
  noise ``m_t``;
- float32 overflow: once the loss, the gradient or ``exp(z)`` passes float32's largest finite
  value, that step's loss is NaN and so is every later one (the red flatline).

Deterministic: every random draw comes from ``numpy.random.default_rng(seed)``, drawn before the
loop in a fixed order, so runs with the same seed and length share their noise and outlier
positions, whatever the other settings.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from .._validate import check_int, check_positive

__all__ = ["FLOAT32_MAX", "MODEL", "SimConfig", "SimResult", "lr_schedule", "simulate"]

FLOAT32_MAX = float(np.finfo(np.float32).max)
"""3.4028234663852886e38: a value above this overflows float32 and the step goes NaN."""

MODEL = {"H": 1.0, "K": 0.5, "S0": 14.0, "TAU": 800.0, "W0": 0.15, "SIGMA": 0.5, "ALPHA": 1.5,
         "BETA": 0.05, "D0": 0.2, "ZL": 0.01, "MIN_RATIO": 0.1}
"""The model's constants (see the module docstring); the page shows them from here."""

_LOG_FLOAT32_MAX = math.log(FLOAT32_MAX)
_MAX_STEPS = 20_000


def _in_range(value: Any, name: str, lo: float, hi: float, default: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not lo <= value <= hi:  # NaN fails both comparisons
        raise ValueError(f"{name}={value!r} must be a number in [{lo:g}, {hi:g}] "
                         f"(default {default!r})")
    return float(value)


@dataclass(kw_only=True, frozen=True)
class SimConfig:
    """One simulated run: the page's sliders and toggles."""

    steps: int = 10_000
    """Optimizer steps to simulate (100 to 20,000)."""
    peak_lr: float = 0.1
    """Peak SGD learning rate (0 < peak_lr <= 1)."""
    spike_rate: float = 0.002
    """Chance per step of an outlier batch (0 to 0.05)."""
    spike_size: float = 5.0
    """Scale of an outlier batch's gradient kick (0 to 100; the ordinary noise has std SIGMA)."""
    clip: bool = False
    """Global-norm clipping of the gradient at ``clip_c``."""
    clip_c: float = 1.0
    """Clipping threshold c (0 < c <= 100)."""
    warmup: bool = False
    """Linear warmup over ``warmup_steps`` before the cosine decay."""
    warmup_steps: int = 1000
    """Warmup length when ``warmup`` is on (fewer than ``steps``)."""
    z_loss: bool = False
    """z-loss: pulls the logit-scale state back towards 0 every step."""
    seed: int = 1
    """Seed of every random draw (0 to 2**32 - 1)."""

    def __post_init__(self) -> None:
        check_int(self.steps, "steps", minimum=100, default=10_000)
        if self.steps > _MAX_STEPS:
            raise ValueError(f"steps={self.steps} must be <= {_MAX_STEPS} (default 10000)")
        _in_range(self.peak_lr, "peak_lr", 0.0, 1.0, 0.1)
        check_positive(self.peak_lr, "peak_lr", default=0.1)
        _in_range(self.spike_rate, "spike_rate", 0.0, 0.05, 0.002)
        _in_range(self.spike_size, "spike_size", 0.0, 100.0, 5.0)
        _in_range(self.clip_c, "clip_c", 0.0, 100.0, 1.0)
        check_positive(self.clip_c, "clip_c", default=1.0)
        check_int(self.warmup_steps, "warmup_steps", minimum=1, default=1000)
        if self.warmup_steps >= self.steps:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be below steps={self.steps}")
        check_int(self.seed, "seed", minimum=0, default=1)
        if self.seed >= 2**32:
            raise ValueError(f"seed={self.seed} must be below 2**32 (default 1)")
        for name in ("clip", "warmup", "z_loss"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be true or false")


@dataclass(kw_only=True)
class SimResult:
    """A simulated run. Series hold one value per step that completed (``nan_step`` of them when
    the run went NaN, ``steps`` otherwise)."""

    config: SimConfig
    loss: list[float]
    """Reported loss per step (before that step's update)."""
    grad_norm: list[float]
    """|g| before clipping."""
    lr: list[float]
    """Learning rate used by each step."""
    logit_scale: list[float]
    """exp(z): the gradient multiplier of the logit-scale state."""
    nan_step: int | None = None
    """First step whose loss is NaN (float32 overflow), or None: the run survived."""
    steps_clipped: int = 0
    """Steps whose gradient clipping rescaled."""
    spikes: list[int] = field(default_factory=list)
    """Steps that drew an outlier batch."""

    @property
    def survived(self) -> bool:
        return self.nan_step is None

    @property
    def final_loss(self) -> float | None:
        """The last step's loss, or None when the run ended NaN."""
        return self.loss[-1] if self.survived else None

    def to_json(self) -> dict[str, Any]:
        """Plain JSON types for the page: the loss (4 decimals) and LR (6 decimals) per step,
        summaries for the rest (the payload's size is most of the endpoint's cost). No NaN or
        infinity anywhere."""
        return {"config": asdict(self.config), "model": dict(MODEL), "nan_step": self.nan_step,
                "survived": self.survived, "final_loss": self.final_loss,
                "steps_clipped": self.steps_clipped, "spikes": self.spikes,
                "peak_logit_scale": max(self.logit_scale, default=1.0),
                "peak_grad_norm": max(self.grad_norm, default=0.0),
                "loss": np.round(np.asarray(self.loss, dtype=np.float64), 4).tolist(),
                "lr": np.round(np.asarray(self.lr, dtype=np.float64), 6).tolist()}


def _draws(cfg: SimConfig) -> tuple[list[float], list[float], list[int]]:
    """Per-step gradient kick (noise + outlier), the loss's batch term (the outlier batch's own
    loss + noise), outlier steps; fixed draw order."""
    n = cfg.steps
    rng = np.random.default_rng(cfg.seed)
    noise = rng.standard_normal(n)
    hit = rng.random(n) < cfg.spike_rate
    tail = (1.0 - rng.random(n)) ** (-1.0 / MODEL["ALPHA"])   # Pareto(ALPHA) >= 1
    sign = np.where(rng.random(n) < 0.5, -1.0, 1.0)
    batch = rng.standard_normal(n)
    outlier = np.where(hit, cfg.spike_size * tail * sign, 0.0)
    kick = MODEL["SIGMA"] * noise + outlier
    return kick.tolist(), (0.05 * np.abs(outlier) + 0.02 * batch).tolist(), \
        np.flatnonzero(hit).tolist()


def lr_schedule(cfg: SimConfig) -> np.ndarray:
    """``peak_lr * warmup_cosine(t)`` for every step at once (float64): the library's schedule
    (``spikeguard.schedules.warmup_cosine``, floor MIN_RATIO, no warmup when ``warmup`` is off)
    evaluated with numpy, because 10,000 calls of it would cost more than the whole simulation.
    The tests hold it equal to the schedule itself."""
    n, lo = cfg.steps, MODEL["MIN_RATIO"]
    warm = cfg.warmup_steps if cfg.warmup else 0
    t = np.arange(n, dtype=np.float64)
    cosine = lo + (1.0 - lo) * 0.5 * (1.0 + np.cos(np.pi * (t - warm) / (n - warm)))
    mult = np.where(t < warm, (t + 1.0) / max(warm, 1), cosine)
    return cfg.peak_lr * mult


def simulate(cfg: SimConfig | None = None) -> SimResult:
    """Run the model in the module docstring for ``cfg.steps`` SGD steps (a few ms per 10k)."""
    cfg = cfg or SimConfig()
    m = MODEL
    n = cfg.steps
    kick, jitter, spikes = _draws(cfg)
    lr_arr = lr_schedule(cfg)
    lrs = lr_arr.tolist()
    t = np.arange(n, dtype=np.float64)
    sharp = (1.0 + m["S0"] * np.exp(-t / m["TAU"])).tolist()
    floor = (2.0 + 8.8 * (1.0 + t / 100.0) ** -0.35).tolist()
    h, k, beta, d0 = m["H"], m["K"], m["BETA"], m["D0"]
    keep = 1.0 - m["ZL"] if cfg.z_loss else 1.0
    clip, c, fmax, zmax, exp = cfg.clip, cfg.clip_c, FLOAT32_MAX, _LOG_FLOAT32_MAX, math.exp
    w, z, amp, clipped = m["W0"], 0.0, 1.0, 0
    loss: list[float] = []
    norms: list[float] = []
    scales: list[float] = []
    add_loss, add_norm, add_scale = loss.append, norms.append, scales.append
    nan_step = None
    for i in range(n):
        s = sharp[i]
        w2 = w * w
        value = floor[i] + amp * s * (0.5 * h * w2 + 0.25 * k * w2 * w2) + jitter[i]
        g = amp * (s * (h * w + k * w2 * w) + kick[i])
        gn = g if g >= 0.0 else -g
        if not (value <= fmax and gn <= fmax):   # NaN fails too
            nan_step = i
            break
        add_loss(value)
        add_norm(gn)
        add_scale(amp)
        if clip and gn > c:
            g *= c / gn
            clipped += 1
        step = lrs[i] * g
        w -= step
        big = (step if step >= 0.0 else -step) - d0
        if big > 0.0 or (z != 0.0 and keep != 1.0):
            if big > 0.0:
                z += beta * big
            z *= keep
            if z > zmax:   # exp(z) itself would overflow float32: the next step is NaN
                nan_step = i + 1
                break
            amp = exp(z)
    done = len(loss)
    if nan_step is not None and nan_step >= n:
        nan_step = None   # the overflow would have come after the last step
    return SimResult(config=cfg, loss=loss, grad_norm=norms, lr=lrs[:done], logit_scale=scales,
                     nan_step=nan_step, steps_clipped=clipped,
                     spikes=[s for s in spikes if s < done])

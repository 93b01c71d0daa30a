"""Initialization that keeps activations in range before step 1.

- fan-in init: std = gain / sqrt(fan_in), so a linear layer keeps its input's variance;
- GPT-2 residual scaling: each residual branch's output projection starts at std / sqrt(2L), so
  the residual stream's variance stays bounded as the depth L grows (without it, L blocks add L
  roughly independent contributions and the stream's std grows like sqrt(L));
- DeepNorm (post-LN decoders): x <- LN(alpha x + f(x)), with branch weights scaled by beta;
- muP's hidden init: matrices whose two dims grow with the width start at std * sqrt(base / width),
  variance proportional to 1 / fan_in, equal to the standard init at the base width
  (the rest of muP, and why, is in :mod:`spikeguard.prevent.mup`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from .._validate import check_int

__all__ = [
    "DeepNormConstants",
    "deepnorm_constants",
    "fan_in_init_",
    "fan_in_std",
    "gpt2_residual_init_",
    "mup_hidden_init_",
    "residual_scale",
]


def fan_in_std(fan_in: int, gain: float = 1.0) -> float:
    """gain / sqrt(fan_in): the std that keeps a linear layer's output variance at its input's."""
    check_int(fan_in, "fan_in")
    if not gain > 0:
        raise ValueError(f"gain={gain} must be positive (1.0 for linear, sqrt(2) for ReLU)")
    return gain / math.sqrt(fan_in)


@torch.no_grad()
def fan_in_init_(weight: torch.Tensor, gain: float = 1.0) -> torch.Tensor:
    """Fill a [out, in, ...] weight in place from N(0, fan_in_std(in * prod(rest), gain)^2)."""
    if weight.dim() < 2:
        raise ValueError(f"fan-in init needs a weight with >= 2 dims, got shape {tuple(weight.shape)}")
    if not weight.dtype.is_floating_point:
        raise ValueError(f"fan-in init needs a floating-point weight, got {weight.dtype}")
    fan_in = weight[0].numel()
    return nn.init.normal_(weight, std=fan_in_std(fan_in, gain))


def residual_scale(n_layer: int) -> float:
    """1 / sqrt(2 L): GPT-2's factor for residual-branch output weights (two branches a block)."""
    check_int(n_layer, "n_layer")
    return 1.0 / math.sqrt(2 * n_layer)


@torch.no_grad()
def gpt2_residual_init_(weights: list[torch.Tensor], n_layer: int, std: float = 0.02) -> None:
    """Refill each residual-branch output weight from N(0, (std / sqrt(2 L))^2), in place."""
    if not std > 0:
        raise ValueError(f"std={std} must be positive (GPT-2 uses 0.02)")
    scaled = std * residual_scale(n_layer)
    weights = list(weights)
    if not weights:
        raise ValueError("gpt2_residual_init_(weights=[]): no weights to scale; pass each "
                         "block's residual-branch output projections (attention and MLP)")
    for w in weights:
        nn.init.normal_(w, std=scaled)


@torch.no_grad()
def mup_hidden_init_(weights: list[torch.Tensor], *, base_width: int, width: int,
                     std: float = 0.02) -> None:
    """Refill each hidden matrix from N(0, std^2 * base_width / width), in place (muP)."""
    check_int(base_width, "base_width")
    check_int(width, "width")
    if not std > 0:
        raise ValueError(f"std={std} must be positive (GPT-2 uses 0.02)")
    scaled = std * math.sqrt(base_width / width)
    for w in weights:
        nn.init.normal_(w, std=scaled)


@dataclass(frozen=True)
class DeepNormConstants:
    """DeepNorm's residual multiplier and branch-weight gain for a decoder of N layers."""

    alpha: float
    """Multiplier on the residual x in LN(alpha x + f(x)): (2N)^(1/4)."""
    beta: float
    """Gain on the branch's value and output projections at init: (8N)^(-1/4)."""


def deepnorm_constants(n_layer: int) -> DeepNormConstants:
    """Decoder-only DeepNorm constants: alpha = (2N)^(1/4), beta = (8N)^(-1/4)."""
    check_int(n_layer, "n_layer")
    return DeepNormConstants(alpha=(2 * n_layer) ** 0.25, beta=(8 * n_layer) ** -0.25)

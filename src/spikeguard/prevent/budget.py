"""Static memory budget of a training run: bytes per parameter, ZeRO sharding, activations.

Conventions: GB is 1e9 bytes. The static footprint counts parameters, gradients and AdamW
state; activations are estimated on their own line because they scale with batch and sequence
length, not with the parameter count.

Recipes (bytes per parameter, AdamW):

* ``bf16-mixed``: 4 fp32 master params + 4 fp32 grads + 4 m + 4 v + 2 bf16 compute copy = 18.
* ``fp32``: 4 params + 4 grads + 4 m + 4 v = 16.
* ``fp16-mixed`` (dynamic loss scaling): 2 fp16 params + 2 fp16 grads + 4 fp32 master + 4 m +
  4 v = 16 (the ZeRO paper's accounting; the scaler itself is one scalar).

ZeRO stages over N GPUs: stage 1 shards the optimizer part (master params, m, v), stage 2 also
the gradients, stage 3 also the parameters the forward pass reads.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

from .._validate import check_int

__all__ = ["MODELS", "RECIPES", "MemoryBudget", "ModelShape", "activation_bytes", "memory_budget"]

Recipe = Literal["bf16-mixed", "fp32", "fp16-mixed"]

# (component, bytes per parameter, what ZeRO shards it from: 1 optimizer, 2 grads, 3 params)
RECIPES: dict[str, tuple[tuple[str, int, int], ...]] = {
    "bf16-mixed": (
        ("fp32 master params", 4, 1),
        ("fp32 grads", 4, 2),
        ("adam m (fp32)", 4, 1),
        ("adam v (fp32)", 4, 1),
        ("bf16 compute copy", 2, 3),
    ),
    "fp32": (
        ("fp32 params", 4, 3),
        ("fp32 grads", 4, 2),
        ("adam m (fp32)", 4, 1),
        ("adam v (fp32)", 4, 1),
    ),
    "fp16-mixed": (
        ("fp16 params", 2, 3),
        ("fp16 grads", 2, 2),
        ("fp32 master params", 4, 1),
        ("adam m (fp32)", 4, 1),
        ("adam v (fp32)", 4, 1),
    ),
}


@dataclass(kw_only=True, frozen=True)
class ModelShape:
    """A named transformer's size, for ``spikeguard budget NAME``."""

    n_params: float
    """Parameter count."""
    n_layers: int
    """Transformer blocks."""
    hidden: int
    """Model width h."""
    n_heads: int
    """Attention heads a."""
    seq_len: int
    """Default sequence length s for the activation estimate."""


MODELS: dict[str, ModelShape] = {
    "gpt2": ModelShape(n_params=124e6, n_layers=12, hidden=768, n_heads=12, seq_len=1024),
    "gpt2-xl": ModelShape(n_params=1.5e9, n_layers=48, hidden=1600, n_heads=25, seq_len=1024),
    "7b": ModelShape(n_params=7e9, n_layers=32, hidden=4096, n_heads=32, seq_len=4096),
    "13b": ModelShape(n_params=13e9, n_layers=40, hidden=5120, n_heads=40, seq_len=4096),
    "70b": ModelShape(n_params=70e9, n_layers=80, hidden=8192, n_heads=64, seq_len=4096),
}


@dataclass(kw_only=True, frozen=True)
class MemoryBudget:
    """The answer of :func:`memory_budget`. Bytes are plain integers-as-floats; GB = 1e9 bytes."""

    n_params: float
    """Parameter count."""
    recipe: str
    """Precision recipe name."""
    n_gpus: int
    """GPUs the state is sharded over."""
    zero_stage: int
    """ZeRO stage 0-3."""
    bytes_per_param: float
    """Static bytes per parameter, unsharded."""
    components: dict[str, float]
    """Bytes per parameter of each piece of state."""
    total_bytes: float
    """Static bytes of the whole model, all GPUs together, unsharded."""
    per_gpu_bytes: float
    """Static bytes one GPU holds at this ZeRO stage."""
    activation_bytes: float | None
    """Activation bytes per GPU for one micro-batch, when the shape is known."""

    def to_dict(self) -> dict:
        return asdict(self)


Attention = Literal["flash", "eager"]
ATTENTION = ("flash", "eager")


def activation_bytes(
    *, seq_len: int, batch: int, hidden: int, n_heads: int, n_layers: int, recompute: bool = False,
    attention: Attention = "flash",
) -> float:
    """Activation bytes of one micro-batch (16-bit activations, Korthikanti et al. 2022).

    Per layer, without recompute: 34*s*b*h for the layer's matmul inputs, norms, GELU and
    dropout masks, plus the attention's own: ``"eager"`` stores the a*s*s scores, their softmax
    and its dropout mask (5*a*s*s*b bytes); ``"flash"`` (FlashAttention, torch's SDPA kernels)
    stores none of them, only the fp32 log-sum-exp of each row (4*a*s*b bytes), and recomputes
    the scores in the backward. Full recompute keeps the layer input only: 2*s*b*h."""
    for name, value in (("seq_len", seq_len), ("batch", batch), ("hidden", hidden),
                        ("n_heads", n_heads), ("n_layers", n_layers)):
        check_int(value, name)
    if attention not in ATTENTION:
        raise ValueError(f"attention={attention!r} must be 'flash' (SDPA/FlashAttention: no "
                         f"scores stored) or 'eager' (the s x s scores stored)")
    s, b, h, a = seq_len, batch, hidden, n_heads
    if recompute:
        per_layer = 2.0 * s * b * h
    elif attention == "eager":
        per_layer = s * b * h * (34.0 + 5.0 * a * s / h)
    else:
        per_layer = 34.0 * s * b * h + 4.0 * a * s * b
    return per_layer * n_layers


def memory_budget(
    n_params: float,
    *,
    n_gpus: int = 1,
    zero_stage: int = 0,
    recipe: Recipe = "bf16-mixed",
    seq_len: int | None = None,
    batch: int = 1,
    hidden: int | None = None,
    n_heads: int | None = None,
    n_layers: int | None = None,
    recompute: bool = False,
    attention: Attention = "flash",
) -> MemoryBudget:
    """Static memory of AdamW training, and activations when the shape is given.

    >>> b = memory_budget(13e9, n_gpus=8, zero_stage=3)
    >>> b.bytes_per_param, b.total_bytes / 1e9, b.per_gpu_bytes / 1e9
    (18, 234.0, 29.25)
    """
    if not n_params > 0:
        raise ValueError(f"n_params={n_params} must be positive (e.g. 13e9 for a 13B model)")
    if recipe not in RECIPES:
        raise ValueError(f"recipe={recipe!r} is unknown; choose one of {sorted(RECIPES)}")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage} must be 0, 1, 2 or 3")
    if n_gpus < 1:
        raise ValueError(f"n_gpus={n_gpus} must be at least 1")
    parts = RECIPES[recipe]
    bpp = sum(nbytes for _, nbytes, _ in parts)
    per_gpu_bpp = sum(
        nbytes / n_gpus if zero_stage >= shard_stage else nbytes for _, nbytes, shard_stage in parts
    )
    shape = (seq_len, hidden, n_heads, n_layers)
    if all(v is not None for v in shape):
        act = activation_bytes(seq_len=seq_len, batch=batch, hidden=hidden, n_heads=n_heads,
                               n_layers=n_layers, recompute=recompute, attention=attention)
    elif any(v is not None for v in shape):
        missing = [n for n, v in zip(("seq_len", "hidden", "n_heads", "n_layers"), shape) if v is None]
        raise ValueError(f"activation estimate needs seq_len, hidden, n_heads and n_layers; "
                         f"missing {missing} (or give none of them)")
    else:
        act = None
    return MemoryBudget(
        n_params=n_params, recipe=recipe, n_gpus=n_gpus, zero_stage=zero_stage,
        bytes_per_param=bpp, components={name: nb for name, nb, _ in parts},
        total_bytes=bpp * n_params, per_gpu_bytes=per_gpu_bpp * n_params, activation_bytes=act,
    )

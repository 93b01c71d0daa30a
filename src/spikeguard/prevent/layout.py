"""How the attention-logit bound, QK-Clip and muP find a model's attention: one small protocol.

A module that feeds a normalised input into its query and key projections implements
``attention_layout() -> AttentionLayout``: the norm's gain (and bias), where the query and key
rows of each head sit in their weights, the head layout and the logit scale. The reference GPT's
``Block`` implements it; a Hugging Face Llama or Mistral decoder layer is read through its own
attributes (``input_layernorm``, ``self_attn.q_proj`` and ``k_proj``). :func:`find_attention`
returns every such layer of a model, in module order. docs/defenses.md says what a model must
satisfy for the bound to hold.

When a caller finds no attention (the logit bound, on by default, and QK-Clip), the caller's
:func:`find_attention` warns once per model class and caller (an ``AttentionNotFoundWarning``
naming the class, the protocol to implement and how to turn the caller off) instead of letting
it silently do nothing; muP, which cannot work without a width, raises instead.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn

__all__ = ["AttentionLayout", "AttentionNotFoundWarning", "HasAttentionLayout", "find_attention"]


@dataclass(frozen=True)
class AttentionLayout:
    """One attention layer, as the logit bound and QK-Clip read it: ``x -> norm -> q, k``.

    The query of head ``i`` is rows ``q_row + i * head_dim`` to ``q_row + (i + 1) * head_dim``
    of ``q_weight`` ([rows, d_model], ``y = x W^T``, no bias), the key of key head ``j`` the same
    rows from ``k_row`` of ``k_weight`` (they may be one fused tensor); query head ``i`` reads key
    head ``i // (n_head // n_kv_head)``. ``norm_weight`` (and ``norm_bias``) are the gain of the
    LayerNorm or RMSNorm whose output the projections take: its output has norm at most
    ``max|g| sqrt(d_model) + ||b||``. ``qk_norm``: the per-channel gains of an RMS norm applied
    to every head's query and key (shared by the heads), or None. Position rotations (RoPE) keep
    norms and a soft-cap only lowers logits, so neither enters."""

    norm_weight: torch.Tensor
    norm_bias: torch.Tensor | None
    q_weight: torch.Tensor
    q_row: int
    k_weight: torch.Tensor
    k_row: int
    n_head: int
    n_kv_head: int
    head_dim: int
    d_model: int
    scale: float
    """The logit scale (1 / sqrt(head_dim) unless the model sets another)."""
    qk_norm: tuple[torch.Tensor, torch.Tensor] | None = None


@runtime_checkable
class HasAttentionLayout(Protocol):
    """A module whose attention the logit bound, QK-Clip and muP can read."""

    def attention_layout(self) -> AttentionLayout: ...


class AttentionNotFoundWarning(UserWarning):
    """A model has attention that spikeguard cannot read (no ``attention_layout()``)."""


def _hf_decoder_layer(layer: nn.Module) -> AttentionLayout | None:
    """A Hugging Face Llama-style decoder layer (Llama, Mistral): RMSNorm, then separate
    q_proj and k_proj without bias; None where a q/k bias makes the layout another one."""
    attn, norm = layer.self_attn, layer.input_layernorm
    if attn.q_proj.bias is not None or attn.k_proj.bias is not None:
        return None
    cfg = attn.config
    return AttentionLayout(
        norm_weight=norm.weight, norm_bias=None, q_weight=attn.q_proj.weight, q_row=0,
        k_weight=attn.k_proj.weight, k_row=0, n_head=cfg.num_attention_heads,
        n_kv_head=cfg.num_key_value_heads, head_dim=attn.head_dim, d_model=cfg.hidden_size,
        scale=float(attn.scaling))


_KNOWN: dict[str, Callable[[nn.Module], AttentionLayout | None]] = {
    "LlamaDecoderLayer": _hf_decoder_layer,
    "MistralDecoderLayer": _hf_decoder_layer,
}
"""Layers of other libraries, by class name (no import of the library), read from outside."""

_warned: set[tuple[str, str]] = set()
"""(caller, model class) pairs already warned about: once each per process."""


class _Found:
    """A layer and how to read its layout (again at each use: parameters may be replaced, e.g.
    by FSDP2's sharding, after the layer was found)."""

    def __init__(self, module: nn.Module, read: Callable[[nn.Module], AttentionLayout]) -> None:
        self.module, self._read = module, read

    def layout(self) -> AttentionLayout:
        return self._read(self.module)


def _reader(module: nn.Module) -> Callable[[nn.Module], AttentionLayout | None] | None:
    if isinstance(module, HasAttentionLayout):
        return type(module).attention_layout
    return _KNOWN.get(type(module).__name__)


def find_attention(model: nn.Module, *, what: str = "the attention-logit bound",
                   required: bool = False, off: str = "") -> list[_Found]:
    """Every attention layer of ``model`` that implements the protocol (or is a known layer),
    in module order. None found with ``required``: an AttentionNotFoundWarning naming the
    model's class and the protocol, once per (``what``, class), saying that ``what`` does
    nothing; ``off`` says how to turn ``what`` off (for a model with no attention at all)."""
    found = []
    for module in model.modules():
        read = _reader(module)
        if read is not None and read(module) is not None:
            found.append(_Found(module, read))
    name = type(getattr(model, "_orig_mod", model)).__name__
    if not found and required and (what, name) not in _warned:
        _warned.add((what, name))
        warnings.warn(not_found(what, name, off), AttentionNotFoundWarning, stacklevel=3)
    return found


def not_found(what: str, name: str, off: str = "") -> str:
    """The message for ``what`` finding no attention in a model of class ``name``."""
    return (f"{what} found no attention it can read in {name}: it does nothing for this "
            f"model. Implement the HasAttentionLayout protocol (spikeguard.prevent.layout): give "
            "the layer that feeds its normalised input to the query and key projections an "
            "attention_layout() method returning an AttentionLayout (docs/defenses.md)"
            + (f"; or, for a model without attention, turn it off: {off}" if off else ""))

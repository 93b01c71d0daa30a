"""A small reference GPT with the stability knobs of the library.

Pre-norm decoder, learned or rotary positions, grouped-query attention (``n_kv_head``),
optional tied embeddings. ``forward`` returns the final hidden states [B, T, d_model]; ``loss``
turns them into the training loss, so the output layer and the loss can be fused by the losses
module without touching the trunk.

``init="mup"`` builds the model in muP (see :mod:`spikeguard.prevent.mup` for the table of
scalings); its optimizer takes :func:`spikeguard.prevent.mup.mup_param_groups`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from ._validate import check_int
from .prevent.attention import (
    QKNorm,
    attention,
    check_logit_bounds,
    check_softcap,
    logit_p99,
    softcap,
)
from .prevent.init import gpt2_residual_init_, mup_hidden_init_
from .prevent.layout import AttentionLayout
from .prevent.losses import LossOutput, linear_cross_entropy

__all__ = ["GPT", "GPTConfig", "count_params"]


@dataclass(kw_only=True, frozen=True)
class GPTConfig:
    """Shape and knobs of the reference GPT. Presets: ``tiny()``, ``demo()``, ``bench()``."""

    vocab_size: int = 256
    """Vocabulary size; 256 for the byte-level default corpus."""
    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads; must divide d_model."""
    n_kv_head: int | None = None
    """Key/value heads, shared by groups of query heads (grouped-query attention; 1 is
    multi-query); must divide n_head. None: one per query head."""
    d_model: int = 128
    """Residual stream width."""
    seq_len: int = 128
    """Context length T."""
    mlp_ratio: int = 4
    """MLP hidden width as a multiple of d_model."""
    pos: Literal["learned", "rope"] = "learned"
    """Position encoding: a learned table or rotary embeddings in attention."""
    tie_embeddings: bool = True
    """Share the token embedding with the output layer."""
    dropout: float = 0.0
    """Dropout on attention output and MLP output."""
    qk_norm: bool = False
    """RMS-normalise queries and keys per head before RoPE and attention (learned gain, no bias)."""
    attn_softcap: float | None = None
    """Soft-cap the attention scores, cap * tanh(s / cap), before the mask (Gemma 2: 50.0)."""
    final_logit_softcap: float | None = None
    """Soft-cap the output logits in GPT.logits (Gemma 2: 30.0)."""
    init: Literal["standard", "gpt2-residual", "mup"] = "standard"
    """N(0, 0.02) everywhere; residual-branch output projections at 0.02 / sqrt(2L); or muP."""
    mup_base_width: int = 128
    """muP's base width: the d_model where muP matches the standard init (the demo's width)."""
    z_loss: float = 1e-4
    """z-loss coefficient alpha in the output loss (PaLM's 1e-4; 0 turns it off)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_layer", "n_head", "d_model", "seq_len", "mlp_ratio"):
            check_int(getattr(self, name), f"GPTConfig.{name}")
        if self.d_model % self.n_head:
            raise ValueError(f"GPTConfig.d_model={self.d_model} is not divisible by "
                             f"n_head={self.n_head}; pick a head count that divides it")
        if self.n_kv_head is not None:
            check_int(self.n_kv_head, "GPTConfig.n_kv_head", default=None,
                      hint="a divisor of n_head (1 for multi-query attention)")
            if self.n_head % self.n_kv_head:
                raise ValueError(f"GPTConfig.n_kv_head={self.n_kv_head} does not divide "
                                 f"n_head={self.n_head}; pick a divisor (1 for multi-query "
                                 f"attention) or None for one per query head")
        if self.pos == "rope" and (self.d_model // self.n_head) % 2:
            raise ValueError(f"rotary positions need an even head dim, got "
                             f"{self.d_model // self.n_head}; change d_model or n_head")
        if self.pos not in ("learned", "rope"):
            raise ValueError(f"GPTConfig.pos={self.pos!r} must be 'learned' or 'rope'")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout={self.dropout} must be in [0, 1)")
        if not isinstance(self.qk_norm, bool):
            raise ValueError(f"GPTConfig.qk_norm={self.qk_norm!r} must be True or False")
        check_softcap(self.final_logit_softcap, "GPTConfig.final_logit_softcap")
        if self.init not in ("standard", "gpt2-residual", "mup"):
            raise ValueError(f"GPTConfig.init={self.init!r} must be 'standard', 'gpt2-residual' "
                             f"or 'mup'")
        check_int(self.mup_base_width, "GPTConfig.mup_base_width", default=128,
                  hint="the d_model of the narrow proxy the learning rate was tuned on")
        if self.init == "mup" and self.tie_embeddings:
            raise ValueError("GPTConfig.init='mup' with tie_embeddings=True: muP scales the input "
                             "embedding and the output layer differently (the logits carry a "
                             "mup_base_width / d_model multiplier); set tie_embeddings=False")
        check_logit_bounds(qk_norm=self.qk_norm, attn_softcap=self.attn_softcap, prefix="GPTConfig.")
        if not 0.0 <= self.z_loss < float("inf"):
            raise ValueError(f"GPTConfig.z_loss={self.z_loss} must be >= 0; 1e-4 is PaLM's value")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_heads(self) -> int:
        """Key/value heads: n_kv_head, or n_head when it is None."""
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def attn_scale(self) -> float | None:
        """Attention score scale: 1 / head_dim under muP; None (1 / sqrt(head_dim)) otherwise."""
        return 1.0 / self.head_dim if self.init == "mup" else None

    @property
    def output_multiplier(self) -> float:
        """Multiplier on the output logits: mup_base_width / d_model under muP, 1 otherwise."""
        return self.mup_base_width / self.d_model if self.init == "mup" else 1.0

    @classmethod
    def tiny(cls, **overrides) -> GPTConfig:
        """2 layers, d=64, T=64: unit tests."""
        return replace(cls(n_layer=2, n_head=2, d_model=64, seq_len=64), **overrides)

    @classmethod
    def demo(cls, **overrides) -> GPTConfig:
        """4 layers, d=128, T=128: the main job and the demo."""
        return replace(cls(n_layer=4, n_head=4, d_model=128, seq_len=128), **overrides)

    @classmethod
    def bench(cls, **overrides) -> GPTConfig:
        """6 layers, d=384, T=256: every per-step benchmark."""
        return replace(cls(n_layer=6, n_head=6, d_model=384, seq_len=256), **overrides)


def _rope_tables(seq_len: int, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, H, T, D]; rotate pairs (even, odd) by the position's angle
    t = x.shape[-2]
    cos, sin = cos[:t].to(x.dtype), sin[:t].to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2)


class Attention(nn.Module):
    """Causal self-attention. Set ``logit_p99_request = True`` (the probes do) and the next
    forward stores the per-head p99 of |q.k * scale| before any cap in ``last_logit_p99``
    ([n_head] float32, on the device, no host sync)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.logit_p99_request = False
        self.last_logit_p99: torch.Tensor | None = None
        self.qkv = nn.Linear(cfg.d_model, cfg.d_model + 2 * cfg.kv_heads * cfg.head_dim, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.drop = nn.Dropout(cfg.dropout)
        self.qk_norm = QKNorm(cfg.head_dim, kind="rms") if cfg.qk_norm else None
        if cfg.pos == "rope":
            cos, sin = _rope_tables(cfg.seq_len, cfg.head_dim)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h, h_kv, hd = self.cfg.n_head, self.cfg.kv_heads, self.cfg.head_dim
        if h_kv == h:
            q, k, v = self.qkv(x).view(b, t, 3, h, hd).permute(2, 0, 3, 1, 4)
        else:  # [B, T, (H + 2 H_kv) D] -> q [B, H, T, D], k and v [B, H_kv, T, D]
            q, k, v = (z.view(b, t, -1, hd).transpose(1, 2)
                       for z in self.qkv(x).split((h * hd, h_kv * hd, h_kv * hd), dim=-1))
        if self.qk_norm is not None:
            q, k = self.qk_norm(q, k)
        if self.cfg.pos == "rope":
            q = _apply_rope(q, self.rope_cos, self.rope_sin)
            k = _apply_rope(k, self.rope_cos, self.rope_sin)
        if self.logit_p99_request:
            self.last_logit_p99 = logit_p99(q.detach(), k.detach(), causal=True,
                                            scale=self.cfg.attn_scale)
        # SDPA without a cap; with one, flex on CUDA or the eager fp32 path
        y = attention(q, k, v, causal=True, softcap=self.cfg.attn_softcap, scale=self.cfg.attn_scale)
        return self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model, bias=False)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def attention_layout(self) -> AttentionLayout:
        """ln1 -> the fused qkv (q rows first, then k, then v): the logit bound and QK-Clip read
        the attention through this (spikeguard.prevent.layout)."""
        cfg, attn = self.attn.cfg, self.attn
        qk = attn.qk_norm
        return AttentionLayout(
            norm_weight=self.ln1.weight, norm_bias=self.ln1.bias, q_weight=attn.qkv.weight,
            q_row=0, k_weight=attn.qkv.weight, k_row=cfg.n_head * cfg.head_dim,
            n_head=cfg.n_head, n_kv_head=cfg.kv_heads, head_dim=cfg.head_dim, d_model=cfg.d_model,
            scale=cfg.attn_scale if cfg.attn_scale is not None else 1.0 / math.sqrt(cfg.head_dim),
            qk_norm=None if qk is None else (qk.q_weight, qk.k_weight))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """The reference decoder. ``forward(idx) -> hidden``; ``loss(hidden, targets) -> LossOutput``."""

    def __init__(self, cfg: GPTConfig) -> None:
        if not isinstance(cfg, GPTConfig):
            raise TypeError(f"GPT(cfg) takes a GPTConfig (e.g. GPTConfig.tiny()), got "
                            f"{type(cfg).__name__}")
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model) if cfg.pos == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2's standard init: N(0, 0.02) for matrices and embeddings, LayerNorm at (1, 0),
        QK-norm gains at 1; with ``init="gpt2-residual"`` the two residual-branch output
        projections of every block start at 0.02 / sqrt(2 n_layer); with ``init="mup"`` every
        matrix inside the blocks starts at 0.02 * sqrt(mup_base_width / d_model)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
            elif isinstance(module, QKNorm):
                module.reset_parameters()
        if self.cfg.init == "gpt2-residual":
            branch_outputs = [w for b in self.blocks for w in (b.attn.proj.weight, b.mlp.proj.weight)]
            gpt2_residual_init_(branch_outputs, self.cfg.n_layer, std=0.02)
        elif self.cfg.init == "mup":
            hidden = [m.weight for m in self.blocks.modules() if isinstance(m, nn.Linear)]
            mup_hidden_init_(hidden, base_width=self.cfg.mup_base_width, width=self.cfg.d_model,
                             std=0.02)

    @property
    def output_weight(self) -> torch.Tensor:
        """The [vocab, d_model] matrix of the output layer (before muP's output multiplier)."""
        return self.wte.weight if self.lm_head is None else self.lm_head.weight

    def _scaled_output_weight(self) -> torch.Tensor:
        # muP's logit multiplier folded into a [V, d] weight: the [N, V] logits are never built
        w = self.output_weight
        return w * self.cfg.output_multiplier if self.cfg.init == "mup" else w

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx: [B, T] int64 token ids, T <= seq_len. Returns final hidden states [B, T, d_model]."""
        if idx.dim() != 2:
            raise ValueError(f"idx must be [batch, time], got shape {tuple(idx.shape)}")
        if idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype == torch.bool:
            raise ValueError(f"idx must hold token ids (an integer tensor, torch.long), got "
                             f"{idx.dtype}")
        if idx.numel() == 0:
            raise ValueError(f"idx of shape {tuple(idx.shape)} is an empty batch; a step needs "
                             "at least one sequence of at least one token")
        if idx.device != self.wte.weight.device:
            raise ValueError(f"idx is on {idx.device} but the model is on "
                             f"{self.wte.weight.device}; move it with idx.to(device)")
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence length {t} exceeds GPTConfig.seq_len={self.cfg.seq_len}")
        _check_token_ids(idx, self.cfg.vocab_size)
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(t, device=idx.device))
        x = self.drop(x)
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., d_model] -> [..., vocab] logits, times ``cfg.output_multiplier`` under muP, then
        soft-capped when ``final_logit_softcap`` is set."""
        logits = F.linear(hidden, self._scaled_output_weight())
        cap = self.cfg.final_logit_softcap
        return logits if cap is None else softcap(logits, cap)

    def loss(self, hidden: torch.Tensor, targets: torch.Tensor, *,
             per_sequence: bool = True) -> LossOutput:
        """Fused output layer + cross-entropy + z-loss (``cfg.z_loss``); never builds the logits.

        Returns a LossOutput: ``.loss`` to backpropagate, ``.ce`` (mean next-token cross-entropy
        in nats), ``.z_loss`` and ``.log_z`` detached, and ``.sequences`` (each sequence's mean
        ce and log Z, from the per-token values of the same pass; None with
        ``per_sequence=False``), which the Guard reads to name the sequences behind a skip. The
        final logit cap, when set, is applied inside the fused loss exactly as in :meth:`logits`,
        after muP's output multiplier."""
        return linear_cross_entropy(hidden, self._scaled_output_weight(), targets,
                                    z_loss=self.cfg.z_loss, softcap=self.cfg.final_logit_softcap,
                                    per_sequence=per_sequence)


def _check_token_ids(idx: torch.Tensor, vocab_size: int) -> None:
    """Every id in [0, vocab_size): a ValueError naming the first bad one on the CPU; on an
    accelerator an asynchronous device assert (no host sync). Skipped inside torch.compile,
    where the check would break the graph (the embedding lookup still refuses a bad id)."""
    if torch.compiler.is_compiling():
        return
    bad = (idx < 0) | (idx >= vocab_size)
    if idx.device.type == "cpu":
        if bool(bad.any()):
            b, t = (int(i) for i in bad.nonzero()[0])
            raise ValueError(f"idx[{b}, {t}] = {int(idx[b, t])} is outside the vocabulary "
                             f"[0, {vocab_size}) (GPTConfig.vocab_size); check the tokenizer")
    elif idx.device.type != "meta":
        torch._assert_async(~bad.any(), f"a token id is outside [0, {vocab_size})")


def count_params(cfg: GPTConfig) -> int:
    """Parameter count of a config without building the weights on a device."""
    with torch.device("meta"):
        return GPT(cfg).num_params()


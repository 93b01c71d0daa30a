"""The zoo's models, optimizers and schedules: what a user's own loop would build.

Two models: the reference GPT (``sg.GPT``, the tiny preset; QK-norm and z-loss 1e-4 as
``spikeguard train`` sets them unless a cell turns them off) and a Hugging Face
``LlamaForCausalLM`` built from a small ``LlamaConfig`` (no download: random init, the same
shape as tiny: 2 layers, d=64, 2 heads, T=64, byte vocabulary), its loss through
``sg.cross_entropy`` on its logits. Optimizers: AdamW (fused or foreach), Adam (beta2 0.999),
SGD with momentum, ``torch.optim.Adafactor``, and ``torch.optim.Muon`` for the 2-D matrices of
the blocks with AdamW for everything else (embeddings, norms, biases: Muon takes 2-D
parameters only, and an embedding is not a matrix it should orthogonalize), the two behind one
``torch.optim.Optimizer`` (:class:`MuonAdamW`) so the guard, the LR scheduler and the
checkpoints see one optimizer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import spikeguard as sg

__all__ = ["MuonAdamW", "build", "evaluate", "schedule"]

LLAMA_SHAPE = {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2,
               "num_attention_heads": 2, "num_key_value_heads": 2}
"""The small LlamaConfig: tiny's shape (2 layers, d=64, 2 heads) with Llama's 4x SwiGLU MLP."""
SEQ_LEN = 64


class MuonAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` on ``matrices`` and ``torch.optim.AdamW`` on ``others``, as one
    optimizer: its param_groups are the two optimizers' own group dicts (a scheduler's LR
    reaches both) and its ``state`` is shared by both, so ``state_dict`` and
    ``load_state_dict`` (and DCP's checkpoints) see one ordinary optimizer."""

    def __init__(self, matrices: list[nn.Parameter], others: list[nn.Parameter], *,
                 muon_lr: float, adamw_lr: float, weight_decay: float) -> None:
        self.muon = torch.optim.Muon(matrices, lr=muon_lr, weight_decay=weight_decay,
                                     adjust_lr_fn="match_rms_adamw")
        self.adamw = torch.optim.AdamW(others, lr=adamw_lr, betas=(0.9, 0.95),
                                       weight_decay=weight_decay, foreach=True)
        super().__init__(self.muon.param_groups + self.adamw.param_groups, {})
        self._link()

    def _link(self) -> None:
        n = len(self.muon.param_groups)
        self.muon.param_groups, self.adamw.param_groups = (self.param_groups[:n],
                                                           self.param_groups[n:])
        self.muon.state = self.adamw.state = self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._link()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:
        if closure is not None:
            raise ValueError("MuonAdamW.step takes no closure")
        self.muon.step()
        self.adamw.step()


def _optimizer(name: str, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    params = list(model.parameters())
    if name == "adamw-fused":
        return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    if name == "adamw-foreach":
        return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1,
                                 foreach=True)
    if name == "adam-b2-0.999":
        return torch.optim.Adam(params, lr=lr, betas=(0.9, 0.999))
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "adafactor":
        return torch.optim.Adafactor(params, lr=lr)
    if name == "muon":
        blocks = {id(p) for n, p in model.named_parameters()
                  if p.dim() == 2 and (".blocks." in f".{n}" or ".layers." in f".{n}")}
        return MuonAdamW([p for p in params if id(p) in blocks],
                         [p for p in params if id(p) not in blocks], muon_lr=lr,
                         adamw_lr=3e-3, weight_decay=0.1)
    raise ValueError(f"unknown optimizer {name!r}")


class _Llama(nn.Module):
    """LlamaForCausalLM with the loop's two calls: ``forward`` (the logits) and ``loss``."""

    def __init__(self, vocab: int, dropout: float) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=vocab, max_position_embeddings=SEQ_LEN,
                          attention_dropout=dropout, tie_word_embeddings=False, **LLAMA_SHAPE)
        cfg._attn_implementation = "sdpa"
        self.hf = LlamaForCausalLM(cfg)
        self.ln_f = self.hf.model.norm  # where the logit-drift fault scales the head's input

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=x, use_cache=False).logits

    def loss(self, logits: torch.Tensor, y: torch.Tensor) -> Any:
        return sg.cross_entropy(logits.float(), y, z_loss=1e-4, per_sequence=True)


def build(model: str, vocab: int, *, dropout: float = 0.0, qk_norm: bool = True,
          z_loss: float = 1e-4, optimizer: str = "adamw-fused",
          lr: float = 3e-3) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model (seeded by the caller) and its optimizer. ``model``: tiny or llama."""
    if model == "tiny":
        net: nn.Module = sg.GPT(sg.GPTConfig.tiny(vocab_size=vocab, dropout=dropout,
                                                  qk_norm=qk_norm, z_loss=z_loss))
    elif model == "llama":
        net = _Llama(vocab, dropout)
    else:
        raise ValueError(f"unknown model {model!r}")
    return net, _optimizer(optimizer, net, lr)


def schedule(kind: str, *, warmup: int, steps: int) -> Any:
    """cosine (to 0.1), wsd (linear cooldown over the last 20%, to 0.1) or constant."""
    if kind == "cosine":
        return sg.schedules.warmup_cosine(warmup_steps=warmup, total_steps=steps, min_ratio=0.1)
    if kind == "wsd":
        return sg.schedules.wsd(warmup_steps=warmup, total_steps=steps, decay_fraction=0.2,
                                min_ratio=0.1)
    if kind == "constant":
        return sg.schedules.constant_with_warmup(warmup_steps=warmup)
    raise ValueError(f"unknown schedule {kind!r}")


@torch.no_grad()
def evaluate(model: nn.Module, tokens: Any, *, batches: int = 8, batch_size: int = 16,
             seed: int = 1234) -> float:
    """Mean held-out cross-entropy over fixed windows (the same for every cell and arm)."""
    import numpy as np

    was = model.training
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    total = 0.0
    for _ in range(batches):
        starts = torch.randint(0, len(tokens) - SEQ_LEN - 1, (batch_size,), generator=gen)
        w = torch.from_numpy(np.stack([np.asarray(tokens[s:s + SEQ_LEN + 1], dtype=np.int64)
                                       for s in starts.tolist()]))
        total += float(model.loss(model(w[:, :-1]), w[:, 1:]).ce)
    model.train(was)
    return total / batches

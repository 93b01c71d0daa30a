"""muP: per-layer learning rates so that the best learning rate does not move with width.

Maximal update parametrization (Yang et al., "Tensor Programs V: Tuning Large Neural Networks via
Zero-Shot Hyperparameter Transfer", 2022, arXiv:2203.03466) sets the init, a few multipliers and
each layer's learning rate as powers of the width, so that every layer's activations move by
O(1) per step at any width. Under the standard parametrization with Adam, a hidden matrix's
update changes its output by about lr * width, so the best learning rate falls roughly like
1 / width; under muP it stays put, and a learning rate tuned on a narrow proxy transfers to the
wide model.

The variant implemented here, with ``m = d_model / mup_base_width`` (the width multiplier; at
``m = 1`` everything but the attention scale equals the standard init of the reference GPT):

=====================================  ========================  ==============  ============
parameter                              init std                  multiplier      Adam LR
=====================================  ========================  ==============  ============
token and position embeddings          0.02                      1               lr
hidden matrices (qkv, attention out,   0.02 / sqrt(m)            1               lr / m
MLP in, MLP out)
output layer (``lm_head``)             0.02                      1 / m (logits)  lr
LayerNorm and QK-norm gains, biases    1 / 0                     1               lr
attention scores                       --                        1 / head_dim    --
=====================================  ========================  ==============  ============

This is the paper's muP table for Adam (its Table 3: input weights and biases at constant init
and LR, hidden weights at init variance and Adam LR proportional to 1 / fan_in, output weights at
init variance 1 / fan_in^2 and LR 1 / fan_in) with the output layer's 1 / width moved out of its
init and LR into a multiplier on the logits. The paper shows such a move leaves the training
dynamics unchanged for Adam (a multiplier c on a weight equals init times c and Adam LR times c),
and it is the form the authors' ``mup`` package uses (``MuReadout`` and ``MuAdam``). Why this
form:

- the output layer keeps the global learning rate, so only the hidden matrices need a group of
  their own, and at the base width the optimizer is exactly ``AdamW(model.parameters(), lr)``;
- the 1 / m multiplier keeps the logits O(1) as the width grows, which is also what keeps the
  z-loss and a final logit cap meaning the same at every width;
- the attention scale 1 / head_dim (instead of 1 / sqrt(head_dim)) is muP's, for when head_dim
  grows; the reference GPT grows width by adding heads at a fixed head_dim, where it is a constant
  factor, but it keeps the model muP-correct if a config grows head_dim instead.

Weight decay: torch's AdamW decays each weight by ``group lr * weight_decay`` per step, so the
hidden matrices decay at lr * weight_decay / m. For updates of size eta per entry, the equilibrium
entry size of an AdamW weight is about sqrt(eta / (2 weight_decay)), which then shrinks like
1 / sqrt(width): muP's own init scale for hidden weights. One ``weight_decay`` therefore serves
every width, and every group gets it (as the plain loop decays every parameter).

Not implemented: u-muP (Blake et al., "u-muP: The Unit-Scaled Maximal Update Parametrization",
ICLR 2025, arXiv:2407.17465) folds the same width scalings into unit-scaled ops so that every tensor
starts at unit variance (useful for fp8); it needs unit-scaled versions of every op in the model,
a larger change than this model needs for learning-rate transfer. Depth transfer (a 1 / sqrt(L)
branch multiplier) is not part of muP and is not done here either. Adam's epsilon is left at its
default: the hidden gradients shrink with width, so at very large widths it should shrink too.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .._validate import check_int, check_positive
from .layout import find_attention

__all__ = ["mup_param_groups", "mup_roles"]


def _width_and_base(model: nn.Module, base_width: int | None) -> tuple[int, int]:
    """(d_model, base width) of ``model``: the reference GPT's config (built with init='mup'),
    or, for any other model, the width its attention layout gives (spikeguard.prevent.layout)
    and the ``base_width`` the caller passes."""
    cfg = getattr(model, "cfg", None)
    if hasattr(cfg, "mup_base_width"):  # the reference GPT (model.py sits above prevent/)
        if cfg.init != "mup":
            raise ValueError(f"mup_param_groups needs a GPT built with GPTConfig.init='mup', got "
                             f"init={cfg.init!r}: muP's init and output multiplier are half of "
                             "it; set init='mup' and tie_embeddings=False")
        if base_width is not None:
            check_int(base_width, "mup_param_groups base_width")
            if base_width != cfg.mup_base_width:
                raise ValueError(f"mup_param_groups base_width={base_width} differs from the "
                                 f"model's GPTConfig.mup_base_width={cfg.mup_base_width}, which "
                                 "set its init and output multiplier; set "
                                 "GPTConfig.mup_base_width and omit base_width")
        return cfg.d_model, cfg.mup_base_width
    name = type(model).__name__
    widths = {f.layout().d_model for f in find_attention(model)}
    if len(widths) != 1:
        found = f"widths {sorted(widths)}" if widths else "no attention"
        raise ValueError(f"mup_param_groups found {found} in {name}, so it cannot tell the "
                         "model's width: use the reference GPT (GPT(GPTConfig(init='mup', "
                         "tie_embeddings=False))) or implement the HasAttentionLayout protocol "
                         "(spikeguard.prevent.layout): give the model's attention layers an "
                         "attention_layout() method returning an AttentionLayout")
    if base_width is None:
        raise ValueError(f"mup_param_groups on {name} needs base_width= (the width the learning "
                         "rate was tuned at); the model's own init and output multiplier must "
                         "follow muP too (module docstring)")
    check_int(base_width, "mup_param_groups base_width")
    return widths.pop(), base_width


def _output_weight(model: nn.Module) -> nn.Parameter | None:
    """The untied output layer's weight: Hugging Face's get_output_embeddings(), else lm_head."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else getattr(model, "lm_head", None)
    return getattr(head, "weight", None)


def mup_roles(model: nn.Module) -> dict[str, str]:
    """Each parameter's muP role by name: ``input``, ``hidden``, ``output`` or ``vector``.

    ``input`` the embeddings (every ``nn.Embedding``); ``output`` the untied output layer;
    ``hidden`` every other matrix (both dims grow with the width); ``vector`` the rest (norm
    gains, biases)."""
    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper
    inputs = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    out = _output_weight(model)
    output = set() if out is None else {id(out)}
    if output & inputs:
        raise ValueError(f"mup_param_groups needs an untied output layer; {type(model).__name__} "
                         "shares it with the input embedding (tie_embeddings=False)")
    roles = {}
    for name, p in model.named_parameters():
        key = id(p)
        roles[name] = ("input" if key in inputs else "output" if key in output
                       else "hidden" if p.dim() >= 2 else "vector")
    return roles


def mup_param_groups(model: nn.Module, *, lr: float, weight_decay: float,
                     base_width: int | None = None) -> list[dict[str, Any]]:
    """AdamW parameter groups with muP's per-layer learning rates (table in the module doc).

    ``model`` is a GPT built with ``init="mup"``, or any model whose attention
    :func:`spikeguard.prevent.layout.find_attention` reads (its width, ``d_model``, comes from
    there; its init and output multiplier must follow the table above, which only the reference
    GPT does for you). Returns one group per role present (:func:`mup_roles`), each a dict with
    ``params``, ``lr``, ``weight_decay`` and ``name`` (the role): hidden matrices get
    ``lr * base_width / d_model``, every other parameter ``lr``. ``base_width`` defaults to the
    GPT's ``cfg.mup_base_width``, which also set its init and output multiplier (passing a
    different one is an error); any other model must pass it. Use as
    ``torch.optim.AdamW(mup_param_groups(model, lr=3e-3, weight_decay=0.1))``; a LambdaLR
    schedule scales every group by the same factor."""
    model = getattr(model, "_orig_mod", model)
    width, base = _width_and_base(model, base_width)
    check_positive(lr, "mup_param_groups lr", hint="the learning rate tuned at the base width")
    if isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)) \
            or not 0.0 <= weight_decay < float("inf"):
        raise ValueError(f"mup_param_groups weight_decay={weight_decay!r} must be a finite "
                         "number >= 0 (0.1 is usual)")
    lrs = {"input": lr, "hidden": lr * base / width, "output": lr, "vector": lr}
    roles = mup_roles(model)
    groups = []
    for role, role_lr in lrs.items():
        params = [p for name, p in model.named_parameters() if roles[name] == role]
        if params:
            groups.append({"params": params, "lr": role_lr, "weight_decay": float(weight_decay),
                           "name": role})
    return groups

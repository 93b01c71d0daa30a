"""A nanoGPT-shaped training script with spikeguard in it: the lines that differ from that shape
are marked ``# sg`` (tests/test_adapters_glue.py counts them; docs/adapters.md lists them).

The shape is nanoGPT's train.py (Karpathy, github.com/karpathy/nanoGPT), written anew here: a
GPT whose ``forward(idx, targets)`` returns ``(logits, loss)``, config as plain variables that
``--key=value`` arguments override, random windows from a token file (``get_batch``), an LR by
iteration (``get_lr``), ``estimate_loss`` on both splits every ``eval_interval`` iterations and a
checkpoint dict, gradient accumulation, a GradScaler that is off unless dtype is float16. The
corpus is the Python docs that ship with the interpreter, as bytes.

What the guard changes: the model's loss is ``sg.cross_entropy``, a LossOutput whose log Z comes
from the same pass as the loss (no second cross-entropy); each micro-batch's loss goes through
``guard.accumulate``; ``guard.step()`` replaces nanoGPT's clip / ``scaler.step`` / ``update`` /
``zero_grad`` block (it clips, skips or steps, judges, logs, and raises TrainingHalted on a
halt); the LR schedule counts applied updates (a skipped batch does not advance it); the
checkpoint carries the guard's state. Under float16 give the guard the loss scaler instead:
``sg.Guard(..., precision=sg.PrecisionPolicy(kind="fp16-mixed"))`` and ``guard.backward(loss)``
(the guard warns if a scaler of the loop's own still scales the loss).

    PYTHONPATH=src python examples/nanogpt.py --max_iters=300 --poison_iter=200

``poison_iter`` and ``nan_iter`` inject faults for the demo: the batches of that iteration
become NUL bytes (a corrupt shard), or one gradient element becomes NaN.
"""

from __future__ import annotations

import math
import os
import sys
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import spikeguard as sg  # sg
from spikeguard.data import load_corpus

DEFAULTS = dict(
    out_dir="runs/nanogpt", eval_interval=50, log_interval=10, eval_iters=5,
    always_save_checkpoint=True, init_from="scratch",  # "scratch" or "resume"
    gradient_accumulation_steps=2, batch_size=8, block_size=64,
    n_layer=2, n_head=2, n_embd=64, dropout=0.0, bias=False,
    learning_rate=1e-3, max_iters=300, weight_decay=0.1, beta1=0.9, beta2=0.95, grad_clip=1.0,
    decay_lr=True, warmup_iters=20, lr_decay_iters=300, min_lr=1e-4,
    device="cpu", dtype="float32", seed=1337,
    poison_iter=-1, nan_iter=-1,  # fault injection for the demo (-1: none)
)


# -- the model ---------------------------------------------------------------------------------
@dataclass
class GPTConfig:
    block_size: int = 64
    vocab_size: int = 256
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = False


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.dropout = config.n_head, config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c)))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias)))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied input and output embeddings
        for name, p in self.named_parameters():
            if p.dim() >= 2:  # GPT-2's init; residual projections scaled by depth
                std = 0.02 / math.sqrt(2 * config.n_layer) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, mean=0.0, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        t = idx.shape[1]
        assert t <= self.config.block_size, f"sequence of {t} > block_size {self.config.block_size}"
        pos = torch.arange(t, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is None:  # inference: only the last position's logits
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        loss = sg.cross_entropy(logits, targets, z_loss=0.0, ignore_index=-1)  # sg: loss, ce, log Z
        return logits, loss

    def configure_optimizers(self, weight_decay: float, learning_rate: float,
                             betas: tuple[float, float], device_type: str) -> torch.optim.AdamW:
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=True)


# -- the script --------------------------------------------------------------------------------
def main(**overrides):
    """Train with DEFAULTS updated by ``overrides``; returns (model, optimizer, guard, iter_num)."""
    unknown = set(overrides) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown config keys {sorted(unknown)}; known: {sorted(DEFAULTS)}")
    cfg = {**DEFAULTS, **overrides}
    out_dir, eval_interval, eval_iters = cfg["out_dir"], cfg["eval_interval"], cfg["eval_iters"]
    gradient_accumulation_steps, batch_size = cfg["gradient_accumulation_steps"], cfg["batch_size"]
    block_size, device, max_iters, grad_clip = (cfg["block_size"], cfg["device"], cfg["max_iters"],
                                                cfg["grad_clip"])
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(cfg["seed"])
    device_type = "cuda" if "cuda" in device else "cpu"
    ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
               "float16": torch.float16}[cfg["dtype"]]
    ctx = nullcontext() if device_type == "cpu" else torch.amp.autocast(device_type, ptdtype)

    corpus = load_corpus("pydoc")  # the token files: bytes of the Python docs
    splits = {"train": corpus.train, "val": corpus.val}

    def get_batch(split: str):
        data = splits[split]
        ix = torch.randint(len(data) - block_size, (batch_size,))
        x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64))
                         for i in ix])
        return x.to(device), y.to(device)

    iter_num, best_val_loss = 0, 1e9
    model_args = dict(n_layer=cfg["n_layer"], n_head=cfg["n_head"], n_embd=cfg["n_embd"],
                      block_size=block_size, bias=cfg["bias"], vocab_size=256,
                      dropout=cfg["dropout"])
    ckpt_path = os.path.join(out_dir, "ckpt.pt")
    checkpoint = None
    if cfg["init_from"] == "resume":
        checkpoint = torch.load(ckpt_path, map_location=device)
        model_args.update(checkpoint["model_args"])
        iter_num, best_val_loss = checkpoint["iter_num"], checkpoint["best_val_loss"]
    model = GPT(GPTConfig(**model_args)).to(device)
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model"])
    scaler = torch.amp.GradScaler(device_type, enabled=cfg["dtype"] == "float16")
    optimizer = model.configure_optimizers(cfg["weight_decay"], cfg["learning_rate"],
                                           (cfg["beta1"], cfg["beta2"]), device_type)
    guard = sg.Guard(model, optimizer, config=sg.GuardConfig(clip=grad_clip or None, detector=sg.DetectorConfig.for_run(max_iters)), sinks=[sg.JsonlSink(os.path.join(out_dir, "metrics.jsonl"))])  # sg
    if checkpoint is not None:
        optimizer.load_state_dict(checkpoint["optimizer"])
        guard.stateful().load_state_dict(checkpoint["guard"])  # sg: detector windows, counters
    checkpoint = None

    @torch.no_grad()
    def estimate_loss() -> dict[str, float]:
        out = {}
        model.eval()
        for split in ("train", "val"):
            losses = torch.zeros(eval_iters)
            for k in range(eval_iters):
                x, y = get_batch(split)
                with ctx:
                    _, loss = model(x, y)
                losses[k] = loss.ce
            out[split] = losses.mean().item()
        model.train()
        return out

    def get_lr(it: int) -> float:
        lr, min_lr = cfg["learning_rate"], cfg["min_lr"]
        if it < cfg["warmup_iters"]:
            return lr * (it + 1) / (cfg["warmup_iters"] + 1)
        if it > cfg["lr_decay_iters"]:
            return min_lr
        ratio = (it - cfg["warmup_iters"]) / (cfg["lr_decay_iters"] - cfg["warmup_iters"])
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)

    x, y = get_batch("train")
    while True:
        lr = get_lr(guard.applied) if cfg["decay_lr"] else cfg["learning_rate"]  # sg: counts applied updates
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        if iter_num % eval_interval == 0:
            losses = estimate_loss()
            print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
            if losses["val"] < best_val_loss or cfg["always_save_checkpoint"]:
                best_val_loss = losses["val"]
                if iter_num > 0:
                    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                "model_args": model_args, "iter_num": iter_num,
                                "best_val_loss": best_val_loss, "config": cfg,
                                "guard": guard.stateful().state_dict(),  # sg
                                }, ckpt_path)
        for _ in range(gradient_accumulation_steps):
            if iter_num == cfg["poison_iter"]:  # fault injection: a corrupt shard of NUL bytes
                x, y = torch.zeros_like(x), torch.zeros_like(y)
            with ctx:
                _logits, loss = model(x, y)
                loss = guard.accumulate(loss) / gradient_accumulation_steps  # sg: ce, log Z
            # prefetch the next micro-batch while the backward runs (on a GPU)
            x, y = get_batch("train")
            scaler.scale(loss).backward()
        if iter_num == cfg["nan_iter"]:  # fault injection: one NaN in a gradient
            model.transformer.h[0].mlp.c_fc.weight.grad.view(-1)[0] = float("nan")
        guard.step()  # sg: clip, step or skip, zero_grad, judge, log (raises TrainingHalted)
        if iter_num % cfg["log_interval"] == 0:
            print(f"iter {iter_num}: loss {loss.item() * gradient_accumulation_steps:.4f}, "
                  f"lr {lr:.2e}")
        iter_num += 1
        if iter_num > max_iters:
            break
    guard.close()
    return model, optimizer, guard, iter_num


def _parse(argv: list[str]) -> dict:
    out = {}
    for arg in argv:
        key, _, value = arg.removeprefix("--").partition("=")
        if key not in DEFAULTS or not value:
            raise SystemExit(f"bad argument {arg!r}: use --key=value with a key of {sorted(DEFAULTS)}")
        kind = type(DEFAULTS[key])
        out[key] = (value.lower() in ("1", "true", "yes")) if kind is bool else kind(value)
    return out


if __name__ == "__main__":
    main(**_parse(sys.argv[1:]))

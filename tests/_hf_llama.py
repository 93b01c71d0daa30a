"""A Hugging Face ``LlamaForCausalLM`` built from a small config (nothing downloaded) and the
README's loop around it, shared by the plain-loop, HF Trainer and accelerate tests.

The loop is README's "Use in your loop" recipe verbatim in shape: ``forward_backward`` holds
the micro-batch, ``guard.backward(out.loss / k)``, ``guard.accumulate(out, rerun=partial(...))``
per micro-batch, ``guard.step()`` after the k-th. Faults: ``bad`` replaces rows ``bad_rows`` of
step ``bad``'s batch with a corrupt shard (a data outlier); ``nan_at`` makes the second block's MLP
output NaN from that step on (a numerical fault inside the model)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

import spikeguard as sg

SEQ, BATCH = 32, 8


def llama(*, dropout: float = 0.0, seed: int = 0) -> Any:
    """A 2-layer Llama (d=32, GQA 2:1, vocab 256: byte tokens), ~40k parameters."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, max_position_embeddings=SEQ,
                                   attention_dropout=dropout, bos_token_id=0, eos_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


def garbage(x: torch.Tensor, y: torch.Tensor, rows: Any) -> None:
    """Rows ``rows`` of the batch (in place) become a corrupt shard: every input byte 0xFF,
    every target byte NUL (a byte the text never holds)."""
    x[rows] = 0xFF
    y[rows] = 0


def poison_mlp(model: Any, switch: dict[str, bool]) -> None:
    """The second block's MLP outputs NaN while ``switch["on"]`` (times NaN: the graph stays
    connected, so every parameter still gets a gradient, as DDP needs)."""
    def hook(module: Any, args: Any, output: torch.Tensor) -> torch.Tensor:
        return output * float("nan") if switch["on"] else output

    model.model.layers[1].mlp.register_forward_hook(hook)


CORRUPT = 0xFE
"""A sequence of this byte alone is the corrupt sample: ``corrupt_embeddings`` makes its
embeddings inf, whatever row it sits in (a re-run without it poisons nothing else)."""


def corrupt_embeddings(model: Any) -> None:
    """The token embeddings of every sequence made of ``CORRUPT`` bytes alone become inf."""
    def hook(module: Any, args: Any, output: torch.Tensor) -> torch.Tensor:
        bad = (args[0] == CORRUPT).all(-1)
        return torch.where(bad[:, None, None], float("inf"), output) if bad.any() else output

    model.model.embed_tokens.register_forward_hook(hook)


def snapshot(model: Any, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    moments = {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
               for i, s in enumerate(optimizer.state.values())}
    return params, moments


def readme_loop(out: Path, *, steps: int = 20, k: int = 1, dropout: float = 0.0,
                bad: int | None = None, bad_rows: Any = slice(None),
                nan_at: int | None = None, corrupt: tuple[int, int] | None = None,
                drop_sequences: bool = False) -> dict[str, Any]:
    """README's loop on the Llama; returns the verdicts, the guard, and the snapshots of the
    weights and moments around step ``bad`` (or the step of ``corrupt``: (step, row), whose
    sequence is made of ``CORRUPT`` bytes, so its embeddings go inf)."""
    model = llama(dropout=dropout)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95),
                                  weight_decay=0.1)
    data = sg.TokenStream.from_corpus("pydoc", batch_size=BATCH, seq_len=SEQ, seed=0)
    det = sg.DetectorConfig.for_run(steps, arm_after=5, grad_z=0.01)
    attribution = sg.AttributionConfig(drop_sequences=drop_sequences)
    guard = sg.Guard(model, optimizer, data=data,
                     config=sg.GuardConfig(detector=det, attribution=attribution),
                     sinks=[sg.JsonlSink(out / "metrics.jsonl")])
    switch = {"on": False}
    poison_mlp(model, switch)
    corrupt_embeddings(model)

    def forward_backward(x, y, keep=None):
        if keep is not None:
            x, y = x[keep], y[keep]
        o = sg.cross_entropy(model(input_ids=x).logits, y, per_sequence=True)
        guard.backward(o.loss / k)
        return o

    result: dict[str, Any] = {"guard": guard, "verdicts": [], "model": model,
                              "optimizer": optimizer}
    while guard.step_index < steps:
        x, y = next(data)
        t = guard.step_index
        if t == bad:
            garbage(x, y, bad_rows)
        if corrupt is not None and t == corrupt[0]:
            x[corrupt[1]] = CORRUPT
        if t == bad or (corrupt is not None and t == corrupt[0]):
            result["before"] = snapshot(model, optimizer)
        switch["on"] = nan_at is not None and t >= nan_at
        for xs, ys in zip(x.chunk(k), y.chunk(k)):
            o = forward_backward(xs, ys)
            guard.accumulate(o, rerun=functools.partial(forward_backward, xs, ys))
        result["verdicts"] += guard.step()
        if t == bad or (corrupt is not None and t == corrupt[0]):
            result["after"] = snapshot(model, optimizer)
    guard.close()
    return result

"""The objects the bad-input table (tests/faults/_bad_input.py) calls on, and the before/after
comparison of the state a bad call must not change."""

from __future__ import annotations

import copy
import math
from typing import Any

import numpy as np
import torch

import spikeguard as sg

__all__ = ["same", "snapshot"]


def snapshot(obj: Any) -> Any:
    """A deep copy with tensors cloned, for before/after comparison with ``same``."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: snapshot(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(snapshot(v) for v in obj)
    return copy.deepcopy(obj)


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype and \
            bool(torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                                       and torch.equal(a.nan_to_num(), b.nan_to_num())))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


# -- objects the cases call on ---------------------------------------------------------------
def _model(**kw: Any) -> sg.GPT:
    torch.manual_seed(0)
    return sg.GPT(sg.GPTConfig.tiny() if not kw else sg.GPTConfig(**{
        **dict(vocab_size=256, n_layer=2, n_head=2, d_model=64, seq_len=64), **kw}))


def _trained() -> dict:
    """A model, its optimizer and a guard, one step in; the next batch's backward done."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = sg.TokenStream.from_corpus("pydoc", batch_size=2, seq_len=16, seed=0)
    guard = sg.Guard(model, opt, data=data, config=sg.GuardConfig(read_lag=0))
    x, y = next(data)
    out = model.loss(model(x), y)
    out.loss.backward()
    guard.step(out)
    x, y = next(data)
    return dict(model=model, opt=opt, guard=guard, data=data, x=x, y=y)


def _guard_state(c: dict) -> Any:
    g = c["guard"]
    return [g.state_dict(), c["model"].state_dict(), c["opt"].state_dict(), len(g.micro),
            c["data"].state_dict(), [p.grad for p in c["model"].parameters()]]


def _with_grads(c: dict) -> dict:
    out = c["model"].loss(c["model"](c["x"]), c["y"])
    out.loss.backward()
    c["out"] = out
    return c


def _fresh_detector() -> dict:
    d = sg.SpikeDetector(sg.DetectorConfig.for_run(100))
    for s in range(3):
        d.update(sg.StepMetrics(step=s, loss=2.0, grad_norm=1.0, log_z=5.0))
    return dict(d=d)


def _stream() -> dict:
    s = sg.TokenStream.from_corpus("pydoc", batch_size=2, seq_len=16, seed=0)
    next(s)
    return dict(s=s)


def _saved(tmp: Any) -> dict:
    """A checkpoint of GPTConfig.tiny() (tiny is n_layer 2, d_model 64) in ``tmp``."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mgr = sg.CheckpointManager(tmp, model=model, optimizer=opt, every=1)
    mgr.save(1)
    return dict(mgr=mgr)


def _saved_by_guard(tmp: Any) -> dict:
    """A guard's checkpoint of GPTConfig.tiny() after one step (guard state included)."""
    c = _with_grads(_trained())
    mgr = sg.CheckpointManager(tmp, every=1)
    guard = sg.Guard(c["model"], c["opt"], checkpoints=mgr, config=sg.GuardConfig(read_lag=0))
    guard.step(c["out"])  # step 0: never saved
    guard.step(_with_grads(c)["out"])
    assert [i.step for i in mgr.list()] == [1]
    return dict(mgr=mgr)


def _other_shape(c: dict, **kw: Any) -> dict:
    model = _model(**kw)
    c.update(model=model, opt=torch.optim.AdamW(model.parameters(), lr=1e-3))
    return c


def _ckpt_state(c: dict) -> Any:
    return [c["model"].state_dict(), c["opt"].state_dict(),
            sorted(p.name for p in c["mgr"].directory.rglob("*"))]


_Q = torch.randn(1, 2, 4, 8)
_LOGITS = torch.randn(2, 4, 256)
_TARGET = torch.randint(0, 256, (2, 4))
_TOKENS = np.arange(5000, dtype=np.uint16) % 256


def _write(path: Any, data: bytes) -> Any:
    path.write_bytes(data)
    return path

"""Fault injection for ``spikeguard train --inject``: data, gradients or the optimizer only.

Specs (several may be given; a trailing ``!`` makes a fault sticky):

- ``outlier@S``: batch S is garbage (random bytes; ``outlier@S:repeat`` repeats one byte);
- ``storm@S:N[:repeat]``: batches S to S+N-1 are garbage (a storm of N outliers, each drawn anew);
- ``gap@S:N``: batches S to S+N-1 never arrive (the stream skips them): the data a storm of N
  replaces, lost, on an otherwise clean run (the reference a skipped storm is measured against);
- ``seq@S[:ROW[:repeat]]``: one sequence of batch S (row ROW, default 0) is garbage (random
  bytes, or one byte repeated): what the guard's attribution should trace to that row;
- ``grad@S:MULT``: every gradient of step S times MULT after the backward (a transient numeric
  fault, not the data: a re-run of the step does not reproduce it);
- ``nan@S[:PARAM]``: a NaN in one element of PARAM's gradient (default: the first weight matrix);
- ``nan-data@S[:ROW]``: row ROW (default 0) of batch S makes the forward non-finite: the token
  embedding of that sequence is NaN, keyed to its tokens through a forward hook, so every re-run
  of the step that includes the row reproduces it and one without the row does not (the data's
  fault, as a corrupt sample would be);
- ``overflow@S``: an fp16 overflow in the backward of step S: the gradient reaching the first
  MLP's output (an fp16 tensor under ``--precision fp16-mixed``) is multiplied by 65504, the
  largest fp16 value, so it overflows and the loss scaler skips the step and halves the scale;
- ``lr@S:MULT:LEN``: the learning rate times MULT for LEN training steps from S;
- ``lr-ramp@S:MULT:LEN``: a slowly rising learning rate: from S on it is multiplied by
  ``MULT ** ((t - S + 1) / LEN)``, which reaches MULT after LEN steps and stays there;
- ``logit-drift@S[:EPS]``: from S on, the head's input is scaled by (1 + EPS (t - S)) through a
  forward hook on the final norm (the reference GPT ties its embeddings, so scaling the weights
  would move its inputs too, and a constant shift would not change cross-entropy): the logits
  grow, and log Z with them.

A fault fires the first time training passes its step and not again after a rollback (training
that goes back ends a transient fault); a sticky one fires every time training passes its steps.
A logit drift that a rollback ends stops growing but keeps the scale the restored weights last
trained under (none when they predate it): those weights were fitted to the scaled input, as a
real drift's weights carry their growth, and dropping the scale at once would be a jump in the
loss that no real drift makes.
The injector shares no state with the guard; its own state (which faults have fired) is saved in
the checkpoints so that a resumed run does not fire them twice.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .._dist import local_tensor

__all__ = ["Fault", "Injector", "parse_fault"]

_SPEC = re.compile(r"^(outlier|storm|gap|seq|grad|nan-data|nan|lr-ramp|lr|logit-drift|overflow)"
                   r"@(\d+)"
                   r"(?::([^!]*))?(!?)$")
_FP16_MAX = 65504.0


@dataclass(frozen=True)
class Fault:
    """One parsed ``--inject`` spec."""

    kind: str
    step: int
    args: tuple[str, ...] = ()
    sticky: bool = False

    @property
    def length(self) -> int:
        """Training steps the fault lasts (lr: LEN; storm: N; logit-drift and lr-ramp: to the
        end; others: 1)."""
        if self.kind == "lr":
            return int(self.args[1])
        if self.kind in ("storm", "gap"):
            return int(self.args[0])
        return 1 << 62 if self.kind in ("logit-drift", "lr-ramp") else 1

    def lr_multiplier(self, t: int) -> float:
        """lr and lr-ramp: the factor on the learning rate at step t (while active)."""
        if self.kind == "lr-ramp":
            return float(self.args[0]) ** min(1.0, (t - self.step + 1) / int(self.args[1]))
        return float(self.args[0])

    @property
    def drift_eps(self) -> float:
        """logit-drift: the head input's growth a step (``logit-drift@S:EPS``; 2e-3 without)."""
        return float(self.args[0]) if self.args else 2e-3


def parse_fault(spec: str) -> Fault:
    """Parse one spec; ValueError with the accepted forms on anything else."""
    m = _SPEC.match(spec.strip())
    forms = ("outlier@S[:repeat], storm@S:N[:repeat], gap@S:N, seq@S[:ROW[:repeat]], grad@S:MULT, "
             "nan@S[:PARAM], nan-data@S[:ROW], lr@S:MULT:LEN, lr-ramp@S:MULT:LEN, "
             "logit-drift@S[:EPS], overflow@S "
             "(add ! to repeat)")
    if m is None:
        raise ValueError(f"--inject {spec!r} is not a fault spec; use {forms}")
    kind, step, rest, bang = m.group(1), int(m.group(2)), m.group(3), m.group(4)
    args = tuple(rest.split(":")) if rest else ()
    try:
        if kind in ("lr", "lr-ramp"):
            if len(args) != 2 or float(args[0]) <= 0 or int(args[1]) < 1:
                raise ValueError
        elif kind == "logit-drift":
            if len(args) > 1 or (args and not float(args[0]) > 0):
                raise ValueError
        elif kind == "outlier" and args not in ((), ("repeat",)):
            raise ValueError
        elif kind == "storm" and (not args or int(args[0]) < 1
                                  or args[1:] not in ((), ("repeat",))):
            raise ValueError
        elif kind == "gap" and (len(args) != 1 or int(args[0]) < 1 or bang):
            raise ValueError
        elif kind == "nan-data" and (len(args) > 1 or (args and int(args[0]) < 0)):
            raise ValueError
        elif kind == "overflow" and args:
            raise ValueError
        elif kind == "seq" and (len(args) > 2 or (args and int(args[0]) < 0)
                                or args[1:] not in ((), ("repeat",))):
            raise ValueError
        elif kind == "grad" and (len(args) != 1 or not float(args[0]) > 0):
            raise ValueError
        elif kind == "nan" and len(args) > 1:
            raise ValueError
    except ValueError:
        raise ValueError(f"--inject {spec!r}: bad arguments for {kind}; use {forms}") from None
    return Fault(kind, step, args, bool(bang))


class Injector:
    """Applies the faults of one rank: call the hooks in the loop's order (see train.loop)."""

    def __init__(self, specs: tuple[str, ...], *, rank: int, only_rank: int | None,
                 vocab_size: int, seed: int) -> None:
        self.faults = [parse_fault(s) for s in specs] if only_rank in (None, rank) else []
        self.vocab_size = vocab_size
        self._gen = torch.Generator().manual_seed(seed + 7919)
        self._left: dict[int, int] = {}    # fault index -> steps left once fired
        self._last: dict[int, int] = {}    # fault index -> last step it was active
        self._frozen: dict[int, int] = {}  # logit drift ended by a rollback -> its steps kept
        self._active: list[Fault] = []
        self._lr_saved: list[float] | None = None
        self._lr_mult = 1.0
        self._t = 0
        self._drift: tuple[float, int] | None = None
        self._hook = None
        self._poison: list[tuple[int, torch.Tensor]] = []  # nan-data: (step, the row's tokens)
        self._overflow = False
        self._data_hook = self._grad_hook = None

    def gaps(self) -> list[tuple[int, int]]:
        """The inclusive batch ranges of the ``gap`` faults (the loop has the stream skip them
        before the first step)."""
        return [(f.step, f.step + f.length - 1) for f in self.faults if f.kind == "gap"]

    def _is_active(self, i: int, f: Fault, t: int) -> bool:
        if f.sticky:
            return f.step <= t < f.step + f.length
        if i not in self._left:
            if t != f.step:
                return False
            self._left[i] = f.length
        elif t <= self._last[i]:  # training went back: a transient fault is over
            self._left[i] = 0
            if f.kind == "logit-drift":  # the restored weights trained at step t - 1
                self._frozen[i] = max(0, min(t - 1 - f.step, self._frozen.get(i, t)))
        if self._left[i] <= 0:
            if i in self._frozen:  # a later rollback may go back further still
                self._last[i] = t
            return False
        self._left[i] -= 1
        self._last[i] = t
        return True

    def begin(self, t: int, model: nn.Module, x: torch.Tensor,
              y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Start step t: decide which faults are active; returns the (possibly garbage) inputs
        and targets."""
        self._active = [f for i, f in enumerate(self.faults) if self._is_active(i, f, t)]
        self._t = t
        drift = next((f for f in self._active if f.kind == "logit-drift"), None)
        self._drift = (drift.drift_eps, t - drift.step) if drift else None
        if drift is None:
            self._drift = next(((self.faults[i].drift_eps, k) for i, k in self._frozen.items()
                                if k > 0), None)
        if self._drift is not None and self._hook is None:
            self._hook = model.ln_f.register_forward_hook(self._scale_hidden)
        # a poisoned row stays poisoned through its step's re-runs (read one step late on a GPU)
        self._poison = [(s, row) for s, row in self._poison if t - 1 <= s <= t]
        self._overflow = any(f.kind == "overflow" for f in self._active)
        if self._overflow and self._grad_hook is None:
            self._grad_hook = model.blocks[0].mlp.fc.register_forward_hook(self._overflow_grad)
        for f in self._active:
            if f.kind == "nan-data":
                row = int(f.args[0]) if f.args else 0
                if not 0 <= row < x.shape[0]:
                    raise ValueError(f"--inject nan-data@{f.step}:{row}: the batch has rows 0.."
                                     f"{x.shape[0] - 1}")
                self._poison.append((t, x[row].clone()))
                if self._data_hook is None:
                    self._data_hook = model.wte.register_forward_hook(self._poison_rows)
            if f.kind in ("outlier", "storm"):
                if f.args[-1:] == ("repeat",):
                    x = torch.full_like(x, int(torch.randint(0, self.vocab_size, (1,),
                                                             generator=self._gen)))
                else:
                    x = torch.randint(0, self.vocab_size, x.shape, generator=self._gen,
                                      dtype=x.dtype).to(x.device)
            elif f.kind == "seq":  # one random window: inputs and targets shifted, as real data
                row = int(f.args[0]) if f.args else 0
                if not 0 <= row < x.shape[0]:
                    raise ValueError(f"--inject seq@{f.step}:{row}: the batch has rows 0.."
                                     f"{x.shape[0] - 1}")
                n = (1,) if f.args[1:] == ("repeat",) else (x.shape[1] + 1,)
                w = torch.randint(0, self.vocab_size, n, generator=self._gen,
                                  dtype=x.dtype).to(x.device).expand(x.shape[1] + 1)
                x, y = x.clone(), y.clone()
                x[row], y[row] = w[:-1], w[1:]
        return x, y

    def _scale_hidden(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        if self._drift is None:
            return output
        eps, k = self._drift
        return output * (1.0 + eps * k)

    def _poison_rows(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        """nan-data: the embedding of every row equal to a poisoned sequence becomes NaN."""
        idx = args[0]
        for _, row in self._poison:
            if idx.dim() == 2 and idx.shape[1] == row.numel():
                hit = (idx == row.to(idx.device)).all(dim=1)
                output = output.masked_fill(hit[:, None, None], float("nan"))
        return output

    def _overflow_grad(self, module: nn.Module, args: Any, output: torch.Tensor) -> None:
        """overflow: the (scaled, fp16) gradient of the first MLP's output overflows."""
        if not self._overflow or not output.requires_grad:
            return
        if output.dtype != torch.float16:
            raise ValueError(f"--inject overflow@S overflows an fp16 gradient, but the MLP's "
                             f"output is {output.dtype}; run it with --precision fp16-mixed")
        # twice the largest fp16 value: every nonzero element overflows to +-inf, as a real
        # overflow does, and zeros stay zero
        output.register_hook(lambda g: g * _FP16_MAX * _FP16_MAX)

    def after_backward(self, model: nn.Module) -> None:
        """NaN faults: plant one NaN in the named parameter's (local) gradient; grad faults:
        multiply every gradient."""
        for f in self._active:
            if f.kind == "grad":
                grads = [p.grad for p in model.parameters() if p.grad is not None]
                torch._foreach_mul_(grads, float(f.args[0]))
            if f.kind != "nan":
                continue
            params = dict(model.named_parameters())
            name = f.args[0] if f.args else next(n for n, p in params.items() if p.dim() == 2)
            if name not in params:
                raise ValueError(f"--inject nan@{f.step}:{name}: no such parameter; the model has "
                                 f"e.g. {', '.join(list(params)[:4])}")
            g = params[name].grad
            local = local_tensor(g)
            if local is not None and local.numel():
                local.view(-1)[0] = float("nan")

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        """LR faults: multiply every group's LR for this step."""
        lr = next((f for f in self._active if f.kind in ("lr", "lr-ramp")), None)
        self._lr_saved = None
        if lr is not None:
            self._lr_mult = lr.lr_multiplier(self._t)
            self._lr_saved = [g["lr"] for g in optimizer.param_groups]
            for g in optimizer.param_groups:
                g["lr"] *= self._lr_mult

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Undo an LR fault when the scheduler did not (a skipped step leaves the LR as set)."""
        if self._lr_saved is None:
            return
        mult = self._lr_mult
        for g, base in zip(optimizer.param_groups, self._lr_saved):
            if g["lr"] == base * mult:
                g["lr"] = base
        self._lr_saved = None

    def state_dict(self) -> dict[str, Any]:
        return {"left": {str(k): v for k, v in self._left.items()},
                "last": {str(k): v for k, v in self._last.items()},
                "frozen": {str(k): v for k, v in self._frozen.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._left = {int(k): int(v) for k, v in state["left"].items()}
        self._last = {int(k): int(v) for k, v in state["last"].items()}
        self._frozen = {int(k): int(v) for k, v in state.get("frozen", {}).items()}

"""The step's micro-batches: their losses, and a re-run of the whole step that means what it says.

The one recipe, for one micro-batch or ``k`` of them (README, "Use in your loop")::

    def forward_backward(x, y, keep=None):          # keep: a bool mask of the rows to re-run
        if keep is not None:
            x, y = x[keep], y[keep]
        out = sg.cross_entropy(model(x), y)          # a LossOutput: the micro-batch's own mean
        guard.backward(out.loss / k)                 # divide by k here, in the loop and re-run
        return out                                   # undivided: the guard averages the k

    for x, y in micro_batches:                       # k of them (k = 1: no accumulation)
        out = forward_backward(x, y)
        guard.accumulate(out, rerun=functools.partial(forward_backward, x, y))
    guard.step()                                     # after the k-th backward

The closure's contract: ``rerun()`` (or ``rerun(keep=mask)``) runs the micro-batch's forward and
backward exactly as the loop did, division by ``k`` included, and returns its LossOutput (or its
0-d loss) undivided: the micro-batch's own mean. ``guard.step(out, rerun=...)`` is the same as
``guard.accumulate(out, rerun=...)`` then ``guard.step()``. The guard keeps each closure (the
weights check re-runs the batch of a step 16 kept steps back), so it must hold its batch, not
read a loop variable later (``functools.partial``, or default arguments).

The step's re-run (attribution's "does the step reproduce?", the weights check's reference, a
halt's forensics) replays *every* micro-batch in order, running only the closures. The guard
notes the RNG state each micro-batch's forward started from (a forward pre-hook on the model,
or ``guard.autocast()``), and a re-run sets it again as that forward starts, so dropout (an
``nn.Dropout``, or an attention's functional dropout such as HF's ``attention_dropout``) draws
the same masks and a re-run reproduces the step bit for bit. Where a faithful re-run is
impossible it is None, ``why_not`` says why, and the cause of a skip is ``unknown``, never a
guess: a micro-batch without a closure (the gradient of the last alone is not the step's), or
a stochastic forward (``stochastic``) whose start the guard did not see (it did not run
through the guard's model).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .adapter import GuardMisuseWarning
from .arguments import check_loss

__all__ = ["MicroBatches", "StepBatch", "stochastic"]


@dataclass
class StepBatch:
    """What ``MicroBatches.take`` gives the step."""

    loss: torch.Tensor
    """Mean loss of the micro-batches (0-d, float32, detached)."""
    log_z: torch.Tensor
    rows: tuple[Any, ...]
    """Each micro-batch's per-sequence values (LossOutput.sequences, or None)."""
    rerun: Callable[..., Any] | None
    """A faithful re-run of the whole step (module docstring), or None."""


_DROPOUT_FIELDS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob",
                   "hidden_dropout", "hidden_dropout_prob", "resid_pdrop", "embd_pdrop",
                   "dropout", "dropout_p", "activation_dropout")
"""Module attributes and model-config fields that hold a dropout probability: HF models apply
attention dropout functionally (``config.attention_dropout``), with no ``nn.Dropout`` to see."""


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def stochastic(model: nn.Module) -> str | None:
    """Whether a training forward of ``model`` draws random numbers: the name of the first
    module in training mode that applies dropout with p > 0 (an ``nn.Dropout``, a module whose
    ``attention_dropout``/``dropout_p``/... attribute or whose ``config`` field of that name is
    positive), or None. A walk over the modules (no device read)."""
    for name, m in model.named_modules():
        if not m.training:
            continue
        if isinstance(m, nn.modules.dropout._DropoutNd):
            if m.p > 0:
                return name or "the model"
            continue
        config = getattr(m, "config", None)
        for field in _DROPOUT_FIELDS:
            if _positive(getattr(m, field, None)) or _positive(getattr(config, field, None)):
                return f"{name or 'the model'} ({field})"
    return None


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def _forked(state: tuple[torch.Tensor, torch.Tensor | None] | None,
            device: torch.device) -> Iterator[None]:
    if state is None:
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


class MicroBatches:
    """Collects one step's micro-batches (module docstring). It registers a forward pre-hook on
    ``model`` that notes the RNG state as a training forward starts."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model, self.device = model, device
        self._items: list[tuple[torch.Tensor, torch.Tensor, Any, Any, Any]] = []
        self._rng: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._hooked = False  # the hook noted this micro-batch's forward
        self._replay: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.rerunning = False
        """True inside a re-run: its forwards are not new micro-batches."""
        self.closures = 0
        """Micro-batches handed over with a re-run closure so far."""
        self.why_not: str | None = None
        """Why the last step taken has no faithful re-run (None when it has one)."""
        self._warned_reduction = False
        me, root = weakref.ref(self), weakref.ref(model)

        def note(module: nn.Module, args: Any) -> None:
            self_ = me()
            if self_ is not None and module is root() and module.training \
                    and torch.is_grad_enabled():
                self_.forward_hook()

        # a plain function holding weak references: a deepcopy of the model (an EMA copy)
        # shares it and is told apart by ``module is root()``; no cycle keeps the guard alive
        model.register_forward_pre_hook(note)

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Micro-batch ``i`` so far: (loss, log Z, per-sequence values)."""
        return self._items[i][:3]

    def clear(self) -> None:
        self._items.clear()
        self._rng, self._hooked = None, False

    def forward_starts(self) -> None:
        """A forward is about to run (``guard.autocast()``): note the RNG state it starts from."""
        if not self.rerunning:
            self._rng, self._hooked = _rng_state(self.device), False

    def forward_hook(self) -> None:
        """The model's training forward starts: note the RNG state (the first forward of a
        micro-batch); in a re-run, set the state noted for it again."""
        if self.rerunning:
            if self._replay is not None:
                torch.set_rng_state(self._replay[0])
                if self._replay[1] is not None:
                    torch.cuda.set_rng_state(self._replay[1], self.device)
                self._replay = None
        elif not self._hooked:
            self._rng, self._hooked = _rng_state(self.device), True

    def add(self, out: Any, *, log_z: torch.Tensor | None = None,
            rerun: Callable[..., Any] | None = None) -> torch.Tensor:
        """One micro-batch (after its backward, or before: only detached values are kept):
        ``out`` a LossOutput (its ``ce`` and ``log_z``) or a 0-d loss; ``rerun`` re-runs its
        forward and backward. Returns the differentiable loss (``out.loss``, or ``out``)."""
        seq = getattr(out, "sequences", None)
        if hasattr(out, "ce") and hasattr(out, "log_z"):
            loss, log_z = out.ce, out.log_z if log_z is None else log_z
            self._check_reduction(getattr(out, "reduction", "mean"))
        else:
            loss = out
        check_loss(loss, self.device)
        loss = loss.detach().float().reshape(())
        z = (torch.full_like(loss, float("nan")) if log_z is None
             else log_z.detach().float().reshape(()).to(loss.device))
        self._items.append((loss, z, seq, rerun, self._rng))
        self._rng, self._hooked = None, False
        self.closures += rerun is not None
        return out.loss if hasattr(out, "ce") and hasattr(out, "log_z") else out

    def _check_reduction(self, reduction: str) -> None:
        if reduction in ("mean", "none") or self._warned_reduction:  # "none": check_loss refuses
            return
        self._warned_reduction = True
        warnings.warn(f"the guard got a LossOutput with reduction {reduction!r}: its ce is a "
                      "sum, or a share of a mean over more tokens than this micro-batch's, but "
                      "the guard averages micro-batches and ranks, so it needs each "
                      "micro-batch's own mean; keep backpropagating out.loss and pass the "
                      "means: guard.accumulate(out.ce / n, log_z=out.log_z) for 'sum' (n: this "
                      "micro-batch's counted tokens), guard.accumulate(out.ce * k / n, log_z="
                      "out.log_z * k / n) for a normalizer k", GuardMisuseWarning, stacklevel=4)

    def redo(self, closure: Callable[..., Any]) -> None:
        """Replace this step's micro-batches by a re-run of ``closure`` (read_lag 1, after an
        update applied at the host made the gradients in place stale)."""
        self.clear()
        out = closure()
        for o in out if isinstance(out, (list, tuple)) and not hasattr(out, "log_z") else [out]:
            self.add(o)

    def take(self, rerun: Callable[..., Any] | None = None) -> StepBatch:
        """The step's mean loss and log Z, its rows and its re-run; ``rerun`` (given to
        ``guard.step``) belongs to the last micro-batch when it has none of its own."""
        items = list(self._items)
        self.clear()
        if rerun is not None and items[-1][3] is None:
            items[-1] = (*items[-1][:3], rerun, items[-1][4])
        losses, zs, rows, closures, states = zip(*items)
        self.why_not = self._why_not(closures, states)
        return StepBatch(torch.stack(losses).mean(), torch.stack(zs).mean(), rows,
                         self._replay_of(closures, states) if self.why_not is None else None)

    def _why_not(self, closures: tuple[Any, ...], states: tuple[Any, ...]) -> str | None:
        """Why the step cannot be re-run faithfully, in words that say the fix; None if it can."""
        k = len(closures)
        if all(c is None for c in closures):
            if self.closures == 0:
                return ("no rerun= was passed: pass guard.step(out, rerun=fn) or "
                        "guard.accumulate(out, rerun=fn), fn re-running the batch's forward "
                        "and backward (README, 'Use in your loop')")
            return "this step's batch came without rerun="
        if any(c is None for c in closures):
            missing = [i for i, c in enumerate(closures) if c is None]
            return (f"micro-batch(es) {missing} of {k} came without rerun=: pass one to every "
                    "guard.accumulate (the last micro-batch's gradient alone is not the step's)")
        if any(s is None for s in states):
            where = stochastic(self.model)
            if where is not None:
                return (f"the forward is stochastic (dropout in {where}) and did not run "
                        "through the guard's model, so a re-run would draw other masks: call "
                        "the model the guard was given, or run the forward under "
                        "guard.autocast()")
        return None

    def _replay_of(self, closures: tuple[Callable[..., Any], ...],
                states: tuple[Any, ...]) -> Callable[..., Any]:
        if len(closures) == 1:
            one, state = closures[0], states[0]

            @functools.wraps(one)  # its signature: attribution asks whether it takes keep=
            def rerun_one(*args: Any, **kwargs: Any) -> Any:
                return self._run(one, state, *args, **kwargs)

            return rerun_one

        def rerun_all() -> list[Any]:
            return [self._run(c, s) for c, s in zip(closures, states)]

        return rerun_all

    def _run(self, closure: Callable[..., Any], state: Any, *args: Any, **kwargs: Any) -> Any:
        self.rerunning = True
        try:
            with _forked(state, self.device):
                self._replay = state  # set again as the model's forward starts
                return closure(*args, **kwargs)
        finally:
            self.rerunning, self._replay = False, None

"""Numerical faults in a real guarded run of the reference GPT, at a seeded random step.

``numeric_run(kind, seed)`` trains ``GPTConfig.tiny()`` on the corpus that ships with Python
through the Guard (the README's loop: forward, backward, ``guard.step``), and at one step drawn
from the seed plants one fault:

- ``nan-activation`` / ``inf-activation``: a forward hook puts a NaN (an Inf) into one element of
  one module's output (a module drawn from those the forward runs); it stays on for the guard's
  re-run of the step, as a bad batch would;
- ``nan-grad`` / ``inf-grad``: one element of one parameter's gradient (drawn) becomes NaN (Inf);
- ``nan-loss`` / ``inf-loss``: the step's loss (``ce`` and ``loss``) becomes NaN (Inf) while the
  gradients stay finite (a reduction that overflowed);
- ``big-grad``: one element of one parameter's gradient becomes 1e6 (a data outlier's gradient);
- ``fp16-overflow``: under fp16 mixed precision the backward of that step runs through a loss
  1e6 times larger, so its fp16 gradients overflow at the current loss scale.

After every step the run checks every weight and every optimizer moment for NaN/Inf, and keeps
the weights before the fault step to compare with after it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch

import spikeguard as sg
from spikeguard.guard import TrainingHalted
from spikeguard.prevent.losses import LossOutput

__all__ = ["KINDS", "Outcome", "numeric_run"]

KINDS = ("nan-activation", "inf-activation", "nan-grad", "inf-grad", "nan-loss", "inf-loss",
         "big-grad", "fp16-overflow")

STEPS = 32
_LOSS_SCALE_FAULT = 1e6


@dataclass
class Outcome:
    kind: str
    seed: int
    step: int
    """The step the fault was planted at."""
    place: str
    """The module, the parameter, or "loss"."""
    records: list[dict[str, Any]] = field(default_factory=list)
    halted: sg.TrainingHalted | None = None
    nonfinite_after: list[int] = field(default_factory=list)
    """Steps after which a weight or optimizer moment held a NaN or Inf."""
    unchanged_at_fault: bool | None = None
    """Whether the weights and optimizer moments after the fault step equal those before it."""
    scale_before: float | None = None
    scale_after: float | None = None


class _Collect:
    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def log(self, record: dict[str, Any], step: int) -> None:
        self.records.append(record)


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in model.parameters()]
    for s in opt.state.values():
        out += [v.detach().clone() for v in s.values() if isinstance(v, torch.Tensor)]
    return out


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())


def _modules_run(model: torch.nn.Module, x: torch.Tensor) -> list[str]:
    """Names of the submodules whose forward runs, in order (a hook on each, one forward)."""
    seen: list[str] = []
    hooks = [m.register_forward_hook(lambda *_, n=n: seen.append(n))
             for n, m in model.named_modules() if n]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in hooks:
            h.remove()
    return list(dict.fromkeys(seen))


def numeric_run(kind: str, seed: int, *, steps: int = STEPS) -> Outcome:
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not one of {KINDS}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: a second thread only spins on a shared machine
    try:
        return _run(kind, seed, steps)
    finally:
        torch.set_num_threads(threads)


def _run(kind: str, seed: int, steps: int) -> Outcome:
    torch.manual_seed(seed)
    cfg = sg.GPTConfig.tiny()
    model = sg.GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, sg.schedules.warmup_cosine(warmup_steps=5, total_steps=steps, min_ratio=0.1))
    data = sg.TokenStream.from_corpus("pydoc", batch_size=8, seq_len=cfg.seq_len, seed=seed)
    precision = sg.PrecisionPolicy(kind="fp16-mixed" if kind == "fp16-overflow" else "fp32")
    # big-grad: arm_quiet=2, the grad rule on 2 quiet updates after arm_after. A grad-only spike is
    # skipped only once the grad rule is on, and with the default 20 quiet updates the post-warmup
    # spikes of this tiny run keep it off past step 45 on 9 of 40 seeds: the fault would have to
    # wait for it in a much longer run. This is about the tier of each fault, not the arming
    detector = sg.DetectorConfig.for_run(steps, **({"arm_quiet": 2} if kind == "big-grad" else {}))
    sink = _Collect()
    guard = sg.Guard(model, opt, scheduler=sched, data=data, precision=precision, sinks=[sink],
                     config=sg.GuardConfig(detector=detector, read_lag=0))
    rng = random.Random(seed)
    # after the statistics are armed (a Tier 1 skip needs a median), with steps left after it
    step = rng.randint(detector.arm_after + 3, steps - 6)
    place = "loss"
    if kind.endswith("activation"):
        place = rng.choice(_modules_run(model, torch.zeros(1, cfg.seq_len, dtype=torch.long)))
    elif kind.endswith("grad"):
        place = rng.choice([n for n, _ in model.named_parameters()])
    bad = float("nan") if kind.startswith("nan") else float("inf")
    out = Outcome(kind=kind, seed=seed, step=step, place=place, records=sink.records)
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    try:
        while guard.step_index < steps:
            t = guard.step_index
            x, y = next(data)
            hook = None
            if t == step and kind.endswith("activation"):
                index = rng.randrange(1 << 30)

                def plant(module: Any, args: Any, output: torch.Tensor,
                          index: int = index) -> torch.Tensor:
                    output = output.clone()
                    output.view(-1)[index % output.numel()] = bad
                    return output

                hook = modules[place].register_forward_hook(plant)

            def rerun(x: torch.Tensor = x, y: torch.Tensor = y) -> Any:
                with guard.autocast():
                    o = model.loss(model(x), y)
                guard.backward(o)
                return o

            if t == step:
                before = _state(model, opt)
                out.scale_before = precision_scale(guard)
            with guard.autocast():
                loss = model.loss(model(x), y)
            if t == step and kind.endswith("loss"):
                loss = LossOutput(loss.loss + bad, loss.ce + bad, loss.z_loss, loss.log_z)
            if t == step and kind == "fp16-overflow":
                guard.backward(loss.loss * _LOSS_SCALE_FAULT)
            else:
                guard.backward(loss)
            if t == step and kind.endswith("grad"):
                g = params[place].grad
                g.view(-1)[rng.randrange(g.numel())] = 1e6 if kind == "big-grad" else bad
            try:
                guard.step(loss, rerun=rerun)
            finally:
                if hook is not None:
                    hook.remove()
                if t == step:
                    out.unchanged_at_fault = all(
                        torch.equal(a, b) for a, b in zip(before, _state(model, opt)))
                    out.scale_after = precision_scale(guard)
            if not _all_finite(_state(model, opt)):
                out.nonfinite_after.append(t)
        guard.flush()
    except TrainingHalted as e:
        out.halted = e
        if not _all_finite(_state(model, opt)):
            out.nonfinite_after.append(guard.step_index)
    finally:
        guard.close()
    return out


def precision_scale(guard: sg.Guard) -> float | None:
    scaler = guard.precision.scaler
    return float(scaler.get_scale()) if scaler is not None else None

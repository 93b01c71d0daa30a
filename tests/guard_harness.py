"""A guarded training run of the reference GPT with injected faults, shared by the guard tests.

The loop is the README's: fetch a batch, forward, backward, ``guard.step``; it is driven by
``guard.step_index`` so that a rollback replays steps. Faults touch only the data, the gradients
or the optimizer (never the guard), and each fires the first time training passes its step
unless it is sticky.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import spikeguard as sg
from spikeguard.guard import Guard, GuardConfig, TrainingHalted
from spikeguard.guard.outliers import row_scores


@dataclass
class Fault:
    kind: str
    """"outlier" (random-byte inputs, each target the byte the model finds least likely: a loss
    of at least ln(vocab) on any weights, several times a trained run's), "nan" (NaN in one
    gradient), "lr" (LR x mult), "grad" (every gradient scaled so that their norm is ``mult``
    x the median grad norm the guard's detector holds: sized from the run itself; a transient
    fault, the re-run does not have it), "sharp" (the same scaling, which the re-run of the
    step reproduces: a batch whose gradient is huge at an ordinary loss), "sharp-row" (the
    gradient through row ``row`` of the batch times ``mult``, in the step and in every re-run
    that keeps the row: one sequence that drives the gradient, at an unchanged loss), "garbage"
    (random input ids, the real targets: the zoo's outlier), "shift" (every input id moved by
    ``mult`` modulo the vocabulary from ``step`` on: a new source of data, not garbage)."""
    step: int
    param: str = "blocks.0.mlp.fc.weight"
    mult: float = 50.0
    row: int = 0
    length: int = 1
    sticky: bool = False
    """Fire every time training passes the steps (else once: a rollback ends it for good)."""
    ramp: int = 1
    """"lr": reach ``mult`` over this many steps (``mult ** (k / ramp)`` at the fault's k-th
    step, 1-based): each step's LR change is then ``mult ** (1 / ramp)``."""
    remaining: int | None = None
    last: int = -1

    def lr_mult(self, t: int) -> float:
        """"lr": the factor at step t, an active step of the fault."""
        k = t - self.step + 1 if self.sticky else self.length - (self.remaining or 0)
        return self.mult ** min(1.0, k / self.ramp)

    def active(self, t: int) -> bool:
        if self.sticky:
            return self.step <= t < self.step + self.length
        if self.remaining is None:
            if t != self.step:
                return False
            self.remaining = self.length
        elif t <= self.last:  # training went back (a rollback): a transient fault is over
            self.remaining = 0
        if self.remaining > 0:
            self.remaining -= 1
            self.last = t
            return True
        return False


@dataclass
class Run:
    losses: dict[int, float] = field(default_factory=dict)
    verdicts: list[Any] = field(default_factory=list)
    halted: TrainingHalted | None = None
    guard: Guard | None = None
    model: Any = None
    lrs: dict[int, float] = field(default_factory=dict)
    around: dict[int, tuple[Any, Any]] = field(default_factory=dict)
    """Step -> (parameters and optimizer state before guard.step, after it), for ``watch``."""
    top_z: dict[int, tuple[int, float]] = field(default_factory=dict)
    """Step -> (the row whose loss or log Z has the largest robust z-score in the batch, that
    score): what attribution's quarantine reads."""

    def final_loss(self, last: int = 20) -> float:
        steps = sorted(self.losses)[-last:]
        return sum(self.losses[s] for s in steps) / len(steps)


def snapshot(model: Any, opt: torch.optim.Optimizer) -> tuple[list, list]:
    """Copies of the parameters and of every optimizer state entry (moments, step count)."""
    params = [p.detach().clone() for p in model.parameters()]
    state = [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()}
             for s in opt.state.values()]
    return params, state


def unchanged(a: tuple[list, list], b: tuple[list, list]) -> bool:
    """Whether two snapshots are bit-identical."""
    (pa, sa), (pb, sb) = a, b
    return (all(torch.equal(x, y) for x, y in zip(pa, pb)) and len(sa) == len(sb)
            and all(s1.keys() == s2.keys() and all(
                torch.equal(s1[k], s2[k]) if torch.is_tensor(s1[k]) else s1[k] == s2[k]
                for k in s1) for s1, s2 in zip(sa, sb)))


def guarded_run(*, steps: int = 300, seed: int = 0, faults: list[Fault] = (), tier2: str = "alert",
                out: Path | None = None, every: int = 25, read_lag: int = 0, fused: bool = True,
                batch: int = 8, lr: float = 3e-3, max_rollbacks: int = 3,
                config: sg.GPTConfig | None = None, resume: bool = False,
                stop_at: int | None = None, watch: tuple[int, ...] = (),
                signals: bool = True, lr_jump: float = 2.0, tokens: bool = False,
                detector: dict[str, Any] | None = None) -> Run:
    """``detector``: DetectorConfig fields set over ``for_run(steps)``; ``tokens``: the loop
    passes ``guard.step(tokens=x)`` (the input-token check)."""
    torch.manual_seed(seed)
    cfg = config or sg.GPTConfig.tiny()
    model = sg.GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=fused)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, sg.schedules.warmup_cosine(warmup_steps=20, total_steps=steps, min_ratio=0.1))
    data = sg.TokenStream.from_corpus("pydoc", batch_size=batch, seq_len=cfg.seq_len, seed=seed)
    ckpt = sg.CheckpointManager(out / "ckpt", every=every, keep=20) if out is not None else None
    sinks = [sg.JsonlSink(out / "metrics.jsonl")] if out is not None else None
    det = sg.DetectorConfig.for_run(steps, **(detector or {}))
    guard = Guard(model, opt, scheduler=sched, data=data, checkpoints=ckpt, sinks=sinks,
                  config=GuardConfig(detector=det, tier2=tier2,
                                     read_lag=read_lag, max_rollbacks=max_rollbacks,
                                     signals=signals, lr_jump=lr_jump))
    run = Run(guard=guard, model=model)
    if resume:
        guard.resume()
    gen = torch.Generator().manual_seed(seed + 1)
    try:
        while guard.step_index < (steps if stop_at is None else stop_at):
            t = guard.step_index
            x, y = next(data)
            active = [f for f in faults if f.active(t)]
            if any(f.kind == "outlier" for f in active):
                x = torch.randint(0, cfg.vocab_size, x.shape, generator=gen)
                with torch.no_grad():
                    y = model.logits(model(x)).argmin(-1)
            if any(f.kind == "garbage" for f in active):
                x = torch.randint(0, cfg.vocab_size, x.shape, generator=gen)
            shift = next((f.mult for f in faults if f.kind == "shift" and t >= f.step), None)
            if shift is not None:
                x = (x + int(shift)) % cfg.vocab_size
            sharp_row = next((f.row for f in active if f.kind == "sharp-row"), None)
            row_mult = next((f.mult for f in active if f.kind == "sharp-row"), 1.0)
            out_ = model.loss(_row_scaled(model(x), sharp_row, row_mult), y)
            out_.loss.backward()
            zs = row_scores(out_.sequences.ce.tolist(), out_.sequences.log_z.tolist())
            run.top_z[t] = max(enumerate(zs), key=lambda iz: iz[1])
            factor = None  # "sharp": the re-run scales its gradients by the same factor
            for f in active:
                if f.kind == "nan":
                    dict(model.named_parameters())[f.param].grad.view(-1)[0] = float("nan")
                if f.kind in ("grad", "sharp"):
                    grads = [p.grad for p in model.parameters() if p.grad is not None]
                    norm = torch.linalg.vector_norm(torch.stack(
                        [torch.linalg.vector_norm(g) for g in grads]))
                    scale = float(f.mult * guard.detector.grad_median / norm)
                    for g in grads:
                        g.mul_(scale)
                    factor = scale if f.kind == "sharp" else None
            saved = None
            if any(f.kind == "lr" for f in active):
                mult = next(f.lr_mult(t) for f in active if f.kind == "lr")
                saved = [g["lr"] for g in opt.param_groups]
                for g in opt.param_groups:
                    g["lr"] *= mult
            run.lrs[t] = opt.param_groups[0]["lr"]
            run.losses[t] = float(out_.ce)

            def rerun(keep: Any = None, x: torch.Tensor = x, y: torch.Tensor = y,
                      factor: Any = factor, row: int | None = sharp_row, mult: float = row_mult) -> Any:
                if keep is not None:
                    x, y = x[keep], y[keep]
                    row = int(keep[:row].sum()) if row is not None and keep[row] else None
                o = model.loss(_row_scaled(model(x), row, mult), y)
                guard.backward(o)
                if factor is not None:
                    for p in model.parameters():
                        if p.grad is not None:
                            p.grad.mul_(factor)
                return o

            before = snapshot(model, opt) if t in watch else None
            run.verdicts += guard.step(out_, rerun=rerun, tokens=x if tokens else None)
            if before is not None:
                run.around[t] = (before, snapshot(model, opt))
            if saved is not None:  # the fault lasts one step; a scheduler step already reset it
                for g, base in zip(opt.param_groups, saved):
                    if g["lr"] == base * mult:
                        g["lr"] = base
        run.verdicts += guard.flush()
    except TrainingHalted as e:
        run.halted = e
    finally:
        if sinks is not None:
            guard.sinks.close()
        if ckpt is not None:
            ckpt.close()
    return run


def _row_scaled(h: torch.Tensor, row: int | None, mult: float) -> torch.Tensor:
    """``h`` unchanged, but the gradient through its row ``row`` times ``mult`` (None: as is)."""
    if row is None:
        return h
    scale = torch.ones(h.shape[0], *([1] * (h.dim() - 1)), dtype=h.dtype)
    scale[row] = mult
    return h.detach() + (h - h.detach()) * scale


def fsdp_tiny(world: int, steps: int) -> tuple[sg.GPT, torch.optim.AdamW, Any]:
    """The multi-rank tests' model: GPTConfig.tiny() with each block and the whole model under
    FSDP2 on a CPU mesh of ``world`` ranks, AdamW and warmup + cosine over ``steps``. Call it on
    every rank after the process group is up."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = sg.GPT(sg.GPTConfig.tiny())
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, sg.schedules.warmup_cosine(warmup_steps=20, total_steps=steps, min_ratio=0.1))
    return model, opt, sched

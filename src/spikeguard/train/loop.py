"""The run itself: the reference GPT through the Guard, on the token stream, torchrun-ready.

One step: the next batch of the stream (the injector may replace it), forward under the precision
policy's autocast, backward through the loss scaler, ``guard.step``. The loop is driven by
``guard.step_index``, so a rollback replays steps. Under torchrun (``WORLD_SIZE`` > 1) it joins
the process group (gloo on CPU, NCCL on GPUs) and wraps the model in DDP or FSDP2; every rank
takes the same decisions (the guard's are made from all-reduced numbers) and only rank 0 writes
the record, the config and the plot. After a skip the guard may re-run the step through the
loop's ``rerun`` closure (``rerun(keep=mask)`` re-runs it on the rows ``mask`` keeps), and the
sequences it quarantines go to ``DIR/quarantine.jsonl``. ``--steps`` counts updates: each one the
guard withholds is made up by one more batch (``TrainConfig.make_up_skips`` caps them), so a
skipped garbage batch costs one batch of data, not one update of the schedule.
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console

from .. import _dist
from .._crash import crash_point
from ..checkpoint import CheckpointError
from ..data import TokenStream
from ..guard import Guard
from ..guard.forensics import HaltReport, TrainingHalted
from ..guard.responses.ask import lr_stretch
from ..measure.precision import PrecisionPolicy
from ..model import GPT
from ..oncall import OnCall
from ..oncall.apply import apply_settings
from ..oncall.settings import config_with
from ..prevent.mup import mup_param_groups
from ..prevent.schedules import warmup_cosine, wsd
from ..sinks import JsonlSink, read_metrics
from .config import TrainConfig
from .data import load_train_data
from .faults import Injector
from .plot import plot_run
from .report import ProgressSink, summary_table
from .rundir import (
    RunCheckpoints,
    TrainInterrupted,
    check_out,
    cut_quarantine,
    prepare_out,
    resume_step,
)

__all__ = ["TrainResult", "evaluate", "train"]


@dataclass
class TrainResult:
    """What a run measured. ``losses``: the train loss of each step in run order (a rollback's
    replayed steps appear again); ``halted``: the report when the guard halted the run."""

    losses: list[float] = field(default_factory=list)
    val_loss: float = math.nan
    unigram_entropy: float = math.nan
    seconds: float = 0.0
    halted: HaltReport | None = None
    resumed_from: int | None = None
    applied: int = 0
    made_up: int = 0
    """Withheld updates made up with more batches (steps run past ``--steps``)."""
    rollbacks: int = 0
    out: Path | None = None
    plot: Path | None = None
    complete: bool = False
    """True when the run directory already held the finished run (nothing was trained)."""


@torch.no_grad()
def evaluate(model: GPT, tokens: np.ndarray, *, batches: int, batch_size: int,
             seed: int = 1234) -> float:
    """Mean loss over fixed held-out windows (the same windows for a given seed)."""
    was_training = model.training
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    seq = model.cfg.seq_len
    if len(tokens) <= seq + 1:
        raise ValueError(f"held-out split of {len(tokens)} tokens is shorter than one window of "
                         f"{seq + 1}; use more data or a shorter model (--model tiny)")
    device = next(model.parameters()).device
    total = 0.0
    for _ in range(batches):
        starts = torch.randint(0, len(tokens) - seq - 1, (batch_size,), generator=gen)
        w = torch.from_numpy(np.stack([np.asarray(tokens[s:s + seq + 1], dtype=np.int64)
                                       for s in starts.tolist()])).to(device)
        total += float(model.loss(model(w[:, :-1]), w[:, 1:]).ce)
    model.train(was_training)
    return total / batches


def _unigram_entropy(tokens: np.ndarray, vocab: int) -> float:
    counts = np.bincount(np.asarray(tokens, dtype=np.int64), minlength=vocab).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def _init_distributed() -> torch.device:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not _dist.is_dist():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            torch.distributed.init_process_group(backend)
        else:  # the agent's store outlives a restart: keys of one attempt apart from the last's
            env = os.environ
            store = torch.distributed.PrefixStore(f"spikeguard/attempt_{attempt}/",
                                                  torch.distributed.TCPStore(
                env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["WORLD_SIZE"]), False))
            torch.distributed.init_process_group(backend, store=store, rank=int(env["RANK"]),
                                                 world_size=int(env["WORLD_SIZE"]))
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def _optimizer(model: GPT, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW at ``cfg.lr``; under ``--init mup`` with muP's per-layer learning rates."""
    params = (mup_param_groups(model, lr=cfg.lr, weight_decay=cfg.weight_decay)
              if model.cfg.init == "mup" else model.parameters())
    return torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay,
                             fused=cfg.parallel != "fsdp" or device.type == "cuda")


def _schedule(cfg: TrainConfig) -> Any:
    warmup = cfg.warmup_steps
    if warmup >= cfg.steps:
        warmup = cfg.steps - 1
        warnings.warn(f"--warmup-steps={cfg.warmup_steps} is not below --steps={cfg.steps}; "
                      f"warming up over {warmup} steps instead", stacklevel=3)
    if cfg.schedule == "wsd":
        return wsd(warmup_steps=warmup, total_steps=cfg.steps, decay_fraction=cfg.decay_fraction,
                   min_ratio=cfg.min_lr_ratio)
    return warmup_cosine(warmup_steps=warmup, total_steps=cfg.steps, min_ratio=cfg.min_lr_ratio)


def _wrap(model: GPT, parallel: str, device: torch.device) -> torch.nn.Module:
    """The module the forward goes through (the loss is taken on the GPT itself)."""
    if parallel == "ddp" and _dist.world_size() > 1:
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda"
                                       else None)
    if parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    return model


def _answered(out: Path) -> dict[str, Any] | None:
    """config.json's on-call section (answers, their settings and skip ranges), if any."""
    try:
        return json.loads((out / "config.json").read_text()).get("oncall")
    except (OSError, ValueError):
        return None


def _keep_answers(section: dict[str, Any] | None, guard: Guard, model: GPT,
                  stream: TokenStream) -> dict[str, Any]:
    """A resumed run keeps what on-call answers changed (config.json's ``oncall``): their
    skip ranges and settings again; an LR change is the guard's stretch, restored with its
    state unless the checkpoint predates the answer."""
    if not section:
        return {}
    for lo, hi in section.get("skip_data", []):
        if (lo, hi) not in {tuple(r) for r in stream.skip_ranges}:
            stream.skip(lo, hi)
    settings = dict(section.get("overrides", {}))
    lr = settings.pop("lr", None)
    kept = apply_settings(model, settings, updater=guard.updater, probes=guard.probes)
    if lr is not None:
        if not any(s.kind == "answer" for s in guard.updater.lr.stretches):
            stretch, _ = lr_stretch({"lr": lr}, first=guard.step_index,
                                    peak=float(guard.scheduler.base_lrs[0]))
            guard.updater.lr.add(stretch)
        kept["lr"] = lr
    return kept


def _oncall(cfg: TrainConfig, out: Path, run_hash: str, model: GPT, *, resume: bool,
            checkpoints: Any) -> OnCall | None:
    """The run's on-call loop (pages, and answers under --tier2 ask), or None when not configured."""
    oc, ask = cfg.oncall, cfg.guard.tier2 == "ask"
    if not (oc.pages or ask):
        return None
    if ask and not cfg.guard.respond:
        raise ValueError("--tier2 ask applies a person's answer; it needs the guard's "
                         "responses on (not --defenses none or --no-respond)")
    if _dist.rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        OnCall.start(out, resume=resume)
    title = f"spikeguard train: {cfg.model}, seed {cfg.seed} (last window)"

    def plot(path: Path) -> Any:
        records = read_metrics(out / "metrics.jsonl")[-500:]
        return plot_run(records, path, title=title, skip_ratio=cfg.guard.detector.skip_ratio)

    return OnCall(oc, out, run_id=run_hash, layers=[n for n, _ in model.named_modules() if n],
                  plot=plot if cfg.plot else None, checkpoints=checkpoints,
                  max_rollbacks=cfg.guard.max_rollbacks, ask=ask)


def train(cfg: TrainConfig, *, echo: bool = True) -> TrainResult:
    """Run ``cfg``: returns what it measured; a halt is reported in ``result.halted`` (the CLI
    turns it into exit status 3); Ctrl-C raises :class:`TrainInterrupted`. torch's CPU thread
    count is ``cfg.threads`` for the run and is put back afterwards."""
    before = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    # under torchrun, the process group this run makes is this run's to take down: left to the
    # interpreter's exit, gloo's threads can be torn down mid-join and abort a finished rank
    # (SIGABRT, "terminate called without an active exception"), which the elastic agent
    # takes for a failure
    owned = not _dist.is_dist()
    try:
        return _train(cfg.resolved(), echo=echo, torch_threads=before)
    finally:
        torch.set_num_threads(before)
        if owned and _dist.is_dist():
            torch.distributed.destroy_process_group()


def _train(cfg: TrainConfig, *, echo: bool, torch_threads: int) -> TrainResult:
    device = _init_distributed()
    rank, world = _dist.rank(), _dist.world_size()
    console = Console(quiet=not echo or rank != 0, highlight=False, soft_wrap=True)
    out = Path(cfg.out)
    check_out(out)
    data = load_train_data(corpus=cfg.corpus, data=cfg.data, tokenizer=cfg.tokenizer,
                           vocab_size=cfg.vocab_size)
    gcfg = cfg.gpt_config(data.vocab_size)
    run_hash = cfg.run_hash(data.sha256)
    resume = prepare_out(cfg, out, run_hash, console)
    answered = _answered(out) if resume else None  # on-call answers a resume keeps
    resumed_at: int | None = None
    torch.manual_seed(cfg.seed)
    model = GPT(gcfg).to(device)
    fwd = _wrap(model, cfg.parallel, device)
    optimizer = _optimizer(model, cfg, device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(cfg))
    stream = TokenStream(data.train, batch_size=cfg.batch_size, seq_len=gcfg.seq_len,
                         seed=cfg.seed, rank=rank, world_size=world)
    policy = (PrecisionPolicy.default_for(device) if cfg.precision == "auto"
              else PrecisionPolicy(kind=cfg.precision))
    injector = Injector(cfg.inject, rank=rank, only_rank=cfg.inject_rank,
                        vocab_size=gcfg.vocab_size, seed=cfg.seed)
    for first, last in injector.gaps():  # batches that never arrive (a resume restores them)
        stream.skip(first, last)
    result = TrainResult(unigram_entropy=_unigram_entropy(data.train, data.vocab_size), out=out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(
            {"config": config_with(cfg.to_dict(), answered["overrides"] if answered else {}),
             "model": gcfg.__dict__, "data": data.describe, "data_sha256": data.sha256,
             "run_hash": run_hash, "world_size": world, "precision": policy.kind,
             "params": model.num_params(),
             **({"oncall": answered} if answered else {})}, indent=2, default=str))
    progress = ProgressSink(console, total=cfg.steps, start=0,
                            tokens_per_step=cfg.batch_size * gcfg.seq_len * world,
                            bar=cfg.progress, print_every=cfg.print_every)
    sinks = [JsonlSink(out / "metrics.jsonl"), progress] if rank == 0 else []
    oncall = _oncall(cfg, out, run_hash, model, resume=resume,
                     checkpoints=lambda: [c.step for c in guard.checkpoints.list() if c.healthy])
    def target() -> int:  # steps to run: --steps plus the withheld updates made up
        return cfg.steps + min(guard.withheld, cfg.make_up_skips)

    guard = Guard(model, optimizer, config=cfg.guard, scheduler=scheduler, precision=policy,
                  checkpoints=RunCheckpoints(out / "checkpoints", every=cfg.ckpt_every,
                                             keep=cfg.keep, last_step=lambda: target() - 1),
                  data=stream, sinks=sinks, probes=True, extra_state={"faults": injector},
                  keep_on_rollback=("faults",), oncall=oncall)
    threads = (f"--threads {cfg.threads}; torch's default here: {torch_threads}" if cfg.threads
               else "torch's default, --threads 0")
    console.print(f"{data.describe}; model {cfg.model}: {model.num_params():,} params on "
                  f"{device.type} x {world}, {policy.kind}, {torch.get_num_threads()} CPU "
                  f"thread(s) ({threads}); run dir {out}")
    if resume:
        try:
            info = guard.resume()  # the metrics file is cut back to the checkpoint (JsonlSink)
        except CheckpointError as exc:
            raise ValueError(f"{str(exc).splitlines()[0]}: every checkpoint there was refused "
                             f"(the warnings above say why); pass --fresh to start over in "
                             f"{out} (it removes them) or choose another --out") from None
        if info is not None:
            result.resumed_from = info.step
            resumed_at = stream.position
            if rank == 0:
                cut_quarantine(out / "quarantine.jsonl", info.step)
            if guard.step_index >= target():
                guard.close()
                progress.close()
                result.complete, result.applied = True, guard.applied
                console.print(f"the run in {out} is complete: all {guard.step_index} steps done "
                              f"({guard.applied} updates applied), the last checkpoint at step "
                              f"{info.step}; nothing to train (--fresh starts it over, a new "
                              f"--out runs beside it)")
                return result
            console.print(f"resumed from the checkpoint at step {info.step}")
            kept = _keep_answers(answered, guard, model, stream)
            if kept:
                console.print(f"kept the on-call answers' settings: {kept}")
    start = time.perf_counter()
    skipped: list[int] = []
    try:
        while True:
            if guard.step_index >= target():  # the last step's verdict may make up one more
                skipped += [v.step for v in guard.flush() if v.skip]
                if guard.step_index >= target():
                    break
            t = guard.step_index
            progress.extend(target())
            x, y = next(stream)
            x, y = injector.begin(t, model, x, y)
            x, y = x.to(device), y.to(device)

            # the guard replays it under the RNG state this step's forward started from
            # (guard.autocast notes it), so dropout draws the same masks
            def rerun(keep: torch.Tensor | None = None, x: torch.Tensor = x,
                      y: torch.Tensor = y) -> Any:
                if keep is not None:  # the rows attribution keeps (drop_sequences)
                    x, y = x[keep], y[keep]
                with guard.autocast():
                    o = model.loss(fwd(x), y)
                guard.backward(o)
                return o

            with guard.autocast():
                loss = model.loss(fwd(x), y)
            guard.backward(loss)
            injector.after_backward(model)
            crash_point("mid_step", t)  # tests only (SPIKEGUARD_TEST_CRASH)
            injector.before_step(optimizer)
            verdicts = guard.step(loss, rerun=rerun, tokens=x)
            injector.after_step(optimizer)
            result.losses.append(float(loss.ce))
            skipped += [v.step for v in verdicts if v.skip]
    except TrainingHalted as halt:
        result.halted = halt.report
    except KeyboardInterrupt:
        raise TrainInterrupted(guard.step_index, resume_step(guard.checkpoints)) from None
    finally:
        guard.close()
        progress.close()
        if oncall is not None:
            sent, unsent = oncall.close(halted=result.halted is not None)
            if unsent:
                console.print(f"on-call: {unsent} page(s) could not be sent ({sent} sent); "
                              f"they are kept in {out / 'pages.jsonl'}")
    result.seconds = time.perf_counter() - start
    result.applied, result.rollbacks = guard.applied, guard.rollbacks
    result.made_up = target() - cfg.steps
    # every rank says what it did: under torchrun the ranks must have decided alike
    (out / "ranks").mkdir(parents=True, exist_ok=True)
    (out / "ranks" / f"rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "steps": guard.step_index, "applied": guard.applied,
         "rollbacks": guard.rollbacks, "made_up": result.made_up, "skipped": skipped,
         "resumed_from": result.resumed_from, "resumed_at_batch": resumed_at,
         "halted": result.halted.step if result.halted else None}))
    if result.halted is None:
        result.val_loss = evaluate(model, data.val, batches=cfg.eval_batches,
                                   batch_size=cfg.batch_size)
    if rank == 0:
        console.print(summary_table(progress, applied=guard.applied, made_up=result.made_up,
                                    rollbacks=guard.rollbacks, val_loss=result.val_loss,
                                    seconds=result.seconds, halted=result.halted is not None))
        if cfg.plot and (out / "metrics.jsonl").exists():
            result.plot = plot_run(read_metrics(out / "metrics.jsonl"), out / "run.png",
                                   title=f"spikeguard train: {cfg.model}, seed {cfg.seed}",
                                   skip_ratio=cfg.guard.detector.skip_ratio)
            if result.plot is not None:
                console.print(f"plot: {result.plot}")
        if result.halted is None:
            console.print(f"held-out loss {result.val_loss:.4f} nats (unigram entropy "
                          f"{result.unigram_entropy:.4f}); metrics: {out / 'metrics.jsonl'}")
    return result

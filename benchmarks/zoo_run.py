"""One zoo run: a plain training loop through the guard's public API, as a user writes it.

``sg.Guard`` with ``sg.GuardConfig(detector=sg.DetectorConfig.for_run(steps[, warmup_steps]))``,
an ``sg.CheckpointManager`` (every 25 steps, keep 5), an ``sg.TokenStream`` over the cell's
corpus and tokenizer (pydoc as bytes unless the cell says), an ``sg.JsonlSink``, and the fault
injector of ``spikeguard.train.faults`` called at the loop's points as ``spikeguard train``
calls it. The loop runs until ``guard.step_index`` reaches
the run's steps plus the updates the guard withheld (made up with more batches, at most 100, as
``spikeguard train`` does), so a skipped garbage batch costs a batch, not an update. The arm
``unguarded`` is the same run with ``GuardConfig(respond=False)``: same seed, same weights,
same batches, every response off.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

__all__ = ["departure", "run_one"]

CKPT_EVERY, KEEP, MAKE_UP = 25, 5, 100
DEPART_WINDOW, DEPART_RATIO, DEPART_RUN = 20, 1.2, 3
"""A run's loss departs from its trend at the first of 3 steps in a row whose loss is above 1.2x
the median of the 20 steps before the first of them (or not finite)."""


def departure(losses: list[float]) -> int | None:
    """The step (index into ``losses``, a run without rollbacks) where the loss departs from its
    trend (above); None when it never does."""
    for t in range(DEPART_WINDOW, len(losses) - DEPART_RUN + 1):
        bar = DEPART_RATIO * statistics.median(losses[t - DEPART_WINDOW:t])
        if all(not x <= bar for x in losses[t:t + DEPART_RUN]):  # NaN counts as above
            return t
    return None


def run_one(job: dict[str, Any], records: list | None = None) -> dict[str, Any]:
    """Train ``job`` (a zoo job dict) in a temporary directory (deleted after) and return its
    summary line (spikeguard.testing.detection.summarize_run's keys plus the zoo's); the run's
    metrics records are added to ``records`` when given."""
    import torch

    import spikeguard as sg
    from benchmarks.zoo_models import build, evaluate, schedule
    from spikeguard.sinks import read_metrics
    from spikeguard.testing.detection import summarize_run
    from spikeguard.train.data import load_train_data
    from spikeguard.train.faults import Injector

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = Path(tempfile.mkdtemp(prefix="sg-zoo-"))
    s = job["setting"]
    start, load = time.perf_counter(), os.getloadavg()[0]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            data = load_train_data(corpus=s["corpus"], data=None, tokenizer=s["tokenizer"],
                                   vocab_size=None)
            torch.manual_seed(job["seed"])
            model, optimizer = build(s["model"], data.vocab_size, dropout=s["dropout"],
                                     qk_norm=s["qk_norm"], z_loss=s["z_loss"],
                                     optimizer=s["optimizer"], lr=s["lr"])
            steps, warmup = s["steps"], s["warmup"]
            scheduler = torch.optim.lr_scheduler.LambdaLR(
                optimizer, schedule(s["schedule"], warmup=warmup, steps=steps))
            stream = sg.TokenStream(data.train, batch_size=s["batch"], seq_len=64,
                                    seed=job["seed"])
            injector = Injector((job["fault_spec"],) if job.get("fault_spec") else (), rank=0,
                                only_rank=None, vocab_size=data.vocab_size, seed=job["seed"])
            for first, last in injector.gaps():
                stream.skip(first, last)
            detector = sg.DetectorConfig.for_run(
                steps, warmup_steps=warmup if s["warmup_given"] else None)
            config = (sg.GuardConfig(detector=detector, clip=1.0, respond=False)
                      if job["arm"] == "unguarded" else
                      sg.GuardConfig(detector=detector, clip=1.0,
                                     tier2=job.get("tier2", job["arm"]), **job.get("guard", {})))
            guard = sg.Guard(model, optimizer, config=config, scheduler=scheduler, data=stream,
                             precision=sg.PrecisionPolicy(kind=s["precision"]),
                             checkpoints=sg.CheckpointManager(out / "checkpoints",
                                                              every=CKPT_EVERY, keep=KEEP),
                             sinks=[sg.JsonlSink(out / "metrics.jsonl")],
                             extra_state={"faults": injector}, keep_on_rollback=("faults",))
            losses, halted = _loop(guard, model, optimizer, stream, injector, steps)
            val = None if halted else evaluate(model, data.val)
        run_records = read_metrics(out / "metrics.jsonl")
        if records is not None:
            records.extend(run_records)
    finally:
        shutil.rmtree(out, ignore_errors=True)
        torch.set_num_threads(threads)
    line = {k: v for k, v in job.items() if k != "setting"}
    line.update(summarize_run(run_records, val_loss=val, fault_step=job.get("fault_step")))
    line.update(applied=guard.applied, result_rollbacks=guard.rollbacks, result_halted=halted,
                wall_s=round(time.perf_counter() - start, 3), load=round(load, 2),
                departure=departure(losses), torch=torch.__version__,
                tier1=sum(int(r.get("tier") or 0) == 1 for r in run_records),
                warnings=sorted({str(w.message)[:160] for w in caught}), **_page_facts(run_records))
    if job["kind"] == "natural":
        line["losses"] = [round(x, 4) for x in losses]
    return line


def _page_facts(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The first Tier 2 page's remedies (their first words: ``guard/remedies.py``), the QK-Clip
    a rollback turned on, and the attention-logit bound's first and largest reading."""
    pages = [r["summary"] for r in records if r.get("tier") == 2 and r.get("summary")]
    bounds = [r["attn_logit_bound"] for r in records if r.get("attn_logit_bound") is not None]
    qk = [r["qk_clip"] for r in records if r.get("qk_clip") is not None]
    return {"remedies": [x.split(":")[0] for x in pages[0].get("remedies") or ()]
            if pages else None, "qk_clip": qk[0] if qk else None,
            "attn_logit_bound": [bounds[0], max(bounds)] if bounds else None}


def _loop(guard: Any, model: Any, optimizer: Any, stream: Any, injector: Any,
          steps: int) -> tuple[list[float], bool]:
    """The user's loop; returns the train loss of every step run (run order) and whether the
    guard halted the run."""
    import spikeguard as sg

    losses: list[float] = []

    def target() -> int:
        return steps + min(guard.withheld, MAKE_UP)
    try:
        while True:
            if guard.step_index >= target():
                guard.flush()
                if guard.step_index >= target():
                    break
            t = guard.step_index
            x, y = next(stream)
            x, y = injector.begin(t, model, x, y)

            def rerun(keep: Any = None, x: Any = x, y: Any = y) -> Any:
                if keep is not None:
                    x, y = x[keep], y[keep]
                with guard.autocast():
                    o = model.loss(model(x), y)
                guard.backward(o)
                return o

            with guard.autocast():
                out = model.loss(model(x), y)
            guard.backward(out)
            injector.after_backward(model)
            injector.before_step(optimizer)
            guard.step(out, rerun=rerun, tokens=x)
            injector.after_step(optimizer)
            losses.append(float(out.ce))
    except sg.TrainingHalted:
        return losses, True
    finally:
        guard.close()
    return losses, False


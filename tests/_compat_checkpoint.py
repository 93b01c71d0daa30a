"""Writes ``data/guard_ckpt_v2/``: a guarded run's checkpoint from the code before issue 42's
refactor of the guard, and how that run went on from it (the test data of
``tests/test_guard_compat.py``).

A tiny GPT (1 layer, d=32) trains 40 steps under the guard with a batch of random bytes at step
26 (an outlier the guard skips, so the withheld count, the detector's skip history and the
attribution's re-runs are non-zero) and a checkpoint every 10 steps; only the newest checkpoint
(step 30) and the metrics file are kept. Then a new model, optimizer and guard resume from it
and train to step 40; its per-step losses (``float.hex``), actions and the guard's counters are written to
``continuation.json``. Run it from the repository root with the old code on PYTHONPATH:

    PYTHONPATH=src:. python tests/_compat_checkpoint.py tests/data/guard_ckpt_v2
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch

import spikeguard as sg
from tests.guard_harness import Fault, guarded_run

__all__ = ["CONFIG", "STEPS", "STOP", "run"]

STEPS, STOP = 40, 31
"""The run's length and the step the first process stops before (its checkpoint is step 30)."""
CONFIG = sg.GPTConfig.tiny(n_layer=1, d_model=32, n_head=2, seq_len=32)


def run(out: Path, *, resume: bool) -> dict:
    """The run of this module's docstring: to ``STOP`` from scratch, or to ``STEPS`` resumed.
    Returns the losses (hex), actions and counters of the steps run in this call."""
    torch.set_num_threads(1)
    r = guarded_run(steps=STEPS, seed=3, faults=[Fault("outlier", step=26)], out=out, every=10,
                    config=CONFIG, batch=4, lr=3e-3, resume=resume,
                    stop_at=None if resume else STOP)
    g = r.guard
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"losses": {str(t): float(v).hex() for t, v in sorted(r.losses.items())},
            "actions": {str(rec["step"]): rec["action"] for rec in records},
            "applied": g.applied, "withheld": g.withheld, "rollbacks": g.rollbacks,
            "records": g.records, "step_index": g.step_index}


def main(dest: str) -> None:
    dest_dir = Path(dest)
    work = dest_dir.parent / (dest_dir.name + ".work")
    shutil.rmtree(work, ignore_errors=True)
    first = run(work, resume=False)
    assert first["withheld"] > 0, f"no skip in the run: {first}"
    ckpts = sorted((work / "ckpt").glob("step_*"))
    for old in ckpts[:-1]:
        shutil.rmtree(old)
    shutil.rmtree(dest_dir, ignore_errors=True)
    shutil.copytree(work, dest_dir)
    second = run(work, resume=True)  # continues in place, as the test does on a copy
    shutil.rmtree(work)
    (dest_dir / "continuation.json").write_text(json.dumps(
        {"checkpoint": ckpts[-1].name, "first": first, "continued": second}, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])

"""The token stream's kill-and-resume check at 4 ranks with FSDP2 (outside CI: 4 ranks x 2
DataLoader workers want more than CI's two cores).

Runs ``tests/_data_dist_job.py`` under torchrun: 4 gloo ranks, each with 2 DataLoader workers
over ``TokenStream.from_corpus`` (rank and world size from torch.distributed), the tiny
reference GPT sharded with FSDP2, a checkpoint every ``--every`` steps, SIGKILL of the whole job
while every rank holds batch ``--hold-at``, then a resume to the end. Checks that every (rank,
worker) pair saw distinct batches, that every rank resumed at the batch after the checkpoint
with the stream's own batches, and that metrics.jsonl has one line per step and run.

    PYTHONPATH=src:. python scripts/data_dist_check.py            # 4 ranks
    PYTHONPATH=src:. python scripts/data_dist_check.py --world 2  # what CI runs
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from tests._data_dist_job import check, kill_and_resume

__all__ = ["main"]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--hold-at", type=int, default=7)
    ap.add_argument("--out", default=None, help="directory for the run (default: a temp dir)")
    args = ap.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="data_dist_check_"))
    t0 = time.perf_counter()
    res = kill_and_resume(out, world=args.world, steps=args.steps, every=args.every,
                          hold_at=args.hold_at, timeout=600)
    summary = check(res)
    print(f"PASS in {time.perf_counter() - t0:.1f} s: {summary} (files in {out})")
    return summary


if __name__ == "__main__":
    main()

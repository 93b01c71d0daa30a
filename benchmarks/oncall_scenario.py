"""The on-call scenario end to end: a run without z-loss whose logits drift, four ways.

Each seed runs ``spikeguard train`` (tiny model, batch 8, 300 steps, peak LR 3e-3, z-loss 0,
``--inject logit-drift@150:0.05``, checkpoints every 50 steps) as a user would, in a subprocess:

- clean: the same run without the fault (the reference);
- unguarded: with the fault, the guard recording only (``--no-respond``);
- rollback: ``--tier2 rollback``: back to the suggested checkpoint, the same settings;
- ask: ``--ask`` with the page posted to a real webhook server on 127.0.0.1; when the page
  arrives, this script answers as the on-call engineer would: ``spikeguard respond RUN_DIR
  rollback --incident ID --to <the page's suggested checkpoint> --set z_loss=1e-4`` (roll back
  to before log Z began to rise, add z-loss). A later incident, if any, gets no answer and its
  default (continue) applies after 5 s.

It prints, per seed and arm, the held-out loss, its ratio to the clean run, the largest log Z
over the last 100 steps, and for ask the step of the page, the checkpoint restored and how
long the answer took to apply. Runs go one at a time (one torch thread each).

    PYTHONPATH=src:. python benchmarks/oncall_scenario.py --seeds 0 1 2 3 4
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests._oncall_hook import hook

__all__ = ["main"]

BASE = ["--model", "tiny", "--batch-size", "8", "--steps", "300", "--lr", "3e-3", "--z-loss", "0",
        "--no-progress", "--ckpt-every", "50", "--no-plot"]
FAULT = ["--inject", "logit-drift@150:0.05"]
ARMS = {"clean": [], "unguarded": [*FAULT, "--no-respond"],
        "rollback": [*FAULT, "--tier2", "rollback"], "ask": [*FAULT, "--ask", "--answer-within-s", "5"]}


def _train(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "spikeguard", "train", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _read(out: Path) -> dict:
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    last = {r["step"]: r for r in recs}  # the path training kept
    tail = [last[s]["log_z"] for s in sorted(last)[-100:] if isinstance(last[s]["log_z"], float)]
    return {"max_log_z_last100": max(tail), "records": recs}


def run_arm(arm: str, seed: int, root: Path) -> dict:
    out = root / f"{arm}-{seed}"
    args = [*BASE, *ARMS[arm], "--seed", str(seed), "--out", str(out)]
    row: dict = {"arm": arm, "seed": seed}
    t0 = time.monotonic()
    if arm != "ask":
        proc = _train(args)
        so, se = proc.communicate()
    else:
        with hook() as h:
            proc = _train([*args, "--page-to", h.url])
            try:
                page = h.wait(1, timeout=600)[0]["body"]
                s = page["summary"]
                to = s["rollback_checkpoint"]
                r = subprocess.run([sys.executable, "-m", "spikeguard", "respond", str(out),
                                    "rollback", "--incident", page["incident"], "--to", str(to),
                                    "--set", "z_loss=1e-4"], capture_output=True, text=True)
                assert r.returncode == 0, r.stderr
                row.update(page_step=s["step"], onset=s["onset_step"], to=to)
            except TimeoutError:
                row["page_step"] = None
            so, se = proc.communicate()
            row["pages"] = len(h.posts)
        if row.get("page_step") is not None:
            notes = [r for r in _read(out)["records"] if "oncall" in r]
            row["decisions"] = [(n["step"], n["oncall"]["decision"], n["oncall"]["by"]) for n in notes]
            # from the incident opening (rank 0's clock) to the answer applied
            row["page_to_decision_s"] = notes[0]["oncall"]["waited_s"] if notes else None
    if proc.returncode != 0:
        raise RuntimeError(f"{arm} seed {seed}: rc {proc.returncode}\n{se[-2000:]}")
    row["val_loss"] = float(re.search(r"held-out loss ([\d.]+)", so).group(1))
    row["max_log_z_last100"] = round(_read(out)["max_log_z_last100"], 3)
    row["wall_s"] = round(time.monotonic() - t0, 1)
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--results", type=Path, default=None, help="append each row as JSON here")
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for arm in ARMS:
                row = run_arm(arm, seed, Path(tmp))
                rows.append(row)
                print(json.dumps(row), flush=True)
                if args.results:
                    with open(args.results, "a") as f:
                        f.write(json.dumps(row) + "\n")
    clean = {r["seed"]: r["val_loss"] for r in rows if r["arm"] == "clean"}
    print("\n| arm | seeds | held-out loss (mean) | vs clean (max) | vs unguarded (max) | "
          "max log Z, last 100 steps (max) |")
    print("|---|---|---|---|---|---|")
    ung = {r["seed"]: r["val_loss"] for r in rows if r["arm"] == "unguarded"}
    for arm in ARMS:
        rs = [r for r in rows if r["arm"] == arm]
        print(f"| {arm} | {len(rs)} | {statistics.mean(r['val_loss'] for r in rs):.4f} | "
              f"{max(r['val_loss'] / clean[r['seed']] for r in rs):.4f} | "
              f"{max(r['val_loss'] / ung[r['seed']] for r in rs):.4f} | "
              f"{max(r['max_log_z_last100'] for r in rs):.3f} |")


if __name__ == "__main__":
    main()

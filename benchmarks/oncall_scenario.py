"""The on-call scenario end to end: a run without z-loss whose logits drift, five ways.

Each seed runs ``spikeguard train`` (tiny model, batch 8, 300 steps, peak LR 3e-3, z-loss 0,
checkpoints every 50 steps) as a user would, in a subprocess. The fault is
``--inject logit-drift@150:0.05!``: from step 150 the head's input is scaled by
(1 + 0.05 (t - 150)), and again from the start after a rollback (``!``: the model's own
tendency, not a transient that a rollback leaves behind).

- clean: the same run without the fault (the reference);
- unguarded: with the fault, the guard recording only (``--no-respond``);
- rollback: ``--tier2 rollback``: back to the suggested checkpoint, no change (the budget of 3
  rollbacks, then a halt);
- ask-1e-4, ask-1e-3: ``--tier2 ask`` with the page posted to a real webhook server on 127.0.0.1;
  when the page arrives, this script answers as the on-call engineer would: ``spikeguard
  respond RUN_DIR rollback --incident ID --to <the page's suggested checkpoint> --set
  z_loss=Z`` (roll back to before log Z began to rise, add z-loss). A later incident, if any,
  is answered ``continue`` (z-loss is on: let it work).

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
FAULT = ["--inject", "logit-drift@150:0.05!"]
ASK = [*FAULT, "--tier2", "ask", "--answer-within-s", "300"]
ARMS = {"clean": [], "unguarded": [*FAULT, "--no-respond"],
        "rollback": [*FAULT, "--tier2", "rollback"], "ask-1e-4": ASK, "ask-1e-3": ASK}


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
    if not arm.startswith("ask"):
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
                                    "--set", f"z_loss={arm.split('-', 1)[1]}"], capture_output=True, text=True)
                assert r.returncode == 0, r.stderr
                row.update(page_step=s["step"], onset=s["onset_step"], to=to)
            except TimeoutError:
                row["page_step"] = None
            seen = 1
            while proc.poll() is None:  # later incidents: continue
                time.sleep(0.5)
                triggers = [p["body"] for p in list(h.posts) if p["body"]["event"] == "trigger"]
                for later in triggers[seen:]:
                    subprocess.run([sys.executable, "-m", "spikeguard", "respond", str(out),
                                    "continue", "--incident", later["incident"]],
                                   capture_output=True, text=True)
                seen = len(triggers)
            so, se = proc.communicate()
            row["pages"] = len(h.posts)
        if row.get("page_step") is not None:
            notes = [r for r in _read(out)["records"] if "oncall" in r]
            row["decisions"] = [(n["step"], n["oncall"]["decision"], n["oncall"]["by"]) for n in notes]
            # from the incident opening (rank 0's clock) to the answer applied
            row["page_to_decision_s"] = notes[0]["oncall"]["waited_s"] if notes else None
    if proc.returncode not in (0, 3):
        raise RuntimeError(f"{arm} seed {seed}: rc {proc.returncode}\n{se[-2000:]}")
    row["halted"] = proc.returncode == 3
    found = re.search(r"held-out loss ([\d.]+)", so)
    row["val_loss"] = float(found.group(1)) if found else None
    row["rollbacks"] = json.loads((out / "ranks" / "rank0.json").read_text())["rollbacks"]
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
    table(rows)


def table(rows: list[dict]) -> None:
    """The Markdown table of BENCHMARKS.md from the rows."""
    clean = {r["seed"]: r["val_loss"] for r in rows if r["arm"] == "clean"}
    ung = {r["seed"]: r["val_loss"] for r in rows if r["arm"] == "unguarded"}
    print("\n| arm | runs | halted | rollbacks | held-out loss (mean) | vs clean (max) | "
          "vs unguarded (max) | max log Z, last 100 steps (max) |")
    print("|---|---|---|---|---|---|---|---|")
    for arm in ARMS:
        rs = [r for r in rows if r["arm"] == arm]
        done = [r for r in rs if r["val_loss"] is not None]
        mean = f"{statistics.mean(r['val_loss'] for r in done):.4f}" if done else "-"
        vc = f"{max(r['val_loss'] / clean[r['seed']] for r in done):.4f}" if done else "-"
        vu = f"{max(r['val_loss'] / ung[r['seed']] for r in done):.4f}" if done else "-"
        print(f"| {arm} | {len(rs)} | {sum(r['halted'] for r in rs)} | "
              f"{sum(r['rollbacks'] for r in rs)} | {mean} | {vc} | {vu} | "
              f"{max(r['max_log_z_last100'] for r in rs):.3f} |")


if __name__ == "__main__":
    main()

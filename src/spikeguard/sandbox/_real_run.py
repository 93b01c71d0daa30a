"""The child process of real mode: ``python -m spikeguard.sandbox._real_run CONFIG_JSON FOLDER``.

Trains ``GPTConfig.tiny()`` through the Guard with ``spikeguard.train`` (the same loop as
``spikeguard train``), writing ``FOLDER/metrics.jsonl`` as it goes and ``FOLDER/result.json``
at the end. It leaves as soon as the server that started it is gone, removing its folder, so a
killed server leaves no run behind.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import sys
import threading
import time
from pathlib import Path

from .real import ROOT_PREFIX, RealConfig

__all__ = ["main"]


def _exit_with_parent(parent: int, folder: Path) -> None:
    """Leave, removing the run's folder, once the server is gone (it cannot clean up after a
    SIGKILL itself)."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            if folder.parent.name.startswith(ROOT_PREFIX):  # only a folder the server made
                shutil.rmtree(folder, ignore_errors=True)
                with contextlib.suppress(OSError):
                    folder.parent.rmdir()  # the server's root, once no run is left in it
            os._exit(4)


_CAUSES = {"data": "the batch", "weights": "the weights", "transient": "a transient fault",
           "unknown": "cause unknown"}


def what_the_guard_did(metrics: Path) -> str:
    """One sentence from the run's records: each step the guard acted on, with its cause."""
    from ..sinks import read_metrics

    acted = [r for r in read_metrics(metrics) if r.get("action") not in (None, "continue")]
    if not acted:
        return "the guard never had to act: every update was applied"
    parts = []
    for r in acted[:12]:
        what = {"skip": "skipped", "drop": "dropped rows of", "alert": "alerted at",
                "rollback": f"rolled back to step {r.get('rollback_to')} from",
                "halt": "halted at"}.get(r["action"], r["action"])
        cause = _CAUSES.get(r.get("cause"), "")
        tier2 = " (Tier 2: " + (r.get("reasons") or [""])[0] + ")" if r.get("tier") == 2 else ""
        let = ", update applied" if r["action"] == "alert" and not r.get("skipped") else ""
        parts.append(f"{what} step {r['step']}" + (f" ({cause}{let})" if cause else let) + tier2)
    more = f"; and {len(acted) - 12} more" if len(acted) > 12 else ""
    return "the guard " + "; ".join(parts) + more


def main(argv: list[str]) -> int:
    folder = Path(argv[1])
    threading.Thread(target=_exit_with_parent, args=(os.getppid(), folder), daemon=True).start()
    config = RealConfig(**json.loads(argv[0]))

    import torch

    from ..train import train

    torch.set_num_threads(1)
    result = train(config.train_config(str(folder)), echo=False)
    halted = result.halted
    summary = {"status": "halted" if halted is not None else "finished",
               "guard": what_the_guard_did(folder / "metrics.jsonl"),
               "applied": result.applied, "made_up": result.made_up,
               "rollbacks": result.rollbacks,
               "train_seconds": round(result.seconds, 2),
               "val_loss": round(result.val_loss, 4) if math.isfinite(result.val_loss) else None,
               "halt": None if halted is None else {"step": halted.step,
                                                    "reasons": list(halted.reasons),
                                                    "detail": halted.detail}}
    tmp = folder / "result.json.tmp"
    tmp.write_text(json.dumps(summary))
    os.replace(tmp, folder / "result.json")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Subprocess for the save-kill-resume test: trains the tiny reference GPT with checkpoints.

python -m tests._ckpt_worker CKPT_DIR RESULT_FILE --steps N --every K [--kill-after S] [--resume]

Steps count from 1; step s consumes the stream's batch s-1 and the checkpoint at step s holds
the state after update s. With --kill-after S the process SIGKILLs itself in the middle of
step S+1 (after S's checkpoint). RESULT_FILE gets the final state for comparison.
"""

from __future__ import annotations

import argparse
import os
import random
import signal

import numpy as np
import torch

from spikeguard.checkpoint.manager import CheckpointManager
from spikeguard.data import TokenStream
from spikeguard.measure.stats import EMA, RunningMedian
from spikeguard.model import GPT, GPTConfig


class Detector:
    """Stand-in with the detector's state protocol: a loss EMA and a grad-norm median."""

    def __init__(self) -> None:
        self.ema, self.median = EMA(alpha=0.1), RunningMedian(window=5)

    def update(self, loss: float, grad_norm: float) -> None:
        self.ema.update(loss)
        self.median.update(grad_norm)

    def state_dict(self) -> dict:
        return {"ema": self.ema.state_dict(), "median": self.median.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.ema.load_state_dict(state["ema"])
        self.median.load_state_dict(state["median"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("result")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--kill-after", type=int, default=None)
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model = GPT(GPTConfig.tiny(dropout=0.1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    data = TokenStream.from_corpus("pydoc", batch_size=4, seq_len=64, seed=7)
    det = Detector()
    mgr = CheckpointManager(args.ckpt, model=model, optimizer=opt, scheduler=sched, data=data,
                            states={"detector": det}, every=args.every, keep=2)
    start = 1
    if args.resume:
        start = mgr.restore().step + 1
    for step in range(start, args.steps + 1):
        x, y = next(data)
        loss = model.loss(model(x), y).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if step == (args.kill_after or -1) + 1:
            os.kill(os.getpid(), signal.SIGKILL)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        # host-side randomness that must resume too
        det.update(float(loss.detach()) + 1e-3 * random.random() + 1e-3 * float(np.random.rand()),
                   float(norm))
        mgr.maybe_save(step)
    torch.save({"model": model.state_dict(), "optim": opt.state_dict(),
                "sched": sched.state_dict(), "data": data.state_dict(),
                "detector": det.state_dict(), "torch_rng": torch.get_rng_state(),
                "py_rng": random.getstate(), "np_rng": np.random.get_state()[1]}, args.result)


if __name__ == "__main__":
    main()

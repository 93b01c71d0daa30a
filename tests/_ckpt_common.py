"""Helpers shared by the checkpoint tests: a tiny GPT with AdamW and a LambdaLR, two
checkpoints of one run (steps 2 and 4), tampering as someone with write access would do it."""

import json
import os
import shutil
import zlib

import torch

from spikeguard import GPT, CheckpointManager, GPTConfig


def build(seed: int = 0):
    torch.manual_seed(seed)
    model = GPT(GPTConfig.tiny())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    return model, opt, sched


def train_steps(model, opt, sched, steps: int = 1) -> None:
    x = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(steps))
    for _ in range(steps):
        loss = model.loss(model(x[:, :-1]), x[:, 1:]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()


def params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def make_pair(root):
    """Checkpoints at steps 2 and 4 of one run under ``root/ck``; returns (dir, step-2 params)."""
    model, opt, sched = build()
    mgr = CheckpointManager(root / "ck", model=model, optimizer=opt, scheduler=sched, every=2)
    train_steps(model, opt, sched, 2)
    mgr.save(2)
    at2 = params(model)
    train_steps(model, opt, sched, 2)
    mgr.save(4)
    return root / "ck", at2


def copy_pair(pair, tmp_path):
    """A private copy of a pair: (manager, params at step 2)."""
    shutil.copytree(pair[0], tmp_path / "ck")
    return CheckpointManager(tmp_path / "ck", every=2), pair[1]


def reopen(mgr, **states):
    """A manager over ``mgr``'s directory with its settings and these states: how a test
    restores into other objects than the ones that were saved."""
    return CheckpointManager(mgr.directory, every=mgr.every, keep=mgr.keep, digest=mgr.digest,
                             **states)


def restore_fresh(mgr, **kw):
    """Restore ``mgr``'s newest healthy checkpoint into a freshly built model, optimizer and
    scheduler; returns (info, model, opt, sched). The reading manager is ``restore_fresh.last``."""
    model, opt, sched = build(seed=123)
    reader = restore_fresh.last = reopen(mgr, model=model, optimizer=opt, scheduler=sched)
    info = reader.restore(**kw)
    return info, model, opt, sched


def remanifest(path) -> None:
    """Recompute the manifest to match tampered files, as an attacker with write access would."""
    files = {p.name: {"size": p.stat().st_size, "digest": f"crc32:{zlib.crc32(p.read_bytes()):08x}"}
             for p in sorted(path.iterdir()) if p.is_file() and p.name != "MANIFEST.json"}
    manifest = json.loads((path / "MANIFEST.json").read_text())
    manifest["files"] = files
    (path / "MANIFEST.json").write_text(json.dumps(manifest))


class Payload:
    """Unpickling this calls os.mkdir(marker): it stands for arbitrary code."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))

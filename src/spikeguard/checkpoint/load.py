"""Loading one checkpoint on this rank, and checking a whole one: the private half of
``checkpoint.py``.

Every rank reads, once each and from inside the checkpoint directory only: ``MANIFEST.json``,
``info.json``, its own ``rank<r>.json`` and ``.metadata`` (each hashed against the manifest),
then, through DCP, the shard files its load plan needs (each mapped once and hashed while it is
deserialised). The ranks vote once before DCP reads a tensor; DCP's own gather of read errors
makes every rank refuse when one rank's shard is corrupt.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from .. import _dist
from . import io
from .files import CheckpointDir, FileEntry, IntegrityError, IOStats, parse_manifest

__all__ = ["INFO", "MANIFEST", "Refused", "load", "verify_checkpoint"]

MANIFEST = "MANIFEST.json"
INFO = "info.json"


class Refused(Exception):
    """This checkpoint cannot be used (the message says why); all ranks raise it together."""


def load(path: Path, step: int, healthy: bool, model: torch.nn.Module, optimizer: Any,
         statefuls: dict[str, Any], restore_rng: bool, stats: IOStats) -> None:
    """Restore the checkpoint at ``path`` (listed with ``step`` and ``healthy``) into the given
    objects; :class:`Refused` on every rank when any rank finds it unusable."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    from .safe_reader import SafeLoadPlanner, SafeReader

    local: str | None = None
    side: dict[str, Any] = {}
    cdir = reader = None
    try:
        cdir = CheckpointDir(path)
        try:
            files = parse_manifest(cdir.read(MANIFEST, None, stats))
        except IntegrityError as e:
            raise IntegrityError(f"{path} is not a committed checkpoint: {e}") from e
        if _dist.rank() == 0 and cdir.names() - set(files) - {MANIFEST}:
            raise IntegrityError(f"files not in its manifest: "
                                 f"{sorted(cdir.names() - set(files) - {MANIFEST})}")
        info = json.loads(cdir.read(INFO, _listed(files, INFO), stats))
        if info.get("step") != step or info.get("healthy") != healthy:
            raise IntegrityError(f"{INFO} changed since the checkpoint was listed")
        name = f"rank{_dist.rank()}.json"
        side = io.decode(json.loads(cdir.read(name, _listed(files, name), stats)))
        missing = [k for k in [*statefuls, "rest"] if k not in side]
        if missing:
            raise IntegrityError(f"it holds no state for {missing}")
        reader = SafeReader(cdir, files, stats)
        reader.verify_metadata()  # digest, allowlist and storage checks, before DCP reads it
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
        local = str(e)
    try:
        if not _dist.all_true(local is None):
            raise Refused(local or "another rank refused it")
        msd, osd = io.model_optim(model, optimizer)
        tensors, _ = io.split({"model": msd, "optim": osd})
        try:
            with io.quiet():
                dcp.load(tensors, storage_reader=reader, planner=SafeLoadPlanner(),
                         no_dist=not _dist.is_dist())
        except (Exception, CheckpointException) as e:  # a BaseException: DCP's gather of
            # every rank's read failures, raised on every rank
            raise Refused(f"loading its tensors failed: {_short(e)}") from e
    finally:
        if cdir is not None:
            cdir.close()
    state = io.join(tensors, side["rest"])
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    for key, obj in statefuls.items():
        obj.load_state_dict(side[key])
    if restore_rng and "rng" in side:
        io.set_rng_state(side["rng"])


def _listed(files: dict[str, FileEntry], name: str) -> FileEntry:
    if name not in files:
        raise IntegrityError(f"its manifest lists no {name}")
    return files[name]


def _short(e: BaseException) -> str:
    text = str(e)
    for marker in ("IntegrityError: ", "UnsafeCheckpointError: ", "UnpicklingError: "):
        if marker in text:
            return marker + text.split(marker, 1)[1].strip().splitlines()[0]
    return f"{type(e).__name__}: {text.strip().splitlines()[-1] if text.strip() else ''}"


def verify_checkpoint(path: str | Path) -> dict[str, int]:
    """Check a whole checkpoint directory against its manifest: every listed file present (a
    regular file, not a symlink) with its size and digest, no unlisted file. Returns
    name -> size; ValueError says what is wrong. (restore() checks only what each rank reads.)"""
    stats = IOStats()
    with CheckpointDir(path) as cdir:
        try:
            files = parse_manifest(cdir.read(MANIFEST, None, stats))
        except IntegrityError as e:
            raise IntegrityError(f"{path} is not a committed checkpoint: {e}") from e
        extra = cdir.names() - set(files) - {MANIFEST}
        if extra:
            raise IntegrityError(f"files not in its manifest: {sorted(extra)}")
        for name, want in files.items():
            with cdir.mapped(name, want.size, cdir.segments(name, files, stats), stats) as f:
                f.verify()
    return {name: want.size for name, want in files.items()}

"""Real mode: ``spikeguard train`` on ``GPTConfig.tiny()`` in a child process, one run at a time.

The page's toggles become a :class:`RealConfig`; :class:`RealRuns` starts the child
(``python -m spikeguard.sandbox._real_run``), which trains the reference GPT through the Guard
on this machine's CPU and writes the usual ``metrics.jsonl`` (one record per step, the schema in
docs/design.md). :meth:`RealRuns.events` tails that file as server-sent events: one ``message``
per record (its ``id`` is the record count, so a reconnecting ``EventSource`` resumes where it
left off), then one ``end`` event with how the run ended.

The child owns the CPU work, so the server's event loop only reads a file a few times a second.
It runs with one intra-op thread (a 120k-parameter model gains nothing from more, and the page
stays responsive), exits by itself if the server dies, and is stopped when the server shuts down.
Run folders live in one temporary directory, removed at shutdown; only the newest run is kept.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .._validate import check_int

__all__ = ["MAX_STEPS", "ROOT_PREFIX", "RealBusy", "RealConfig", "RealRun", "RealRuns"]

MAX_STEPS = 2000
"""The longest real run the page may ask for (about a minute or two of one CPU core)."""

ROOT_PREFIX = "spikeguard-sandbox-"
"""The server's temporary folder of runs is named with this prefix."""

_MIN_STEPS = 50
_MAX_SEED = 2**31 - 1
_POLL_S = 0.1
_HEARTBEAT_S = 10.0
_LOG_TAIL = 2000


@dataclass(kw_only=True, frozen=True)
class RealConfig:
    """One real run: the page's toggles. Each switches a library default off or on, and the
    default itself stays where it lives (GuardConfig.clip, TrainConfig.warmup_steps,
    GPTConfig.z_loss)."""

    steps: int = 200
    """Optimizer steps of the tiny model (50 to 2000)."""
    clip: bool = False
    """Global-norm clipping at GuardConfig's default threshold; off: GuardConfig(clip=None)."""
    warmup: bool = False
    """Linear warmup over TrainConfig's default warmup steps; off: the LR starts at its peak."""
    z_loss: bool = False
    """z-loss at GPTConfig's default coefficient; off: GPTConfig(z_loss=0.0)."""
    outlier: bool = True
    """Inject an outlier batch (random bytes) at ``outlier_step``."""
    outlier_step: int = 100
    """The step whose batch is replaced (0 to steps - 1)."""
    rollback: bool = False
    """Tier 2 policy: roll back to the newest healthy checkpoint instead of alerting."""
    seed: int = 1
    """Seed of the weights and the batch order (0 to 2**31 - 1)."""

    def __post_init__(self) -> None:
        check_int(self.steps, "steps", minimum=_MIN_STEPS, default=200)
        if self.steps > MAX_STEPS:
            raise ValueError(f"steps={self.steps} must be <= {MAX_STEPS} (default 200): real "
                             f"mode trains on this machine's CPU while you wait")
        check_int(self.outlier_step, "outlier_step", minimum=0, default=100)
        if self.outlier_step >= self.steps:
            raise ValueError(f"outlier_step={self.outlier_step} must be below steps={self.steps}")
        check_int(self.seed, "seed", minimum=0, default=1)
        if self.seed > _MAX_SEED:
            raise ValueError(f"seed={self.seed} must be <= {_MAX_SEED} (default 1)")
        for name in ("clip", "warmup", "z_loss", "outlier", "rollback"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be true or false")

    def train_config(self, out: str) -> Any:
        """The ``spikeguard.train.TrainConfig`` of this run, writing into ``out`` (imports
        torch: called in the child, never by the server)."""
        import dataclasses

        from ..train import TrainConfig

        base = TrainConfig(model="tiny", steps=self.steps, seed=self.seed, out=out, fresh=True,
                           progress=False, plot=False,
                           inject=(f"outlier@{self.outlier_step}",) if self.outlier else ())
        guard = dataclasses.replace(base.guard, clip=base.guard.clip if self.clip else None,
                                    tier2="rollback" if self.rollback else "alert")
        gpt = base.gpt if self.z_loss else dataclasses.replace(base.gpt, z_loss=0.0)
        return dataclasses.replace(base, guard=guard, gpt=gpt,
                                   warmup_steps=base.warmup_steps if self.warmup else 0)


class RealBusy(Exception):
    """A real run is already running (the server answers 409 with this message)."""


@dataclass
class RealRun:
    """One child process and its folder."""

    id: int
    config: RealConfig
    folder: Path
    proc: subprocess.Popen
    stopped: bool = False

    @property
    def metrics(self) -> Path:
        return self.folder / "metrics.jsonl"

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    def records(self) -> int:
        """Complete records written so far."""
        try:
            return self.metrics.read_bytes().count(b"\n")
        except FileNotFoundError:
            return 0

    def outcome(self) -> dict[str, Any]:
        """How the run ended: status (finished, halted, stopped, failed) and what it measured;
        call once the child has exited."""
        rc = self.proc.poll()
        out: dict[str, Any] = {"run": self.id, "returncode": rc}
        try:
            out.update(json.loads((self.folder / "result.json").read_text()))
        except (FileNotFoundError, ValueError):
            pass
        if self.stopped:
            out["status"] = "stopped"
        elif "status" not in out:
            out["status"] = "failed"
            log = self.folder / "child.log"
            tail = log.read_text(errors="replace")[-_LOG_TAIL:] if log.exists() else ""
            out["message"] = f"the training process exited with status {rc}: {tail.strip()}"
        return out

    def describe(self) -> dict[str, Any]:
        return {"run": self.id, "running": self.running, "records": self.records(),
                "config": asdict(self.config), "events": f"/api/real/events?run={self.id}"}


class RealRuns:
    """The server's real runs: at most one child at a time; the newest run's folder is kept."""

    def __init__(self) -> None:
        self._root: Path | None = None
        self.current: RealRun | None = None
        self._next_id = 1

    def start(self, config: RealConfig) -> RealRun:
        """Start a run, or raise RealBusy when one is running."""
        cur = self.current
        if cur is not None and cur.running:
            raise RealBusy(f"a real run is already running (run {cur.id}: {cur.records()} of "
                           f"{cur.config.steps} steps); one runs at a time, so wait for it to "
                           f"end or stop it (POST /api/real/stop)")
        if self._root is None:
            self._root = Path(tempfile.mkdtemp(prefix=ROOT_PREFIX))
        if cur is not None:
            shutil.rmtree(cur.folder, ignore_errors=True)
        run_id, self._next_id = self._next_id, self._next_id + 1
        folder = self._root / f"run{run_id}"
        folder.mkdir()
        pkg_root = str(Path(__file__).resolve().parents[2])  # the spikeguard this server runs
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(p for p in (pkg_root, os.environ.get("PYTHONPATH"))
                                              if p))
        with open(folder / "child.log", "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "spikeguard.sandbox._real_run",
                 json.dumps(asdict(config)), str(folder)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                cwd=folder, start_new_session=True)
        self.current = RealRun(run_id, config, folder, proc)
        return self.current

    def stop(self) -> RealRun | None:
        """Stop the running run (SIGTERM, then SIGKILL after 5 s); None when none runs."""
        cur = self.current
        if cur is None or not cur.running:
            return None
        cur.stopped = True
        _terminate(cur.proc)
        return cur

    def close(self) -> None:
        """Stop any run and remove every run folder (server shutdown)."""
        if self.current is not None and self.current.running:
            self.current.stopped = True
            _terminate(self.current.proc)
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None

    async def events(self, run: RealRun, after: int = 0) -> AsyncIterator[str]:
        """Server-sent events for ``run``: one ``config`` event (what the child is training,
        read from its config.json), each record from number ``after`` on as a message (``id`` =
        records so far), a comment every few seconds while nothing happens, then one ``end``
        event with :meth:`RealRun.outcome`."""
        offset, seen, quiet, described = 0, 0, time.monotonic(), False
        pending = b""
        while True:
            exited = not run.running  # read the files after this, so nothing written is missed
            out = []
            if not described:
                what = _what_ran(run.folder / "config.json")
                if what is not None:
                    described = True
                    out.append(f"event: config\ndata: {json.dumps(what)}\n\n")
            if described or exited:
                try:
                    with open(run.metrics, "rb") as f:
                        f.seek(offset)
                        chunk = f.read()
                except FileNotFoundError:
                    chunk = b""
                offset += len(chunk)
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    seen += 1
                    if seen > after:
                        out.append(f"id: {seen}\ndata: {line.decode('utf-8', 'replace')}\n\n")
            if out:
                quiet = time.monotonic()
                yield "".join(out)
                continue
            if exited:
                yield f"event: end\ndata: {json.dumps(run.outcome())}\n\n"
                return
            if time.monotonic() - quiet > _HEARTBEAT_S:
                quiet = time.monotonic()
                yield ": still training\n\n"
            await asyncio.sleep(_POLL_S)


def _what_ran(path: Path) -> dict[str, Any] | None:
    """The facts of a run from the config.json ``spikeguard train`` writes before its first
    step; None until the file is complete."""
    try:
        d = json.loads(path.read_text())
        cfg, model = d["config"], d["model"]
        return {"model": "GPTConfig.tiny()", "params": d["params"], "n_layer": model["n_layer"],
                "d_model": model["d_model"], "seq_len": model["seq_len"],
                "batch_size": cfg["batch_size"], "lr": cfg["lr"], "steps": cfg["steps"],
                "clip": cfg["guard"]["clip"], "warmup_steps": cfg["warmup_steps"],
                "z_loss": model["z_loss"], "qk_norm": model["qk_norm"],
                "tier2": cfg["guard"]["tier2"], "arm_after": cfg["guard"]["detector"]["arm_after"],
                "inject": cfg["inject"], "precision": d["precision"], "data": d["data"]}
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


def _terminate(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()

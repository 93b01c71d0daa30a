"""The torchtitan integration on CUDA GPUs: the CPU tests' job (tests/_titan_job.py: outlier
skip, kill-and-resume, rollback within 2% of clean, NaN halt) and their assertions
(tests/test_integrations_torchtitan.py), run under torchrun on one rank per GPU (at most 2), with
NCCL, torchtitan's compiled FlexAttention and block mask (the CPU stand-ins of
tests/_titan_cpu.py apply only off CUDA).

    PYTHONPATH=src:. python benchmarks/gpu_check.py --only torchtitan_guard
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import torch

__all__ = ["torchtitan_guard"]

ROOT = Path(__file__).resolve().parents[1]


def torchtitan_guard(smoke: bool = False) -> tuple[bool, str]:
    """(passed, detail): the four torchtitan tests on this machine's GPUs."""
    if importlib.util.find_spec("torchtitan") is None:
        return False, ("torchtitan is not installed: run scripts/install_torchtitan.sh first "
                       "(WHEELS=folder for a machine without a package index)")
    world = min(2, torch.cuda.device_count())
    env = dict(os.environ, SPIKEGUARD_TITAN_NPROC=str(world), PYTHONPATH=os.pathsep.join(
        [str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "tests/test_integrations_torchtitan.py"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    return proc.returncode == 0, f"{world} GPU rank(s): {lines[-1] if lines else 'no output'}"

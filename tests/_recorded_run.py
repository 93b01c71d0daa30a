"""The 50-step training run of tests/test_recorded.py, in a process whose kernels are pinned.

Float results depend on which code path each library picks for the CPU it runs on: ATen's
vectorized kernels (``ATEN_CPU_CAPABILITY``: DEFAULT, AVX2, AVX512), MKL's GEMM branch
(``MKL_CBWR``) and oneDNN's JIT kernels (GELU goes through oneDNN on CPU; its erf differs per ISA).
This process is started with the ATen capability named on the command line, MKL on its
COMPATIBLE branch in strict CNR mode, oneDNN off (GELU then runs ATen's own kernel) and capped at
SSE4.1 in case anything reaches it, and one thread everywhere, so the losses depend on the
capability alone. Prints one JSON object: the capability torch ran with and the 50 losses as
float.hex strings.

    python -m tests._recorded_run AVX2
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = 50


def pinned_env(capability: str, base: dict[str, str]) -> dict[str, str]:
    """``base`` with every variable that picks a CPU code path set to one value."""
    env = dict(base)
    env.update(ATEN_CPU_CAPABILITY=capability.lower(), MKL_CBWR="COMPATIBLE,STRICT",
               ONEDNN_MAX_CPU_ISA="SSE41", DNNL_MAX_CPU_ISA="SSE41", OMP_NUM_THREADS="1",
               MKL_NUM_THREADS="1", MKL_DYNAMIC="FALSE")
    return env


def host_capability() -> str:
    """The recorded capability this CPU can run: AVX2 on an AVX2 or AVX-512 CPU, else DEFAULT."""
    import torch

    have = torch.backends.cpu.get_cpu_capability()
    return "AVX2" if have.startswith(("AVX2", "AVX512")) else "DEFAULT"


_STARTED: dict[str, subprocess.Popen] = {}


def start(capability: str, base_env: dict[str, str]) -> None:
    """Start the pinned run in the background (once per capability); ``result`` collects it."""
    if capability not in _STARTED:
        _STARTED[capability] = subprocess.Popen(
            [sys.executable, "-m", "tests._recorded_run", capability], cwd=ROOT,
            env=pinned_env(capability, base_env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)


def result(capability: str, base_env: dict[str, str]) -> tuple[str, list[str]]:
    """Wait for the pinned run under ``capability``; return (capability torch used, hex losses)."""
    start(capability, base_env)
    proc = _STARTED.pop(capability)
    stdout, stderr = proc.communicate(timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"the pinned 50-step run failed ({proc.returncode}):\n{stderr}")
    got = json.loads(stdout.strip().splitlines()[-1])
    return got["capability"], got["losses"]


def stop_all() -> None:
    """End the runs started but never collected (their test was deselected or never reached)."""
    while _STARTED:
        _, proc = _STARTED.popitem()
        proc.kill()
        proc.communicate()


def _main(capability: str) -> None:
    import torch

    torch.set_num_threads(1)
    torch.backends.mkldnn.enabled = False
    from spikeguard.train import TrainConfig, train

    with tempfile.TemporaryDirectory() as out:
        cfg = TrainConfig(steps=STEPS, seed=0, out=out, progress=False, plot=False)
        losses = train(cfg, echo=False).losses
    used = torch.backends.cpu.get_cpu_capability()
    assert used == capability.upper(), (used, capability)
    print(json.dumps({"capability": used, "losses": [float(x).hex() for x in losses]}))


if __name__ == "__main__":
    _main(sys.argv[1])

"""A checkpoint written by the guard before its parts owned their state still restores.

``data/guard_ckpt_v2/`` holds a guarded run's checkpoint at step 30 (guard state version 2,
written by the code before issue 42's refactor; ``tests/_compat_checkpoint.py`` made it, with a
skip at step 26 so the counters are non-zero) and how that run went on from it on the same code.
Today's guard must restore it and go on identically: the same losses (bit for bit on the CPU
that recorded them; within 1e-5 elsewhere, where other kernels may round differently), the same
actions, the same counters.
"""

import json
import math
import shutil
from pathlib import Path

from . import _compat_checkpoint as compat

DATA = Path(__file__).parent / "data" / "guard_ckpt_v2"


def test_a_checkpoint_of_the_old_guard_restores_and_the_run_goes_on_as_it_did(tmp_path):
    want = json.loads((DATA / "continuation.json").read_text())["continued"]
    out = tmp_path / "run"
    shutil.copytree(DATA, out)
    (out / "continuation.json").unlink()
    got = compat.run(out, resume=True)
    assert sorted(got["losses"], key=int) == sorted(want["losses"], key=int)
    for step, hexed in want["losses"].items():
        a, b = float.fromhex(got["losses"][step]), float.fromhex(hexed)
        assert math.isclose(a, b, rel_tol=1e-5), f"step {step}: {a} != {b}"
    assert got["actions"] == want["actions"]
    assert got["actions"]["26"] == "skip"
    for key in ("applied", "withheld", "rollbacks", "records", "step_index"):
        assert got[key] == want[key], key
    assert got["withheld"] == 1

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def sub_env() -> dict[str, str]:
    """Environment for a subprocess that must import this checkout's spikeguard, not whichever
    copy pip installed editable."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    return env

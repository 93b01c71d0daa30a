import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff comes with the dev extra")
def test_ruff_clean():
    r = subprocess.run(["ruff", "check", "src", "tests", "benchmarks", "examples"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_public_modules_declare_all():
    missing = [p for p in (ROOT / "src" / "spikeguard").rglob("*.py")
               if not p.name.startswith("_") and "__all__" not in p.read_text()]
    assert not missing, f"public modules without __all__: {missing}"

"""Behaviour pinned by recordings made before a refactor: the same numbers bit for bit.

- ``data/train50_losses.json``: the per-step losses of ``spikeguard train --steps 50`` (default
  config, seed 0) as float.hex strings, one list per ATen CPU capability. Each is run in a
  process whose CPU code paths are pinned (``tests/_recorded_run.py``: ATen's kernel set, MKL's
  COMPATIBLE branch, oneDNN off, one thread), so the numbers do not depend on the CPU's vector
  extensions: an AVX-512 CPU runs the AVX2 kernels and must give the AVX2 list. CI runs the
  capability this CPU has (AVX2 on x86-64 since 2013); ``--full`` runs every recorded one.
- ``data/verdicts.json.gz``: every non-CONTINUE verdict of the detector on the streams of
  ``tests/verdict_streams.py`` (the worked scenarios and two 20,000-step random streams).

A change that moves these numbers on purpose re-records them and says why in its commit.
"""

import gzip
import json
from pathlib import Path

import pytest

from spikeguard.detector.detector import SpikeDetector

from . import _recorded_run
from .verdict_streams import streams, verdict_rows

DATA = Path(__file__).parent / "data"


LOSSES = json.loads((DATA / "train50_losses.json").read_text())["losses"]


@pytest.mark.slow
@pytest.mark.parametrize("capability", sorted(LOSSES))
def test_train_50_steps_losses_are_bit_identical_to_the_recording(capability, request, sub_env):
    if capability != _recorded_run.host_capability() and not request.config.getoption("faults_full"):
        pytest.skip(f"CI runs the {_recorded_run.host_capability()} recording; --full runs this one")
    used, got = _recorded_run.result(capability, sub_env)
    assert used == capability
    want = LOSSES[capability]
    assert len(got) == len(want) == _recorded_run.STEPS
    first = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), None)
    assert got == want, f"first difference at step {first}: {got[first]} != {want[first]}"


RECORDED = json.loads(gzip.open(DATA / "verdicts.json.gz", "rt").read())


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_detector_verdicts_equal_the_recording_step_for_step(name):
    metrics, config = streams()[name]
    assert len(metrics) == RECORDED[name]["n"]
    detector = SpikeDetector(config)
    got = verdict_rows(detector.update(m) for m in metrics)
    want = RECORDED[name]["rows"]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g == w, f"first difference at step {w[0]}"

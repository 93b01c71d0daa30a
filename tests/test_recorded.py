"""Behaviour pinned by recordings made before a refactor: the same numbers bit for bit.

- ``data/train50_losses.json``: the per-step losses of ``spikeguard train --steps 50`` (default
  config, seed 0) on one thread, as float.hex strings. Re-recorded when ``spikeguard train``
  moved onto the Guard and the token stream (QK-norm on by default, the guard's clipping).
- ``data/verdicts.json.gz``: every non-CONTINUE verdict of the detector on the streams of
  ``tests/verdict_streams.py`` (the worked scenarios and two 20,000-step random streams).

A change that moves these numbers on purpose re-records them and says why in its commit.
"""

import gzip
import json
from pathlib import Path

import pytest

from spikeguard.respond.detector import SpikeDetector

from .verdict_streams import streams, verdict_rows

DATA = Path(__file__).parent / "data"


def test_train_50_steps_losses_are_bit_identical_to_the_recording(one_thread, tmp_path):
    from spikeguard.train import TrainConfig, train

    want = [float.fromhex(h) for h in json.loads((DATA / "train50_losses.json").read_text())]
    cfg = TrainConfig(steps=50, seed=0, out=str(tmp_path), progress=False, plot=False)
    got = train(cfg, echo=False).losses
    assert len(got) == len(want) == 50
    assert got == want  # exact equality: float bits


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

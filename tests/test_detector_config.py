"""DetectorConfig: defaults, validation, the CLI options generated from it, and for_run."""

import argparse
import math

import numpy as np
import pytest

from spikeguard._config_cli import add_config_args, config_from_args, field_docs
from spikeguard.detector.detector import Action, DetectorConfig, SpikeDetector
from spikeguard.record import StepMetrics


def test_config_defaults_and_documented():
    c = DetectorConfig()
    assert (c.arm_after, c.median_window, c.grad_k, c.skip_ratio, c.alert_ratio,
            c.tier2_ratio, c.elevated_steps, c.log_z_rise, c.log_z_rise_steps,
            c.max_scaler_skips) == (50, 5000, 3.0, 2.0, 1.5, 2.5, 500, 3.0, 300, 10)
    docs = field_docs(DetectorConfig)
    assert set(docs) == set(c.to_dict()) and all(docs.values())
    # the CLI generator (diagnose's what-if options) renders and parses every field
    parser = argparse.ArgumentParser()
    add_config_args(parser, DetectorConfig)
    assert "--max-skip-fraction" in parser.format_help()
    args = parser.parse_args(["--grad-k", "5", "--vocab-size", "50257"])
    assert config_from_args(DetectorConfig, args) == DetectorConfig(grad_k=5.0, vocab_size=50257)


def test_for_run_shrinks_windows():
    c = DetectorConfig.for_run(400)
    assert (c.median_window, c.loss_ema_steps, c.recovery_steps, c.elevated_steps,
            c.recovery_ema_steps, c.log_z_rise_steps) == (100, 100, 100, 100, 50, 100)
    assert DetectorConfig.for_run(1_000_000) == DetectorConfig.for_run(20_000) == DetectorConfig()
    assert DetectorConfig.for_run(19_999) != DetectorConfig()
    assert DetectorConfig.for_run(400, grad_k=5.0).grad_k == 5.0
    with pytest.raises(ValueError, match="total_steps=2"):
        DetectorConfig.for_run(2)


def test_for_run_arms_after_a_tenth_of_the_run_between_10_and_50():
    steps = [4, 49, 50, 100, 130, 499, 500, 1_000_000]
    assert [DetectorConfig.for_run(n).arm_after for n in steps] == [5, 10, 10, 10, 13, 49, 50, 50]
    assert [DetectorConfig.for_run(n).arm_after for n in (9, 19, 20)] == [5, 9, 10]
    assert DetectorConfig.for_run(100, arm_after=30).arm_after == 30  # overrides win


def test_a_100_step_run_catches_an_outlier_soon_after_a_tenth_of_it():
    # noisy flat stream (grad norm 1.0 +- 10%): a short run's rules arm after a tenth of it
    # (arm_after=10). A 2x loss outlier at step 20 is caught there by the loss rules; a
    # grad-only 6x outlier waits for the grad rule's quiet arming (arm_quiet=20 quiet updates
    # from step 10: on from step 29), so it sits at step 40 (it sat at step 20 before the quiet
    # arming; until the rule is on a grad-only spike is not skipped, by design)
    assert DetectorConfig.for_run(100).arm_quiet == 20
    rng = np.random.default_rng(0)
    noise = [(0.01 * rng.standard_normal(), math.exp(0.1 * rng.standard_normal()))
             for _ in range(100)]
    for kind, at in (("loss", 20), ("grad", 40)):
        metrics = [StepMetrics(step=s, loss=(2.0 if kind == "loss" and s == at else 1.0)
                               * (2.4 + e), grad_norm=(6.0 if kind == "grad" and s == at
                                                       else 1.0) * g, log_z=7.0)
                   for s, (e, g) in enumerate(noise)]
        short = SpikeDetector(DetectorConfig.for_run(100))
        verdicts = [short.update(m) for m in metrics]
        assert [(v.step, v.action) for v in verdicts if v.action is not Action.CONTINUE] == \
            [(at, Action.SKIP)], kind
        # the defaults (arm_after=50) would let it through: half of this run is over before
        # they arm
        default = SpikeDetector()
        assert all(default.update(m).action is Action.CONTINUE for m in metrics), kind


@pytest.mark.parametrize("kwargs, match", [
    ({"median_window": 0}, "median_window=0"),
    ({"grad_k": 1.0}, "grad_k=1.0"),
    ({"skip_ratio": 3.0}, "skip_ratio"),
    ({"vocab_size": 1}, "vocab_size=1"),
    ({"max_skip_fraction": 1.5}, "max_skip_fraction=1.5"),
    ({"arm_after": 2.5}, "arm_after=2.5"),
    ({"elevated_z": -1.0}, r"elevated_z=-1.0 must be a number >= 0.*0: off"),
    ({"elevated_z": float("inf")}, "elevated_z=inf"),
])
def test_bad_config_names_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DetectorConfig(**kwargs)

"""The log Z jump's bar for a jump alone: the run's own healed excursions (LogZJump's tail).

A log Z that swings (SGD with momentum: healed bumps of most of a nat every dozen updates) is
judged against an exponential tail fitted to those bumps; a jump that comes with a second sign
(the grad norm past the joint test's grad bar) keeps the 1-nat bar; a run whose log Z does not
wander keeps it too.
The reference bar is computed here from the log Z series alone, in float64.
"""

from __future__ import annotations

import json
import math
import statistics

import pytest

import spikeguard as sg
from spikeguard.detector import DetectorConfig, SpikeDetector

REASON = "log_z > median of last 32 + 1"
BUMP = (0.4, 0.7, 0.9, 0.7, 0.4)
"""One healed swing of log Z above its level (nats), every 15 updates from step 40."""
LONE = 160
"""Where the test's jump comes: two updates 1.3 nats up."""


def _log_z(n: int = 200, swings: bool = True) -> list[float]:
    out = []
    for t in range(n):
        lz = 6.0 + 0.01 * math.sin(t)
        if swings and 40 <= t < 150 and (t - 40) % 15 < len(BUMP):
            lz += BUMP[(t - 40) % 15]
        if t in (LONE, LONE + 1):
            lz += 1.3
        out.append(lz)
    return out


def _metrics(log_z: list[float], grad_at: dict[int, float] | None = None) -> list:
    grad_at = grad_at or {}
    return [sg.StepMetrics(step=t, loss=2.4, grad_norm=grad_at.get(t, 1.0), log_z=z)
            for t, z in enumerate(log_z)]


def _pages(metrics: list, **config) -> list[int]:
    d = SpikeDetector(DetectorConfig.for_run(1000, arm_after=20, **config))
    return [v.step for v in (d.update(m) for m in metrics) if REASON in v.reasons]


def _reference_bar(log_z: list[float], t: int, u: float = 0.5, p: float = 1e-3,
                   heal: float = 0.2) -> float:
    """The bar at update t from the series alone: every update is kept (a flat loss and grad
    norm); deviations from the median of the 32 before; the exceedances of u in excursions
    that came back to within ``heal`` of the median (a deviation <= heal) before t; exponential
    tail u + beta ln(a / p), at least 1 nat."""
    devs = [log_z[s] - statistics.median(log_z[s - 32:s]) for s in range(32, t)]
    healed, current = [], []
    for d in devs:
        if d > u:
            current.append(d - u)
        elif d <= heal:
            healed += current
            current = []
    if len(healed) < 5:
        return 1.0
    a, beta = len(healed) / len(devs), sum(healed) / len(healed)
    return max(1.0, u + beta * math.log(a / p))


def test_a_lone_jump_in_a_swinging_log_z_is_judged_against_its_healed_swings():
    log_z = _log_z()
    bar = _reference_bar(log_z, LONE)
    dev = log_z[LONE] - statistics.median(log_z[LONE - 32:LONE])
    assert 1.0 < dev < bar  # past the 1-nat bar, inside the swings' own
    d = SpikeDetector(DetectorConfig.for_run(1000, arm_after=20))
    jump = d._rules["log_z_jump"]
    for m in _metrics(log_z)[:LONE]:
        d.update(m)
    assert jump.on and jump._lone_bar() == pytest.approx(bar, rel=1e-12)
    assert _pages(_metrics(log_z)) == []
    # the rule before (log_z_jump_rate=0): a page at the first update past 1 nat
    assert _pages(_metrics(log_z), log_z_jump_rate=0.0) == [LONE]
    # a second sign keeps the 1-nat bar: the grad norm twice its median, past the joint test's
    # grad bar (sqrt(3) x the median where the grad norm is quiet)
    assert _pages(_metrics(log_z, {LONE: 2.0})) == [LONE]
    # a log Z that never wandered has no tail: the same jump is paged at once
    assert _pages(_metrics(_log_z(swings=False))) == [LONE]


def test_swings_on_a_slow_rise_count_once_back_within_heal_of_the_median():
    """Under SGD log Z rises while it swings, and its short median lags: the swings come back
    to 0.01 nats above it, never to it. Counted once back within log_z_jump_heal (0.2) they
    are the run's noise and the lone jump is not paged; at 0 they never count, and it is."""
    lz = [z + 0.006 * (min(t, 150) - 40) * (t > 40) for t, z in enumerate(_log_z())]
    devs = [lz[t] - statistics.median(lz[t - 32:t]) for t in range(72, LONE)]
    assert 0 < min(devs) < 0.2
    assert _reference_bar(lz, LONE, heal=0.0) == 1.0 and _reference_bar(lz, LONE) > 1.3
    assert _pages(_metrics(lz)) == []
    assert _pages(_metrics(lz), log_z_jump_heal=0.0) == [LONE]
    with pytest.raises(ValueError, match="log_z_jump_heal"):
        DetectorConfig(log_z_jump_heal=-0.1)


@pytest.mark.parametrize("heal", [0.0, 0.2])
def test_a_drift_is_not_its_own_noise(heal):
    """An excursion counts only once log Z is back near its median (within log_z_jump_heal): a
    drift whose deviation dips under u and rises past it again (its median following behind)
    never widens its own bar, and is paged where the 1-nat bar pages it."""
    base = _log_z(swings=False)[:LONE]
    # 0.05 nats a step, with a 0.3-nat wobble of period 8: the deviation crosses u again and
    # again without coming back to the median, then crosses 1 nat
    drift = [z + 0.05 * max(0, t - 60) + 0.3 * math.sin(t * math.pi / 4) * (t > 60)
             for t, z in enumerate(base)]
    devs = [drift[t] - statistics.median(drift[t - 32:t]) for t in range(32, LONE)]
    crossings = sum(a <= 0.5 < b for a, b in zip(devs, devs[1:]))
    assert crossings >= 3 and _reference_bar(drift, LONE, heal=heal) == 1.0
    assert (_pages(_metrics(drift), log_z_jump_heal=heal)
            == _pages(_metrics(drift), log_z_jump_rate=0.0) != [])


def test_the_tail_resumes_and_a_state_saved_before_it_loads():
    log_z = _log_z()
    metrics = _metrics(log_z)
    for c in (DetectorConfig.for_run(1000, arm_after=20),
              DetectorConfig.for_run(1000, arm_after=20, log_z_jump_rate=0.0)):
        straight = SpikeDetector(c)
        want = [(v.step, v.tier, v.reasons) for v in (straight.update(m) for m in metrics)]
        # the rule before pages the lone jump; the tail does not
        assert any(REASON in r for _, _, r in want) == (c.log_z_jump_rate == 0.0)
        for cut in (62, 102):  # between two swings, and inside one
            d = SpikeDetector(c)
            for m in metrics[:cut]:
                d.update(m)
            resumed = SpikeDetector(c)
            resumed.load_state_dict(json.loads(json.dumps(d.state_dict())))
            assert [(v.step, v.tier, v.reasons) for v in (resumed.update(m)
                                                          for m in metrics[cut:])] == want[cut:]
    d = SpikeDetector(DetectorConfig.for_run(1000, arm_after=20))
    for m in metrics[:LONE]:
        d.update(m)
    old = json.loads(json.dumps(d.state_dict()))
    del old["rules"]["log_z_jump"]["tail"]
    before = SpikeDetector(DetectorConfig.for_run(1000, arm_after=20))
    before.load_state_dict(old)
    assert before.state_dict()["rules"]["log_z_jump"]["tail"] == [0, 0, 0.0, 0, 0.0]


@pytest.mark.parametrize("bad", [-1e-3, 0.01, math.nan, True, "1e-3"])
def test_a_bad_rate_is_refused(bad):
    with pytest.raises(ValueError, match=r"log_z_jump_rate=.*\[0, 0.01\)"):
        DetectorConfig(log_z_jump_rate=bad)

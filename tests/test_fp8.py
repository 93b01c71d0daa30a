"""AmaxMonitor on non-finite amaxes: a NaN or inf amax is zero headroom, an event and a warning."""

import math

import pytest
import torch

from spikeguard.measure.fp8 import AmaxMonitor, Fp8HeadroomWarning


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nonfinite_amax_is_zero_headroom_an_event_and_a_warning(bad):
    mon = AmaxMonitor()
    assert math.isinf(mon.update(0, "fc", 1.0))
    assert mon.update(1, "fc", 1.2) == pytest.approx(1.0 / 1.2)
    with pytest.warns(Fp8HeadroomWarning, match="non-finite") as record:
        headroom = mon.update(2, "fc", bad)
    assert headroom == 0.0 and len(record) == 1
    assert "step 2" in str(record[0].message) and "fc" in str(record[0].message)
    (event,) = mon.events
    assert (event.step, event.name, event.headroom, event.history_max) == (2, "fc", 0.0, 1.2)
    assert math.isnan(event.amax) if math.isnan(bad) else event.amax == bad
    assert mon.last["fc"]["headroom"] == 0.0
    assert mon.scale("fc") == 448.0 / 1.2  # the bad value stays out of the history
    assert mon.update(3, "fc", 1.1) == pytest.approx(1.2 / 1.1)  # and later steps are normal
    assert len(mon.events) == 1


def test_nonfinite_amax_on_the_first_step_is_an_event_too():
    mon = AmaxMonitor()
    with pytest.warns(Fp8HeadroomWarning, match="non-finite"):
        assert mon.update(0, "fc", math.nan) == 0.0
    assert len(mon.events) == 1 and math.isnan(mon.events[0].history_max)
    assert mon.scale("fc") == 1.0  # still no history


def test_flush_reports_zero_headroom_for_a_nan_input():
    lin = torch.nn.Sequential()
    lin.add_module("fc", torch.nn.Linear(16, 16))
    mon = AmaxMonitor()
    mon.hook(lin)
    lin(torch.ones(2, 16))
    assert math.isinf(mon.flush(0)["fp8_headroom_min"])
    x = torch.ones(2, 16)
    x[1, 3] = math.nan
    lin(x)
    with pytest.warns(Fp8HeadroomWarning, match="fc: amax is nan"):
        rec = mon.flush(1)
    assert rec["fp8_headroom_min"] == 0.0
    assert [e.step for e in mon.events] == [1]

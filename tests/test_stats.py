"""Running median and EMA: host and device versions against brute force, with flagged steps."""

import json
import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spikeguard.measure.spread import LogSpread, PyLogSpread, PySpread, Spread
from spikeguard.measure.stats import (
    COMPILED,
    EMA,
    DeviceEMA,
    DeviceRunningMedian,
    EventWindow,
    PyEMA,
    PyRunningMedian,
    PySlidingMin,
    RunningMedian,
    SlidingMin,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# values with many ties (a few small integers) mixed with arbitrary finite floats
values = st.one_of(st.sampled_from([0.0, 1.0, 2.0, 3.0]),
                   st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False))
streams = st.lists(st.tuples(values, st.booleans()), max_size=150)


def brute_ema(kept: list[float], alpha: float) -> float:
    """Bias-corrected EMA from its closed form: sum_j a (1-a)^(n-1-j) x_j / (1 - (1-a)^n)."""
    n = len(kept)
    if n == 0:
        return math.nan
    num = math.fsum(alpha * (1 - alpha) ** (n - 1 - j) * x for j, x in enumerate(kept))
    return num / (1 - (1 - alpha) ** n)


@settings(max_examples=60, deadline=None)
@given(window=st.integers(1, 12), stream=streams, k=st.sampled_from([1.0, 3.0]))
def test_running_median_matches_brute_force_host_and_device(window, stream, k):
    host, dev = RunningMedian(window), DeviceRunningMedian(window)
    kept: list[float] = []
    for x, flagged in stream:
        # the gate's rule reads the history before the step joins it
        expect = len(kept) > 0 and x > k * statistics.median(kept[-window:])
        assert bool(dev.exceeds(x, k)) == expect
        dev.update(x, torch.tensor(flagged))
        if not flagged:
            host.update(x)
            kept.append(x)
        want = statistics.median(kept[-window:]) if kept else math.nan
        got_host, got_dev = host.value, dev.value.item()
        assert got_host == want or (math.isnan(want) and math.isnan(got_host))
        assert got_dev == got_host or (math.isnan(got_dev) and math.isnan(got_host))
        assert int(dev.count) == len(host) == min(len(kept), window)
    assert host.values() == dev.values() == kept[-window:]


@settings(max_examples=40, deadline=None)
@given(window=st.sampled_from([1, 2, 5, 32, 257]), seed=st.integers(0, 2**32 - 1),
       ties=st.booleans())
def test_compiled_median_equals_sorted_list_past_the_window(window, seed, ties):
    """The compiled median (two heaps over a ring) against the pure-Python sorted list, over
    streams several windows long, so that every value leaves as well as enters: equal values
    (not merely close), the same window oldest first, and either's state loads into the other."""
    import random

    rng = random.Random(seed)
    fast, slow = RunningMedian(window), PyRunningMedian(window)
    for _ in range(4 * window + 50):
        x = float(rng.randrange(4)) if ties else rng.lognormvariate(0.0, 2.0)
        fast.update(x)
        slow.update(x)
        assert fast.value == slow.value
        assert fast.value == statistics.median(slow.values())
    assert fast.values() == slow.values() and len(fast) == len(slow) == window
    other = PyRunningMedian(window)
    other.load_state_dict(fast.state_dict())
    back = RunningMedian(window)
    back.load_state_dict(slow.state_dict())
    for _ in range(window + 3):
        x = rng.random()
        for m in (fast, slow, other, back):
            m.update(x)
        assert fast.value == slow.value == other.value == back.value


@settings(max_examples=30, deadline=None)
@given(window=st.sampled_from([1, 3, 16, 101]), seed=st.integers(0, 2**32 - 1))
def test_compiled_ema_spread_and_min_equal_their_python_twins(window, seed):
    """EMA, Spread (of values and of logs) and SlidingMin, compiled and pure Python, on one
    stream with NaNs, zeros and negatives where each takes them: equal numbers, equal states,
    and each one's state continues in the other."""
    import random

    rng = random.Random(seed)
    pairs = [(EMA(1.0 / window), PyEMA(1.0 / window)), (Spread(window), PySpread(window)),
             (LogSpread(window), PyLogSpread(window)),
             (SlidingMin(window), PySlidingMin(window))]

    def feed(i, x, pair):
        a, b = pair
        if isinstance(b, PyEMA):
            if x == x:
                a.update(x), b.update(x)
            return a.value, b.value
        if isinstance(b, PySpread):
            a.add(x), b.add(x)
            return (a.value, a.last, len(a)), (b.value, b.last, len(b))
        got = a.min_before(i), b.min_before(i)
        a.push(i, x, 10 * i), b.push(i, x, 10 * i)
        return got

    def same(u, v):
        return u == v or repr(u) == repr(v)  # NaN == NaN by its text

    for i in range(5 * window + 20):
        x = rng.choice([rng.gauss(0.0, 3.0), rng.random(), 0.0, math.nan, 2.0])
        for pair in pairs:
            u, v = feed(i, x, pair)
            assert same(u, v), (type(pair[0]).__name__, i, x, u, v)
    for k, (a, b) in enumerate(pairs):
        assert a.state_dict() == b.state_dict() or repr(a.state_dict()) == repr(b.state_dict())
        arg = 1.0 / window if isinstance(b, PyEMA) else window
        a2, b2 = type(a)(arg), type(b)(arg)
        a2.load_state_dict(json.loads(json.dumps(b.state_dict())))  # each continues the other
        b2.load_state_dict(json.loads(json.dumps(a.state_dict())))
        pairs[k] = (a2, b2)
    for i in range(5 * window + 20, 6 * window + 40):
        x = rng.gauss(1.0, 1.0)
        for pair in pairs:
            u, v = feed(i, x, pair)
            assert same(u, v)


@pytest.mark.skipif(not COMPILED, reason="the compiled statistics were not built here (no C "
                    "compiler at install time): the Py twins are in use")
def test_host_statistics_are_compiled_where_built_and_pickle():
    import copy
    import pickle

    from spikeguard.measure import _cstats

    m = RunningMedian(3)
    assert isinstance(m, _cstats.SlidingMedian)
    assert isinstance(EMA(0.5), _cstats.BiasCorrectedEMA)
    assert isinstance(Spread(4), _cstats.SlidingSpread)
    assert isinstance(SlidingMin(4), _cstats.SlidingMinimum)
    for x in (5.0, 1.0, 4.0, 2.0):
        m.update(x)
    assert m.value == 2.0 and m.values() == [1.0, 4.0, 2.0]
    with pytest.raises(AttributeError):
        m.value = 0.0  # read-only: only update moves it
    with pytest.raises(ValueError, match=r"RunningMedian.update\(inf\): only finite"):
        m.update(math.inf)
    with pytest.raises(ValueError, match=r"EMA.update\(nan\): only finite"):
        EMA(0.5).update(math.nan)
    with pytest.raises(ValueError, match=r"alpha=0.0 must be in \(0, 1\]"):
        EMA(0.0)
    assert m.values() == [1.0, 4.0, 2.0]  # a refused value leaves the window as it was
    ema, spread, low = EMA(0.5), LogSpread(8), SlidingMin(4)
    for i, x in enumerate((3.0, 1.0, 7.0)):
        ema.update(x), spread.add(x), low.push(i, x, i)
    for stat in (m, ema, spread, low):
        for twin in (pickle.loads(pickle.dumps(stat)), copy.deepcopy(stat)):
            assert type(twin) is type(stat) and twin.state_dict() == stat.state_dict()
    assert pickle.loads(pickle.dumps(ema)).value == ema.value


@settings(max_examples=60, deadline=None)
@given(alpha=st.sampled_from([1e-3, 0.01, 0.3, 1.0]), stream=streams)
def test_ema_matches_brute_force_host_and_device(alpha, stream):
    host, dev = EMA(alpha), DeviceEMA(alpha)
    kept: list[float] = []
    for x, flagged in stream:
        # the ratio at step t divides by EMA_{t-1}, the value before this step's update
        prev, ratio = host.value, dev.ratio(x).item()
        if not kept:
            assert math.isnan(ratio)
        elif prev != 0:
            assert ratio == x / prev
        dev.update(x, flagged)
        if not flagged:
            host.update(x)
            kept.append(x)
        want = brute_ema(kept, alpha)
        scale = max((abs(v) for v in kept), default=1.0)
        assert host.value == pytest.approx(want, rel=1e-9, abs=1e-9 * scale, nan_ok=True)
        d = dev.value.item()
        assert d == host.value or (math.isnan(d) and math.isnan(host.value))
        assert int(dev.count) == host.count == len(kept)


def test_ema_seed_alpha_and_bias_correction():
    # alpha = 1/1000: after one update the corrected EMA is the value itself, not 1/1000 of it
    ema = EMA()
    ema.update(2.41)
    assert ema.value == pytest.approx(2.41, rel=1e-15)
    for _ in range(999):
        ema.update(2.41)
    assert ema.value == pytest.approx(2.41, rel=1e-12)
    assert 2.89 / ema.value == pytest.approx(1.1992, abs=1e-4)  # the worked scenario 1 ratio


@pytest.mark.parametrize("device", DEVICES)
def test_device_versions_skip_nonfinite_values(device):
    dev, ema = DeviceRunningMedian(4, device=device), DeviceEMA(0.5, device=device)
    host, hema = RunningMedian(4), EMA(0.5)
    for x in [1.0, math.nan, 5.0, math.inf, -math.inf, 3.0, 2.0, 7.0]:
        kept_m, kept_e = dev.update(x), ema.update(torch.tensor(x, dtype=torch.float32))
        assert bool(kept_m) == bool(kept_e) == math.isfinite(x)
        if math.isfinite(x):
            host.update(x)
            hema.update(x)
    assert dev.values() == host.values() == [5.0, 3.0, 2.0, 7.0]
    assert dev.value.item() == host.value == 4.0
    assert ema.value.item() == hema.value


@pytest.mark.parametrize("device", DEVICES)
def test_device_float32_inputs_equal_host_floats(device):
    """A float32 loss on the device and its host float() give the same history."""
    gen = torch.Generator().manual_seed(0)
    xs = torch.rand(300, generator=gen) * 3 + 1
    dev, ema = DeviceRunningMedian(50, device=device), DeviceEMA(1e-3, device=device)
    host, hema = RunningMedian(50), EMA(1e-3)
    for x in xs:
        flagged = dev.exceeds(x.to(device), 1.5)
        dev.update(x.to(device), flagged)
        ema.update(x.to(device), flagged)
        if not x.item() > 1.5 * host.value:
            host.update(x.item())
            hema.update(x.item())
        assert dev.value.item() == host.value and ema.value.item() == hema.value


def test_device_versions_never_read_a_value_to_the_host(monkeypatch):
    """Every way Python reads a tensor's value (.item, bool, float, int, index, tolist, numpy)
    raises inside the gate's calls: they only queue device kernels. (CUDA's own check, with
    torch.cuda.set_sync_debug_mode, is in benchmarks/gpu_check.py.)"""
    med, ema = DeviceRunningMedian(8), DeviceEMA()
    xs = [torch.tensor(v, dtype=torch.float64) for v in (1.0, 1.2, 9.0, math.nan, 1.1)]

    def host_read(*args, **kwargs):
        raise AssertionError("a device value was read on the host")

    for name in ("item", "__bool__", "__float__", "__int__", "__index__", "tolist", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, host_read)
    spikes = []
    for x in xs:
        spike = med.exceeds(x, 3.0) | (ema.ratio(x) > 2.0)
        med.update(x, spike)
        ema.update(x, spike)
        spikes.append(spike)
    median, average = med.value, ema.value
    with pytest.raises(AssertionError, match="read on the host"):
        bool(spikes[2])  # the instrument works
    monkeypatch.undo()
    assert [bool(s) for s in spikes] == [False, False, True, False, False]
    host = EMA()
    for v in (1.0, 1.2, 1.1):  # 9.0 was flagged, NaN is never kept
        host.update(v)
    assert median.item() == 1.1 and average.item() == host.value


@settings(max_examples=40, deadline=None)
@given(window=st.integers(1, 10), stream=st.lists(values, min_size=1, max_size=80),
       cut=st.integers(0, 80), cross=st.booleans())
def test_state_round_trip_equals_never_stopping(window, stream, cut, cross):
    """Stop after `cut` values, save through JSON, load into a fresh object (of the other kind
    when `cross`: host and device state dicts are interchangeable), continue."""
    cut = min(cut, len(stream))
    kinds = [(lambda: RunningMedian(window), lambda: DeviceRunningMedian(window)),
             (lambda: EMA(0.2), lambda: DeviceEMA(0.5))]
    for make, make_twin in kinds:
        whole, first = make(), make()
        for x in stream:
            whole.update(x)
        for x in stream[:cut]:
            first.update(x)
        state = json.loads(json.dumps(first.state_dict()))
        # a fresh object (a median with the same window: another one is refused; an EMA with
        # another alpha): everything else must come from the state dict
        second = make_twin() if cross else type(first)(*([window] if hasattr(first, "window")
                                                          else [0.5]))
        second.load_state_dict(state)
        for x in stream[cut:]:
            second.update(x)
        got, want = float(second.value), whole.value
        assert got == want or (math.isnan(got) and math.isnan(want))
        if isinstance(whole, RunningMedian):
            assert second.values() == whole.values()
        else:
            assert int(second.count) == whole.count


def test_old_ema_state_without_decay_loads():
    ema = EMA(0.1)
    for x in (1.0, 2.0, 3.0):
        ema.update(x)
    state = ema.state_dict()
    del state["decay"]
    for cls in (EMA, DeviceEMA):
        other = cls(0.1)
        other.load_state_dict(state)
        assert float(other.value) == pytest.approx(ema.value, rel=1e-15)


@pytest.mark.parametrize("make", [RunningMedian, DeviceRunningMedian, SlidingMin, EventWindow])
def test_load_refuses_another_window_and_names_both(make):
    saved = make(5)
    for i in range(8):
        if make is SlidingMin:
            saved.push(i, float(i), i)
        elif make is EventWindow:
            saved.add(i, i)
        else:
            saved.update(float(i))
    state = json.loads(json.dumps(saved.state_dict()))
    other = make(50)
    before = json.dumps(other.state_dict())
    with pytest.raises(ValueError, match=rf"{make.__name__} state has window=5 .*window=50"):
        other.load_state_dict(state)
    assert json.dumps(other.state_dict()) == before and other.window == 50
    same = make(5)
    same.load_state_dict(state)
    assert same.state_dict() == saved.state_dict()
    if make in (RunningMedian, DeviceRunningMedian):  # the two kinds still load each other's
        twin = {RunningMedian: DeviceRunningMedian, DeviceRunningMedian: RunningMedian}[make](5)
        twin.load_state_dict(state)
        assert twin.values() == saved.values() == [3.0, 4.0, 5.0, 6.0, 7.0]


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="window=0"):
        DeviceRunningMedian(0)
    with pytest.raises(ValueError, match="alpha=0"):
        DeviceEMA(0.0)

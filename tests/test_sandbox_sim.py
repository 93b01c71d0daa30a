"""The sandbox's simulations in plain Python (no server, no browser): the loss-spike model's
properties over 20 seeds, its first steps against the documented formulas, and the clipping
widget against torch's own clip_grad_norm_."""

import functools
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from spikeguard.sandbox import ClipPictureConfig, SimConfig, clipping_picture
from spikeguard.sandbox import simulate as _simulate
from spikeguard.sandbox.clipping import OUTLIER_RATE, step_norm
from spikeguard.sandbox.simulation import FLOAT32_MAX, MODEL

SEEDS = range(20)
BASE = SimConfig()  # every defense off, the page's defaults

simulate = functools.lru_cache(maxsize=None)(_simulate)
"""Runs are deterministic per config, so the tests share them (the configs are frozen)."""


def nan_steps(cfg: SimConfig) -> list[int]:
    """Per seed: the NaN step, or the run length for a run that survived."""
    out = []
    for s in SEEDS:
        r = simulate(replace(cfg, seed=s))
        out.append(cfg.steps if r.survived else r.nan_step)
    return out


def survivors(cfg: SimConfig) -> int:
    return sum(simulate(replace(cfg, seed=s)).survived for s in SEEDS)


@pytest.mark.parametrize("field,ladder", [("peak_lr", (0.04, 0.07, 0.1, 0.14, 0.2)),
                                          ("spike_size", (2.0, 3.5, 5.0, 8.0, 12.0))])
def test_nan_step_comes_earlier_as_lr_or_spike_size_rises(field, ladder):
    rows = [nan_steps(replace(BASE, **{field: v})) for v in ladder]
    for s, per_seed in zip(SEEDS, zip(*rows)):
        assert all(a >= b for a, b in zip(per_seed, per_seed[1:])), (field, s, per_seed)
    totals = [sum(r) for r in rows]
    assert all(a > b for a, b in zip(totals, totals[1:])), (field, totals)
    assert rows[0].count(BASE.steps) > rows[-1].count(BASE.steps)


def test_clipping_raises_the_share_of_runs_that_survive():
    off, on = survivors(BASE), survivors(replace(BASE, clip=True))
    assert on > off, (off, on)
    assert off < len(SEEDS)


def test_warmup_raises_the_share_of_runs_that_survive():
    off, on = survivors(BASE), survivors(replace(BASE, warmup=True))
    assert on > off, (off, on)


def test_z_loss_keeps_the_logit_scale_down_and_raises_survival_with_warmup():
    warm = replace(BASE, warmup=True)
    assert survivors(replace(warm, z_loss=True)) > survivors(warm)
    # on runs that survive either way, z-loss keeps the gradient multiplier smaller
    both = [s for s in SEEDS if simulate(replace(warm, seed=s)).survived]
    assert both
    for s in both:
        plain = max(simulate(replace(warm, seed=s)).logit_scale)
        pulled = max(simulate(replace(warm, seed=s, z_loss=True)).logit_scale)
        assert pulled <= plain, s


def test_deterministic_per_seed_and_seeds_differ():
    a, b = _simulate(replace(BASE, seed=3)), _simulate(replace(BASE, seed=3))
    assert a.loss == b.loss and a.nan_step == b.nan_step and a.spikes == b.spikes
    assert simulate(replace(BASE, seed=4)).loss[:50] != a.loss[:50]
    # the outlier positions do not depend on the defenses or the LR (same draws)
    assert simulate(replace(BASE, seed=3, clip=True, peak_lr=0.05)).spikes[: len(a.spikes)] \
        == a.spikes


def test_first_steps_follow_the_documented_model():
    """The steps up to a few past the first outlier, recomputed from the module docstring's
    formulas and its stated draw order."""
    cfg = replace(BASE, seed=7, clip=True, clip_c=0.5, warmup=True, warmup_steps=400)
    r = simulate(cfg)
    m = MODEL
    rng = np.random.default_rng(7)
    noise = rng.standard_normal(cfg.steps)
    hit = rng.random(cfg.steps) < cfg.spike_rate
    tail = (1 - rng.random(cfg.steps)) ** (-1 / m["ALPHA"])
    sign = np.where(rng.random(cfg.steps) < 0.5, -1.0, 1.0)
    batch = rng.standard_normal(cfg.steps)
    w, z = m["W0"], 0.0
    first = int(np.flatnonzero(hit)[0])
    assert 0 < first < 2000
    for t in range(first + 5):
        s = 1 + m["S0"] * math.exp(-t / m["TAU"])
        floor = 2.0 + 8.8 * (1 + t / 100) ** -0.35
        outlier = cfg.spike_size * tail[t] * sign[t] if hit[t] else 0.0
        loss = floor + math.exp(z) * s * (m["H"] * w**2 / 2 + m["K"] * w**4 / 4) \
            + 0.05 * abs(outlier) + 0.02 * batch[t]
        kick = m["SIGMA"] * noise[t] + outlier
        g = math.exp(z) * (s * (m["H"] * w + m["K"] * w**3) + kick)
        assert r.loss[t] == pytest.approx(loss, rel=1e-12)
        assert r.grad_norm[t] == pytest.approx(abs(g), rel=1e-12)
        lr = cfg.peak_lr * min(1.0, (t + 1) / cfg.warmup_steps) if t < cfg.warmup_steps else \
            cfg.peak_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(
                math.pi * (t - cfg.warmup_steps) / (cfg.steps - cfg.warmup_steps))))
        assert r.lr[t] == pytest.approx(lr, rel=1e-12)
        if abs(g) > cfg.clip_c:
            g *= cfg.clip_c / abs(g)
        w -= lr * g
        z = (z + m["BETA"] * max(0.0, abs(lr * g) - m["D0"]))
    assert r.spikes[0] == first and r.loss[first] - r.loss[first - 1] > 0.04 * cfg.spike_size


@pytest.mark.parametrize("warmup", [False, True])
def test_vectorised_lr_equals_the_library_schedule(warmup):
    from spikeguard.sandbox.simulation import lr_schedule
    from spikeguard.schedules import warmup_cosine

    cfg = replace(BASE, warmup=warmup, warmup_steps=700, steps=5000, peak_lr=0.13)
    sched = warmup_cosine(warmup_steps=700 if warmup else 0, total_steps=5000,
                          min_ratio=MODEL["MIN_RATIO"])
    want = [0.13 * sched(t) for t in range(5000)]
    np.testing.assert_allclose(lr_schedule(cfg), want, rtol=1e-14, atol=0)


def test_lr_schedule_worked_numbers():
    n, peak = 10_000, 0.1
    r = simulate(replace(BASE, clip=True, warmup=True))
    assert r.lr[0] == pytest.approx(peak / 1000)
    assert r.lr[999] == pytest.approx(peak)
    mid = 1000 + (n - 1000) // 2
    assert r.lr[mid] == pytest.approx(peak * (0.1 + 0.9 * 0.5), rel=1e-3)
    assert r.lr[-1] == pytest.approx(peak * 0.1, rel=1e-3)
    r0 = simulate(replace(BASE, clip=True))
    assert r0.lr[0] == pytest.approx(peak)


def test_a_nan_run_stops_at_float32_overflow():
    r = simulate(BASE)
    assert not r.survived and len(r.loss) == r.nan_step
    assert r.final_loss is None
    assert max(r.loss) <= FLOAT32_MAX and max(r.grad_norm) <= FLOAT32_MAX
    assert np.isfinite(np.asarray(r.loss, dtype=np.float32)).all()
    js = r.to_json()
    assert js["survived"] is False and js["nan_step"] == r.nan_step and js["final_loss"] is None
    survived = simulate(replace(BASE, clip=True))
    assert survived.survived and len(survived.loss) == BASE.steps
    assert survived.steps_clipped == sum(g > 1.0 for g in survived.grad_norm)
    assert survived.final_loss == survived.loss[-1] < 5.0


@pytest.mark.parametrize("kwargs,name", [
    ({"peak_lr": 0.0}, "peak_lr"), ({"peak_lr": 2.0}, "peak_lr"),
    ({"peak_lr": float("nan")}, "peak_lr"), ({"spike_rate": 0.5}, "spike_rate"),
    ({"spike_size": -1.0}, "spike_size"), ({"clip_c": 0.0}, "clip_c"),
    ({"steps": 10}, "steps"), ({"steps": 10**6}, "steps"), ({"seed": -1}, "seed"),
    ({"warmup_steps": 10_000}, "warmup_steps"), ({"clip": "yes"}, "clip"),
])
def test_bad_config_names_the_field(kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name}="):
        SimConfig(**kwargs)


# ---- widget 2: clipping as a collective ----

def test_outliers_come_from_the_step_index():
    a = clipping_picture(ClipPictureConfig(start=0, steps=100))
    b = clipping_picture(ClipPictureConfig(start=40, steps=100, c=3.0, ranks=7))
    assert a["norm"][40:] == b["norm"][:60]
    share = sum(step_norm(i) > 0.8 for i in range(20_000)) / 20_000
    assert abs(share - OUTLIER_RATE) < 0.01
    assert all(0.5 <= step_norm(i) <= 0.8 * 8.0 for i in range(5000))


def test_bars_above_c_are_capped_and_below_pass():
    p = clipping_picture(ClipPictureConfig(c=1.0))
    above = [i for i, n in enumerate(p["norm"]) if n > 1.0]
    assert above and p["clipped"] == len(above)
    for i, n in enumerate(p["norm"]):
        assert p["kept"][i] == min(n, 1.0)
        assert p["shaved"][i] == pytest.approx(n - min(n, 1.0), abs=1e-15)
    assert p["norm"][p["selected"]] == max(p["norm"])


@pytest.mark.parametrize("local", [False, True])
def test_scales_match_torch_clip_grad_norm(local):
    """Global: one clip_grad_norm_ over every shard. Local (the bug): one call per shard."""
    cfg = ClipPictureConfig(c=1.0, ranks=4, steps=60, local=local)
    p = clipping_picture(cfg)
    gen = torch.Generator().manual_seed(0)
    for i in range(cfg.steps):
        shards = []
        for g_r in p["rank_norm"][i]:
            v = torch.randn(50, generator=gen, dtype=torch.float64)
            shards.append(torch.nn.Parameter(torch.zeros(50, dtype=torch.float64)))
            shards[-1].grad = v * (g_r / v.norm())
        total = torch.cat([s.grad for s in shards]).norm().item()
        assert total == pytest.approx(p["norm"][i], rel=1e-12)
        if local:
            for s in shards:
                torch.nn.utils.clip_grad_norm_([s], cfg.c)
        else:
            torch.nn.utils.clip_grad_norm_(shards, cfg.c)
        for s, g_r, f in zip(shards, p["rank_norm"][i], p["scale"][i]):
            assert s.grad.norm().item() == pytest.approx(f * g_r, rel=1e-5)
        after = torch.cat([s.grad for s in shards]).norm().item()
        assert after == pytest.approx(p["update_norm"][i], rel=1e-5)
    outlier = p["selected"]
    spread = max(p["scale"][outlier]) / min(p["scale"][outlier])
    assert (spread > 1.5) if local else spread == 1.0
    if local:  # the update escapes the threshold
        assert p["update_norm"][outlier] > cfg.c * 1.05


def test_bad_clip_config_names_the_field():
    for kwargs, name in [({"c": 0}, "c"), ({"ranks": 1}, "ranks"), ({"ranks": 64}, "ranks"),
                         ({"steps": 5000}, "steps"), ({"local": 1}, "local")]:
        with pytest.raises(ValueError, match=rf"^{name}="):
            ClipPictureConfig(**kwargs)

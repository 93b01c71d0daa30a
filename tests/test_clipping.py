"""Adaptive clipping (prevent/clipping.py) against float64 references and its state (sharded:
tests/test_signals.py runs it in the same 2-rank spawn as the signals)."""

import json
import math

import pytest
import torch

import spikeguard as sg
from spikeguard.measure.gradnorm import grad_stats
from spikeguard.prevent.clipping import ClipConfig, Clipper


def _params(seed, n=3, scale=None):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(4, 5, generator=g)) for _ in range(n)]
    for i, p in enumerate(ps):
        s = 1.0 if scale is None else scale[i]
        p.grad = torch.randn(4, 5, generator=g) * s
    return ps


def _stream(steps=12, spike_at=9):
    """Per step, per tensor, the gradient's scale: steady, then one tensor spikes."""
    return [[1.0, 0.5 + 0.01 * t, 2.0] if t != spike_at else [30.0, 0.5, 2.0]
            for t in range(steps)]


def _zscore_ref(norms, cfg, max_norm):
    """float64 ZClip: warmup mean/var, then EMA of the clipped norm; returns coefficients."""
    n, mean, var, out = 0, 0.0, 0.0, []
    for x in norms:
        coef = 1.0
        if n >= cfg.warmup:
            thr = mean + cfg.zscore_z * math.sqrt(max(var, 0.0))
            if x > thr:
                coef = thr / (x + 1e-6)
        if max_norm is not None:
            coef = min(coef, max_norm / (x + 1e-6), 1.0)
        c = x * coef
        a = cfg.zscore_alpha if n >= cfg.warmup else n / (n + 1)
        d = c - mean
        mean, var, n = mean + (1 - a) * d, a * (var + (1 - a) * d * d), n + 1
        out.append(coef)
    return out


def test_zscore_clips_a_spike_as_the_float64_rule_does():
    cfg = ClipConfig(clip_mode="zscore", warmup=5)
    clipper, coefs, norms = None, [], []
    for t, scale in enumerate(_stream()):
        ps = _params(t, scale=scale)
        clipper = clipper or Clipper(cfg, 50.0, ps)
        clipper.params = ps
        stats = grad_stats(ps)
        before = [p.grad.clone() for p in ps]
        norms.append(float(stats.norm))
        coef = clipper.clip_(stats, torch.optim.SGD(ps, lr=0.1), torch.zeros((), dtype=torch.bool))
        coefs.append(float(coef))
        for p, b in zip(ps, before):
            torch.testing.assert_close(p.grad, b * coef)
    ref = _zscore_ref(norms, cfg, 50.0)
    assert coefs == pytest.approx(ref, rel=1e-5)
    assert coefs[9] < 0.2 and all(c == 1.0 for c in coefs[:9])


def test_adagc_clips_the_spiking_tensor_only():
    cfg = ClipConfig(clip_mode="adagc", warmup=4)
    gamma, n = [0.0, 0.0, 0.0], 0
    clipper = None
    for t, scale in enumerate(_stream()):
        ps = _params(t, scale=scale)
        clipper = clipper or Clipper(cfg, None, ps)
        clipper.params = ps
        raw = [p.grad.double().clone() for p in ps]
        stats = grad_stats(ps, per_tensor=True)
        clipper.clip_(stats, torch.optim.SGD(ps, lr=0.1), torch.zeros((), dtype=torch.bool))
        for i, (p, g) in enumerate(zip(ps, raw)):  # the float64 rule, tensor by tensor
            norm = float(g.norm())
            s = 1.0
            if n >= cfg.warmup and gamma[i] > 0 and norm > cfg.adagc_lambda * gamma[i]:
                s = cfg.adagc_lambda * gamma[i] / (norm + 1e-6)
            torch.testing.assert_close(p.grad.double(), g * s, rtol=1e-5, atol=1e-7)
            a = cfg.adagc_beta if n >= cfg.warmup else n / (n + 1)
            gamma[i] = a * gamma[i] + (1 - a) * s * norm
            if t == 9:
                assert (s < 0.1) == (i == 0)
        n += 1


def test_spam_cuts_spiking_elements_and_resets_their_moments():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(50))
    opt = torch.optim.AdamW([p], lr=1e-2, betas=(0.9, 0.95))
    for _ in range(20):
        p.grad = torch.randn(50) * 0.1
        opt.step()
    g = torch.randn(50) * 0.01
    g[[3, 17]] = 100.0
    for skip in (True, False):
        p.grad = g.clone()
        m0, v0 = (opt.state[p][k].clone() for k in ("exp_avg", "exp_avg_sq"))
        stats = grad_stats([p])
        Clipper(ClipConfig(clip_mode="spam"), None, [p]).clip_(stats, opt, torch.tensor(skip))
        limit = (5000.0 * v0.double()).sqrt()
        fired = g.double().abs() > limit
        assert fired.sum() == 2 and fired[3] and fired[17]
        ref = torch.where(fired, limit.copysign(g.double()), g.double())
        torch.testing.assert_close(p.grad.double(), ref, rtol=1e-6, atol=0)
        m, v = opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]
        if skip:  # a withheld update resets nothing
            assert torch.equal(m, m0) and torch.equal(v, v0)
        else:
            assert (m[fired] == 0).all() and (v[fired] == 0).all()
            assert torch.equal(m[~fired], m0[~fired]) and torch.equal(v[~fired], v0[~fired])


@pytest.mark.parametrize("mode", ["zscore", "adagc", "spam"])
def test_state_round_trip_continues_as_never_stopping(mode):
    cfg = sg.GuardConfig(clipping=ClipConfig(clip_mode=mode, warmup=3), clip=1.0,
                         weights_check=False)

    def run(stop=None):
        torch.manual_seed(0)
        model = sg.GPT(sg.GPTConfig.tiny())
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
        guard = sg.Guard(model, opt, config=cfg)
        for t in range(6):
            if t == stop:  # save, build a new guard on the same model and optimizer, load
                state = json.loads(json.dumps(guard.state_dict()))
                guard = sg.Guard(model, opt, config=cfg)
                guard.load_state_dict(state)
            g = torch.Generator().manual_seed(t)
            x = torch.randint(0, 256, (4, 32), generator=g)
            out = model.loss(model(x[:, :-1]), x[:, 1:])
            out.loss.backward()
            guard.step(out)
        return [p.detach().clone() for p in model.parameters()], guard.state_dict()["updater"]["clip"]

    (straight, s1), (resumed, s2) = run(), run(stop=4)
    assert s1 == s2 and s1["mode"] == mode
    for a, b in zip(straight, resumed):
        assert torch.equal(a, b)

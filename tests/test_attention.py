import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import spikeguard as sg
from spikeguard.model import Attention, _apply_rope
from spikeguard.prevent.attention import logit_p99

ROOT = Path(__file__).resolve().parents[1]


def _reference(q, k, v, *, causal, cap, mask_first=False):
    """float64 attention written from the definition: scale, cap, then mask, then softmax."""
    q, k, v = (x.double() for x in (q, k, v))
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    masked = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool).triu(1)
    if mask_first and causal:
        s = s.masked_fill(masked, float("-inf"))
    if cap is not None:
        s = cap * torch.tanh(s / cap)
    if causal and not mask_first:
        s = s.masked_fill(masked, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def _qkv(b=2, h=3, t=17, s=17, d=8, spread=4.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, h, t, d, generator=g) * spread).requires_grad_()
    k = (torch.randn(b, h, s, d, generator=g) * spread).requires_grad_()
    v = torch.randn(b, h, s, d, generator=g).requires_grad_()
    return q, k, v


def test_softcap_values_match_the_corrected_table_and_its_gradient():
    x = torch.tensor([5.0, 30.0, 80.0, 200.0], dtype=torch.float64, requires_grad=True)
    y = sg.softcap(x, 50.0)
    # shared/SEED-ERRATA.md: the seed's 4.99, 26.8, 46.1, 49.9 recomputed
    torch.testing.assert_close(y.detach(), torch.tensor([4.983, 26.85, 46.08, 49.97], dtype=torch.float64),
                               atol=0.07, rtol=0)
    assert all(abs(float(a) - 50 * math.tanh(float(b) / 50)) < 1e-12 for a, b in zip(y.detach(), x.detach()))
    (grad,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(grad, 1 - torch.tanh(x.detach() / 50) ** 2)
    assert float(grad[-1]) < 2e-3 and float(grad[0]) > 0.99  # saturated at 4 caps, linear at 0.1
    assert float(sg.softcap(torch.tensor(1e9), 30.0)) == pytest.approx(30.0)


@pytest.mark.parametrize("cap", [0.0, -5.0, math.inf, math.nan, True])
def test_softcap_rejects_bad_caps(cap):
    with pytest.raises(ValueError, match="cap="):
        sg.softcap(torch.ones(2), cap)


@pytest.mark.parametrize("cap", [None, 5.0, 50.0])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("backend", ["auto", "eager"])
def test_attention_equals_float64_reference_forward_and_backward(cap, causal, backend):
    q, k, v = _qkv(s=21)
    if causal and backend == "auto" and cap is None:
        q, k, v = _qkv()  # SDPA's causal path with T == S
    out = sg.attention(q, k, v, causal=causal, softcap=cap, backend=backend)
    ref = _reference(q, k, v, causal=causal, cap=cap)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    refs = torch.autograd.grad(ref, (q, k, v), g.double())
    for a, r in zip(grads, refs):
        torch.testing.assert_close(a.double(), r.double(), atol=5e-5, rtol=1e-4)


def test_cap_is_applied_before_the_mask():
    q, k, v = _qkv(spread=1.0)
    out = sg.attention(q, k, v, causal=True, softcap=2.0)
    before = _reference(q, k, v, causal=True, cap=2.0)
    after = _reference(q, k, v, causal=True, cap=2.0, mask_first=True)  # masked keys at -cap leak
    torch.testing.assert_close(out.double(), before, atol=2e-5, rtol=1e-5)
    assert (out.double() - after).abs().max() > 1e-2


def test_the_cap_is_never_dropped():
    q, k, v = _qkv(spread=6.0)
    capped = sg.attention(q, k, v, softcap=5.0)
    plain = sg.attention(q, k, v)
    assert (capped - plain).abs().max() > 1e-2
    with pytest.raises(ValueError, match="SDPA cannot apply softcap"):
        sg.attention(q, k, v, softcap=5.0, backend="sdpa")
    with pytest.raises(ValueError, match="backend='flex' trains only on CUDA"):
        sg.attention(q, k, v, softcap=5.0, backend="flex")
    with pytest.raises(ValueError, match="4-D"):
        sg.attention(q[0], k[0], v[0])


def test_attention_keeps_low_precision_dtype_and_computes_in_fp32():
    q, k, v = (x.detach().bfloat16().requires_grad_() for x in _qkv())
    out = sg.attention(q, k, v, softcap=20.0)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), _reference(q, k, v, causal=True, cap=20.0),
                               atol=2e-2, rtol=2e-2)
    out.float().sum().backward()
    assert q.grad.dtype == torch.bfloat16 and torch.isfinite(q.grad.float()).all()


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_qknorm_matches_the_definition(kind):
    qk = sg.QKNorm(8, kind=kind)
    assert [n for n, _ in qk.named_parameters()] == ["q_weight", "k_weight"]
    assert all(bool((p == 1).all()) for p in qk.parameters())
    with torch.no_grad():
        qk.q_weight.copy_(torch.linspace(0.5, 2.0, 8))
    q, k = torch.randn(2, 3, 5, 8) * 7, torch.randn(2, 3, 5, 8) * 0.1
    nq, nk = qk(q, k)

    def norm(x, w):
        x = x.double()
        if kind == "layer":
            x = x - x.mean(-1, keepdim=True)
            return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()

    torch.testing.assert_close(nq.double(), norm(q, qk.q_weight.detach()), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(nk.double(), norm(k, qk.k_weight.detach()), atol=1e-5, rtol=1e-5)
    # bounded logits: |q.k| <= |q| |k| = head_dim for unit gains
    assert float((nk * nk).sum(-1).max().detach()) <= 8 + 1e-3
    assert qk(q.bfloat16(), k.bfloat16())[0].dtype == torch.bfloat16


def test_qknorm_validation():
    with pytest.raises(ValueError, match="kind='batch'"):
        sg.QKNorm(8, kind="batch")
    with pytest.raises(ValueError, match="head_dim=0"):
        sg.QKNorm(0)
    with pytest.raises(ValueError, match="head_dim=8"):
        sg.QKNorm(8)(torch.ones(2, 4), torch.ones(2, 4))


def test_stacking_qknorm_and_softcap_warns():
    with pytest.warns(sg.StackedLogitBoundsWarning, match="Pick one"):
        sg.GPTConfig.tiny(qk_norm=True, attn_softcap=50.0)
    with pytest.raises(ValueError, match=r"GPTConfig\.attn_softcap=0"):
        sg.GPTConfig.tiny(attn_softcap=0)
    with pytest.raises(ValueError, match=r"GPTConfig\.final_logit_softcap=-1"):
        sg.GPTConfig.tiny(final_logit_softcap=-1)
    with pytest.raises(ValueError, match=r"GPTConfig\.init='mup'"):
        sg.GPTConfig.tiny(init="mup")
    with pytest.raises(ValueError, match=r"GPTConfig\.qk_norm='yes'"):
        sg.GPTConfig.tiny(qk_norm="yes")


@pytest.mark.parametrize("causal", [True, False])
def test_logit_p99_is_exact_on_small_inputs(causal):
    q, k, _ = (x.detach() for x in _qkv(t=9, s=9))
    got = logit_p99(q, k, causal=causal)
    s = (q @ k.transpose(-2, -1)).double() / math.sqrt(8)
    visible = ~torch.ones(9, 9, dtype=torch.bool).triu(1) if causal else torch.ones(9, 9, dtype=torch.bool)
    for h in range(3):
        vals = s[:, h][:, visible].abs().flatten()
        want = torch.quantile(vals, 0.99, interpolation="higher")
        assert float(got[h]) == pytest.approx(float(want), rel=1e-5)
    capped = logit_p99(q, k, causal=causal, softcap=3.0)
    torch.testing.assert_close(capped, 3.0 * torch.tanh(got / 3.0), atol=1e-5, rtol=1e-5)


def test_logit_p99_sample_tracks_the_full_quantile():
    g = torch.Generator().manual_seed(1)
    q, k, _ = _qkv(b=2, h=4, t=192, s=192, d=16, seed=3)
    q = q.detach() * torch.tensor([0.5, 1.0, 2.0, 4.0]).view(1, 4, 1, 1)  # heads of distinct scale
    got = logit_p99(q, k, sample=8192, generator=g)
    s = (q @ k.detach().transpose(-2, -1)) / 4.0
    visible = ~torch.ones(192, 192, dtype=torch.bool).triu(1)
    for h in range(4):
        want = torch.quantile(s[:, h][:, visible].abs().flatten(), 0.99)
        assert float(got[h]) == pytest.approx(float(want), rel=0.05)
    assert got.shape == (4,) and got.dtype == torch.float32


def test_gpt_attention_module_with_qknorm_rope_and_cap_matches_reference():
    torch.manual_seed(0)
    with pytest.warns(sg.StackedLogitBoundsWarning):
        cfg = sg.GPTConfig.tiny(pos="rope", qk_norm=True, attn_softcap=3.0)
    attn = Attention(cfg)
    with torch.no_grad():
        attn.qkv.weight.mul_(30)  # scores large enough for the cap to matter
        attn.qk_norm.q_weight.uniform_(1.0, 3.0)
    x = torch.randn(2, 10, cfg.d_model)
    b, t, _ = x.shape
    q, k, v = attn.qkv(x).view(b, t, 3, cfg.n_head, cfg.head_dim).permute(2, 0, 3, 1, 4)
    rms = lambda z, w: z / torch.sqrt(z.pow(2).mean(-1, keepdim=True) + 1e-6) * w  # noqa: E731
    q, k = rms(q, attn.qk_norm.q_weight), rms(k, attn.qk_norm.k_weight)
    q, k = _apply_rope(q, attn.rope_cos, attn.rope_sin), _apply_rope(k, attn.rope_cos, attn.rope_sin)
    y = _reference(q, k, v, causal=True, cap=3.0).float()
    want = attn.proj(y.transpose(1, 2).reshape(b, t, cfg.d_model))
    torch.testing.assert_close(attn(x), want, atol=1e-5, rtol=1e-4)


def test_gpt_knobs_cap_logits_and_train():
    torch.manual_seed(0)
    cfg = sg.GPTConfig.tiny(qk_norm=True, final_logit_softcap=0.5)
    model = sg.GPT(cfg)
    assert model.num_params() == sg.GPT(sg.GPTConfig.tiny()).num_params() + 2 * 2 * cfg.head_dim
    idx = torch.randint(0, 256, (2, 16))
    h = model(idx)
    raw = h @ model.wte.weight.T
    torch.testing.assert_close(model.logits(h), 0.5 * torch.tanh(raw / 0.5))
    F.cross_entropy(model.logits(h).flatten(0, 1), idx.flatten()).backward()
    gains = [p.grad for n, p in model.named_parameters() if n.endswith(("q_weight", "k_weight"))]
    assert len(gains) == 4 and all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in gains)

    # an attention cap far above every score leaves the model as it was; a small one does not
    torch.manual_seed(0)
    plain = sg.GPT(sg.GPTConfig.tiny())
    wide, tight = sg.GPT(sg.GPTConfig.tiny(attn_softcap=100.0)), sg.GPT(sg.GPTConfig.tiny(attn_softcap=1e-3))
    wide.load_state_dict(plain.state_dict())
    tight.load_state_dict(plain.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(wide(idx), plain(idx), atol=1e-5, rtol=1e-5)
        assert (tight(idx) - plain(idx)).abs().max() > 1e-4


def test_bench_attention_smoke_and_gpu_check_skip_on_cpu(sub_env, capsys):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "benchmarks/bench_attention.py", "--smoke", "--threads", "1"],
                       capture_output=True, text=True, timeout=120, env=sub_env, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "capped eager vs uncapped eager:" in r.stdout and "QK-norm training step" in r.stdout
    if not torch.cuda.is_available():
        from benchmarks import gpu_check

        assert gpu_check.main([]) == 0
        assert "skipping" in capsys.readouterr().out

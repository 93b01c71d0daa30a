import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import spikeguard as sg
from spikeguard.model import Attention, _apply_rope
from spikeguard.prevent.attention import (
    QKNorm,
    StackedLogitBoundsWarning,
    attention,
    logit_p99,
    softcap,
)

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


def _qkv(b=2, h=3, t=17, s=17, d=8, spread=4.0, seed=0, h_kv=None):
    g = torch.Generator().manual_seed(seed)
    h_kv = h if h_kv is None else h_kv
    q = (torch.randn(b, h, t, d, generator=g) * spread).requires_grad_()
    k = (torch.randn(b, h_kv, s, d, generator=g) * spread).requires_grad_()
    v = torch.randn(b, h_kv, s, d, generator=g).requires_grad_()
    return q, k, v


def _repeat_kv(q, k, v):
    """Grouped-query attention written out: every query head gets its own copy of its K/V head
    (head h reads K/V head h // group), the repeat_interleave of SDPA's enable_gqa docs."""
    group = q.shape[1] // k.shape[1]
    return q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)


def test_softcap_values_match_the_corrected_table_and_its_gradient():
    x = torch.tensor([5.0, 30.0, 80.0, 200.0], dtype=torch.float64, requires_grad=True)
    y = softcap(x, 50.0)
    # the worked example's 4.99, 26.8, 46.1, 49.9, recomputed
    torch.testing.assert_close(y.detach(), torch.tensor([4.983, 26.85, 46.08, 49.97], dtype=torch.float64),
                               atol=0.07, rtol=0)
    assert all(abs(float(a) - 50 * math.tanh(float(b) / 50)) < 1e-12 for a, b in zip(y.detach(), x.detach()))
    (grad,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(grad, 1 - torch.tanh(x.detach() / 50) ** 2)
    assert float(grad[-1]) < 2e-3 and float(grad[0]) > 0.99  # saturated at 4 caps, linear at 0.1
    assert float(softcap(torch.tensor(1e9), 30.0)) == pytest.approx(30.0)


@pytest.mark.parametrize("cap", [0.0, -5.0, math.inf, math.nan, True])
def test_softcap_rejects_bad_caps(cap):
    with pytest.raises(ValueError, match="cap="):
        softcap(torch.ones(2), cap)


@pytest.mark.parametrize("cap", [None, 5.0, 50.0])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("backend", ["auto", "eager"])
def test_attention_equals_float64_reference_forward_and_backward(cap, causal, backend):
    q, k, v = _qkv(s=21)
    if causal and backend == "auto" and cap is None:
        q, k, v = _qkv()  # SDPA's causal path with T == S
    out = attention(q, k, v, causal=causal, softcap=cap, backend=backend)
    ref = _reference(q, k, v, causal=causal, cap=cap)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    refs = torch.autograd.grad(ref, (q, k, v), g.double())
    for a, r in zip(grads, refs):
        torch.testing.assert_close(a.double(), r.double(), atol=5e-5, rtol=1e-4)


def test_cap_is_applied_before_the_mask():
    q, k, v = _qkv(spread=1.0)
    out = attention(q, k, v, causal=True, softcap=2.0)
    before = _reference(q, k, v, causal=True, cap=2.0)
    after = _reference(q, k, v, causal=True, cap=2.0, mask_first=True)  # masked keys at -cap leak
    torch.testing.assert_close(out.double(), before, atol=2e-5, rtol=1e-5)
    assert (out.double() - after).abs().max() > 1e-2


def test_the_cap_is_never_dropped():
    q, k, v = _qkv(spread=6.0)
    capped = attention(q, k, v, softcap=5.0)
    plain = attention(q, k, v)
    assert (capped - plain).abs().max() > 1e-2
    with pytest.raises(ValueError, match="SDPA cannot apply softcap"):
        attention(q, k, v, softcap=5.0, backend="sdpa")
    with pytest.raises(ValueError, match="backend='flex' trains only on CUDA"):
        attention(q, k, v, softcap=5.0, backend="flex")
    with pytest.raises(ValueError, match="4-D"):
        attention(q[0], k[0], v[0])


def test_attention_keeps_low_precision_dtype_and_computes_in_fp32():
    q, k, v = (x.detach().bfloat16().requires_grad_() for x in _qkv())
    out = attention(q, k, v, softcap=20.0)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), _reference(q, k, v, causal=True, cap=20.0),
                               atol=2e-2, rtol=2e-2)
    out.float().sum().backward()
    assert q.grad.dtype == torch.bfloat16 and torch.isfinite(q.grad.float()).all()


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_qknorm_matches_the_definition(kind):
    qk = QKNorm(8, kind=kind)
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
        QKNorm(8, kind="batch")
    with pytest.raises(ValueError, match="head_dim=0"):
        QKNorm(0)
    with pytest.raises(ValueError, match="head_dim=8"):
        QKNorm(8)(torch.ones(2, 4), torch.ones(2, 4))


def test_stacking_qknorm_and_softcap_warns():
    with pytest.warns(StackedLogitBoundsWarning, match="Pick one"):
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


@pytest.mark.parametrize("h_kv", [1, 2], ids=["multi-query", "grouped-query"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("backend", "cap"), [("auto", None), ("eager", None), ("eager", 5.0),
                                              ("auto", 50.0)])
def test_grouped_and_multi_query_heads_equal_repeated_heads_in_float64(backend, cap, causal,
                                                                       h_kv):
    q, k, v = _qkv(h=6, h_kv=h_kv, s=17 if causal else 21, seed=h_kv)
    out = attention(q, k, v, causal=causal, softcap=cap, backend=backend)
    assert out.shape == q.shape
    ref = _reference(*_repeat_kv(q, k, v), causal=causal, cap=cap)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    refs = torch.autograd.grad(ref, (q, k, v), g.double())  # k, v: summed over each group
    for a, r in zip(grads, refs):
        assert a.shape == r.shape
        torch.testing.assert_close(a.double(), r.double(), atol=5e-5, rtol=1e-4)


def test_grouped_query_eager_path_across_several_head_chunks():
    # 3 query heads per K/V head x 224 x 224 fp32 scores: 3 of the 4 (batch, K/V head) slices
    # fit one chunk, so the loop runs twice and the last chunk is short
    q, k, v = _qkv(b=2, h=6, h_kv=2, t=224, s=224, spread=2.0, seed=5)
    out = attention(q, k, v, softcap=5.0)
    ref = _reference(*_repeat_kv(q, k, v), causal=True, cap=5.0)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    refs = torch.autograd.grad(ref.sum(), (q, k, v))
    for a, r in zip(grads, refs):
        torch.testing.assert_close(a.double(), r.double(), atol=1e-4, rtol=1e-4)


def test_heads_that_do_not_divide_and_double_backward_raise():
    q, k, v = _qkv(h=6, h_kv=4)
    with pytest.raises(ValueError, match="H_kv dividing H"):
        attention(q, k, v)
    with pytest.raises(ValueError, match="H_kv dividing H"):
        logit_p99(q.detach(), k.detach())
    q, k, v = _qkv(h=4, h_kv=2)
    out = attention(q, k, v, softcap=5.0, backend="eager")
    (gq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice.*once_differentiable"):
        gq.sum().backward()


@pytest.mark.parametrize("causal", [True, False])
def test_logit_p99_with_grouped_heads_reads_each_query_heads_own_kv_head(causal):
    q, k, _ = (x.detach() for x in _qkv(h=6, h_kv=2, t=9, s=9, seed=6))
    k[:, 1] *= 10  # query heads 3..5 read K/V head 1: their logits are 10x larger
    got = logit_p99(q, k, causal=causal)
    _, k_rep, _ = _repeat_kv(q, k, k)
    s = (q.double() @ k_rep.double().transpose(-2, -1)) / math.sqrt(8)
    visible = ~torch.ones(9, 9, dtype=torch.bool).triu(1) if causal else torch.ones(9, 9, dtype=torch.bool)
    for h in range(6):
        want = torch.quantile(s[:, h][:, visible].abs().flatten(), 0.99, interpolation="higher")
        assert float(got[h]) == pytest.approx(float(want), rel=1e-5)
    assert float(got[3:].min()) > float(got[:3].max())
    # sampled: the same draws as with the heads repeated by hand
    q, k, _ = (x.detach() for x in _qkv(b=2, h=6, h_kv=3, t=64, s=64, seed=7))
    a = logit_p99(q, k, sample=500, generator=torch.Generator().manual_seed(0))
    b = logit_p99(q, _repeat_kv(q, k, k)[1], sample=500, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


def test_rope_dot_products_depend_only_on_the_offset():
    """RoFormer's property: <R_m q, R_n k> depends on m - n alone, and equals
    Re sum_i z_q,i conj(z_k,i) exp(1j (m - n) theta_i), z_i = x[2i] + 1j x[2i+1],
    theta_i = 10000^(-2i / D), written here in complex float64 from the definition."""
    cfg = sg.GPTConfig.tiny(pos="rope")
    attn = Attention(cfg)
    t, d = cfg.seq_len, cfg.head_dim
    g = torch.Generator().manual_seed(8)
    q0, k0 = torch.randn(d, generator=g), torch.randn(d, generator=g)
    # the same query and key vector at every position, rotated by the module's own tables
    q = _apply_rope(q0.expand(1, 1, t, d), attn.rope_cos, attn.rope_sin)[0, 0]
    k = _apply_rope(k0.expand(1, 1, t, d), attn.rope_cos, attn.rope_sin)[0, 0]
    dots = (q @ k.T).double()  # dots[m, n] = q_m . k_n
    torch.testing.assert_close(dots[1:, 1:], dots[:-1, :-1], atol=1e-4, rtol=0)  # shift both
    zq = torch.complex(q0[0::2].double(), q0[1::2].double())
    zk = torch.complex(k0[0::2].double(), k0[1::2].double())
    theta = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    offset = torch.arange(t)[:, None] - torch.arange(t)[None, :]
    want = (zq * zk.conj() * torch.exp(1j * offset[..., None] * theta)).sum(-1).real
    torch.testing.assert_close(dots, want, atol=1e-4, rtol=1e-5)
    assert float(want.std()) > 0.1  # it does vary with the offset: a constant would pass above
    torch.testing.assert_close(q.norm(dim=-1), q0.norm().expand(t), atol=1e-5, rtol=1e-5)


def test_gpt_attention_module_with_qknorm_rope_and_cap_matches_reference():
    torch.manual_seed(0)
    with pytest.warns(StackedLogitBoundsWarning):
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
    r = subprocess.run([sys.executable, "benchmarks/bench_attention.py", "--smoke", "--threads", "1"],
                       capture_output=True, text=True, timeout=120, env=sub_env, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    labels = ("capped eager vs uncapped eager", "capped eager vs uncapped SDPA",
              "capped eager GQA vs capped eager MHA", "QK-norm training step vs plain")
    for label in labels:
        m = re.search(rf"^{re.escape(label)}:\s+(\S+)", r.stdout, re.M)
        assert m, f"{label!r} missing from:\n{r.stdout}"
        assert math.isfinite(float(m.group(1))) and float(m.group(1)) > 0, m.group(0)
    if not torch.cuda.is_available():
        from benchmarks import gpu_check

        assert gpu_check.main([]) == 0
        assert "skipping" in capsys.readouterr().out

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

import spikeguard as sg
from spikeguard.prevent.losses import LossOutput, cross_entropy, linear_cross_entropy, router_z_loss

ROOT = Path(__file__).resolve().parents[1]


def _targets(n: int, v: int, *, ignore_every: int = 5, seed: int = 0) -> torch.Tensor:
    t = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(seed))
    t[::ignore_every] = -100
    return t


def _ref_loss(logits: torch.Tensor, t: torch.Tensor, alpha: float, softcap: float | None = None):
    """Unfused reference built from torch's own functions: (loss, ce, z term, mean log Z)."""
    c = logits if softcap is None else softcap * torch.tanh(logits / softcap)
    counted = t != -100
    lse = torch.logsumexp(c, dim=-1)[counted]
    ce = F.cross_entropy(c, t, ignore_index=-100)
    z = alpha * lse.square().mean()
    return ce + z, ce, z, lse.mean()


# ---------------------------------------------------------------- cross_entropy


def test_grad_is_p_minus_y_plus_2_alpha_logz_p_against_float64():
    torch.manual_seed(0)
    n, v, alpha = 64, 300, 1e-3
    # shifted logits: log Z is about 9, so the z-loss term in the gradient is visible
    x = (torch.randn(n, v, dtype=torch.float64) * 2 + 3).requires_grad_()
    t = _targets(n, v)
    out = cross_entropy(x, t, z_loss=alpha)
    (g,) = torch.autograd.grad(out.loss, x)

    # the z-loss gradient, written out in float64: (p_j - y_j + 2 alpha logZ p_j) / N_counted
    with torch.no_grad():
        counted = t != -100
        p = torch.softmax(x, dim=-1)
        log_z = torch.log(torch.exp(x).sum(-1, keepdim=True))
        y = F.one_hot(t.clamp(min=0), v).double()
        expected = (p - y + 2 * alpha * log_z * p) * counted[:, None] / counted.sum()
    torch.testing.assert_close(g, expected, rtol=1e-10, atol=1e-14)
    # float64 autograd through the unfused reference agrees too
    (g_ref,) = torch.autograd.grad(_ref_loss(x, t, alpha)[0], x)
    torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-14)
    # and the z-loss part is not negligible, so the test would see it missing
    assert (expected - (p - y) * counted[:, None] / counted.sum()).abs().max() > 1e-5
    assert g[~counted].abs().max() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_ce_equals_torch_cross_entropy_with_ignore_index(dtype):
    torch.manual_seed(1)
    x = torch.randn(4, 25, 97, dtype=dtype) * 3
    t = _targets(100, 97).view(4, 25)
    ref = F.cross_entropy(x.flatten(0, 1), t.flatten(), ignore_index=-100)
    out = cross_entropy(x, t)
    assert out.loss.dtype == dtype and out.loss.shape == ()
    torch.testing.assert_close(out.ce, ref)
    # z_loss=0: loss is exactly the cross-entropy
    torch.testing.assert_close(cross_entropy(x, t, z_loss=0.0).loss, ref)
    for reduction in ("sum", "none"):
        r = F.cross_entropy(x.flatten(0, 1), t.flatten(), reduction=reduction).view(
            () if reduction == "sum" else (4, 25))
        torch.testing.assert_close(cross_entropy(x, t, z_loss=0.0, reduction=reduction).ce, r)


def test_outputs_are_detached_and_consistent():
    torch.manual_seed(2)
    x = torch.randn(50, 40, dtype=torch.float64, requires_grad=True)
    t = _targets(50, 40)
    out = cross_entropy(x, t)
    assert isinstance(out, LossOutput) and out.loss.requires_grad
    assert not (out.ce.requires_grad or out.z_loss.requires_grad or out.log_z.requires_grad)
    ref = _ref_loss(x.detach(), t, 1e-4)
    for got, want in zip(out, ref):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(out.loss, out.ce + out.z_loss, rtol=1e-12, atol=0)


def test_reduction_none_is_per_token_and_zero_at_ignored():
    torch.manual_seed(3)
    x = torch.randn(3, 7, 11, dtype=torch.float64, requires_grad=True)
    t = _targets(21, 11, ignore_every=4).view(3, 7)
    out = cross_entropy(x, t, z_loss=1e-3, reduction="none")
    assert out.loss.shape == out.log_z.shape == (3, 7)
    counted = t != -100
    lse = torch.logsumexp(x.detach(), -1)
    ce = F.cross_entropy(x.detach().flatten(0, 1), t.flatten(), reduction="none").view(3, 7)
    torch.testing.assert_close(out.log_z, torch.where(counted, lse, 0.0))
    torch.testing.assert_close(out.loss.detach(), torch.where(counted, ce + 1e-3 * lse**2, 0.0))
    # per-token backward with arbitrary upstream weights equals autograd of the reference
    w = torch.rand(3, 7, dtype=torch.float64)
    (g,) = torch.autograd.grad((out.loss * w).sum(), x)
    ref = torch.where(counted, F.cross_entropy(x.flatten(0, 1), t.flatten(), reduction="none")
                      .view(3, 7) + 1e-3 * torch.logsumexp(x, -1) ** 2, 0.0)
    (g_ref,) = torch.autograd.grad((ref * w).sum(), x)
    torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-14)


def test_softcap_caps_logits_before_log_z():
    torch.manual_seed(4)
    x = (torch.randn(40, 60, dtype=torch.float64) * 30).requires_grad_()
    t = _targets(40, 60)
    out = cross_entropy(x, t, softcap=30.0, z_loss=1e-3)
    loss, ce, _, log_z = _ref_loss(x, t, 1e-3, softcap=30.0)
    torch.testing.assert_close(out.log_z, log_z.detach())
    torch.testing.assert_close(out.ce, ce.detach())
    (g,) = torch.autograd.grad(out.loss, x)
    (g_ref,) = torch.autograd.grad(loss, x)
    torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-14)
    # capping matters at this scale: the uncapped log Z is far larger
    assert cross_entropy(x.detach(), t).log_z > log_z + 10


def test_bf16_upcasts_and_log_z_matches_fp32_logsumexp():
    torch.manual_seed(5)
    x = (torch.randn(300, 5000) * 4 + 6).bfloat16().requires_grad_()
    t = _targets(300, 5000, ignore_every=3)
    out = cross_entropy(x, t)
    counted = t != -100
    ref = torch.logsumexp(x.detach().float(), -1)[counted].mean()
    assert out.log_z.dtype == torch.float32
    assert abs(float(out.log_z) - float(ref)) < 1e-3
    torch.testing.assert_close(out.ce, F.cross_entropy(x.detach().float(), t), rtol=1e-5, atol=1e-5)
    out.loss.backward()
    assert x.grad.dtype == torch.bfloat16
    # the bf16 gradient is the fp32 gradient rounded once
    xf = x.detach().float().requires_grad_()
    cross_entropy(xf, t).loss.backward()
    torch.testing.assert_close(x.grad, xf.grad.bfloat16(), rtol=0, atol=0)


def test_all_targets_ignored_gives_zeros_not_nan():
    x = torch.randn(6, 10, requires_grad=True)
    t = torch.full((6,), -100)
    out = cross_entropy(x, t)
    assert [float(v.detach()) for v in out] == [0.0, 0.0, 0.0, 0.0]
    out.loss.backward()
    assert torch.equal(x.grad, torch.zeros_like(x))
    assert F.cross_entropy(x.detach(), t).isnan()  # torch's choice differs; ours is documented


# ---------------------------------------------------------------- linear_cross_entropy


@pytest.mark.parametrize("softcap", [None, 15.0])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_linear_cross_entropy_equals_unfused_path(dtype, softcap):
    torch.manual_seed(6)
    n, h, v = 1000, 24, 160
    hidden = torch.randn(n, h, dtype=dtype, requires_grad=True)
    weight = (torch.randn(v, h, dtype=dtype) * 2).requires_grad_()
    bias = torch.randn(v, dtype=dtype, requires_grad=True)
    t = _targets(n, v, ignore_every=7)
    out = linear_cross_entropy(hidden, weight, t, bias=bias, z_loss=1e-3, softcap=softcap,
                               chunk_size=96)  # 96 < N and does not divide 1000
    grads = torch.autograd.grad(out.loss, (hidden, weight, bias))
    ref = cross_entropy(F.linear(hidden, weight, bias), t, z_loss=1e-3, softcap=softcap)
    ref_grads = torch.autograd.grad(ref.loss, (hidden, weight, bias))
    # the unfused path built from torch's functions alone agrees with our cross_entropy
    torch.testing.assert_close(ref.loss, _ref_loss(F.linear(hidden, weight, bias), t, 1e-3,
                                                   softcap)[0])
    tol = {"rtol": 1e-9, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-6}
    for got, want in zip(out, ref):
        torch.testing.assert_close(got.detach(), want.detach(), **tol)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, **tol)


def test_linear_cross_entropy_shapes_defaults_and_no_grad():
    torch.manual_seed(7)
    hidden = torch.randn(3, 50, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(64, 16, dtype=torch.float64)  # frozen: only hidden gets a grad
    t = _targets(150, 64).view(3, 50)
    out = linear_cross_entropy(hidden, weight, t)  # chunk_size=None: one chunk here
    ref = cross_entropy(hidden @ weight.T, t)
    torch.testing.assert_close(out.loss, ref.loss)
    (g,) = torch.autograd.grad(out.loss * 3.0, hidden)  # upstream scale reaches the grads
    (g_ref,) = torch.autograd.grad(ref.loss * 3.0, hidden)
    torch.testing.assert_close(g, g_ref)
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(hidden, weight, t, chunk_size=7).log_z,
                                   ref.log_z)
    empty = linear_cross_entropy(hidden, weight.requires_grad_(), torch.full((3, 50), -100))
    assert float(empty.loss.detach()) == 0.0
    gw = torch.autograd.grad(empty.loss, weight)[0]
    assert torch.equal(gw, torch.zeros_like(weight))


def test_linear_cross_entropy_bf16_matches_fp32_reference():
    torch.manual_seed(11)
    hidden = torch.randn(300, 32).bfloat16().requires_grad_()
    weight = (torch.randn(500, 32) * 0.5).bfloat16().requires_grad_()
    t = _targets(300, 500)
    out = linear_cross_entropy(hidden, weight, t, chunk_size=64)
    out.loss.backward()
    assert out.loss.dtype == torch.float32
    assert hidden.grad.dtype == weight.grad.dtype == torch.bfloat16
    hf, wf = (hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_())
    ref = cross_entropy(F.linear(hf, wf), t)
    ref.loss.backward()
    # bf16 logits carry ~3 significant digits; everything after the matmul is fp32
    torch.testing.assert_close(out.loss.detach(), ref.loss.detach(), rtol=2e-3, atol=0)
    torch.testing.assert_close(out.log_z, ref.log_z, rtol=2e-3, atol=0)
    for got, want in ((hidden.grad, hf.grad), (weight.grad, wf.grad)):
        rel = (got.float() - want).norm() / want.norm()
        assert rel < 1e-2, rel


def _peak_alloc_bytes(fn) -> int:
    """Peak of the running total of bytes allocated by torch's CPU allocator while ``fn`` runs,
    relative to the start."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    assert events, "the profiler recorded no allocations"
    running = peak = 0
    for _, size in sorted(events):
        running += size
        peak = max(peak, running)
    return peak


def test_linear_cross_entropy_peak_memory_below_quarter_of_naive():
    """Peak extra memory of forward + backward at N=2048, V=32k, H=32, default chunk_size.

    Measured, not estimated: torch's profiler with profile_memory=True records every allocation
    and free of the CPU allocator (size and time, positive or negative), so the running sum of
    those sizes, in time order, is the live tensor memory above what existed at the start; its
    maximum is the peak. The naive path builds the fp32 [2048, 32768] logits (256 MiB), their
    log-softmax and their gradient; ours holds at most two 64 MiB chunks at a time.
    """
    torch.manual_seed(8)
    n, h, v = 2048, 32, 32768
    hidden = torch.randn(n, h, requires_grad=True)
    weight = (torch.randn(v, h) * 0.1).requires_grad_()
    t = _targets(n, v)

    def naive():
        F.cross_entropy(F.linear(hidden, weight), t).backward()

    def fused():
        linear_cross_entropy(hidden, weight, t, z_loss=0.0).loss.backward()

    peaks = {}
    for name, fn in (("naive", naive), ("fused", fused)):
        hidden.grad = weight.grad = None
        peaks[name] = _peak_alloc_bytes(fn)
    assert peaks["naive"] > 3 * n * v * 4 * 0.9  # logits + log-softmax + grad at least
    assert peaks["fused"] < 0.25 * peaks["naive"], peaks


# ---------------------------------------------------------------- router z-loss, validation


def test_router_z_loss_is_mean_squared_logsumexp():
    torch.manual_seed(9)
    r = torch.randn(2, 33, 8, dtype=torch.float64, requires_grad=True)
    got = router_z_loss(r)
    want = torch.log(torch.exp(r).sum(-1)).square().mean()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.autograd.grad(got, r)[0], torch.autograd.grad(want, r)[0])
    assert router_z_loss(r.detach().bfloat16()).dtype == torch.float32


def test_bad_inputs_raise_clear_errors():
    x, t = torch.randn(4, 10), torch.tensor([1, 2, -100, 3])
    with pytest.raises(ValueError, match=r"target\[1\].*= 10 is outside \[0, 10\)"):
        cross_entropy(x, torch.tensor([1, 10, 2, 3]))
    with pytest.raises(ValueError, match="= -5 is outside"):
        cross_entropy(x, torch.tensor([1, -5, 2, 3]))
    with pytest.raises(ValueError, match=r"target shape \(3,\) must equal"):
        cross_entropy(x, t[:3])
    with pytest.raises(ValueError, match="must be an integer type"):
        cross_entropy(x, t.float())
    with pytest.raises(ValueError, match="target is on meta"):
        cross_entropy(x, t.to("meta"))
    with pytest.raises(ValueError, match="z_loss=-0.1 is negative"):
        cross_entropy(x, t, z_loss=-0.1)
    with pytest.raises(ValueError, match="softcap=0"):
        cross_entropy(x, t, softcap=0)
    with pytest.raises(ValueError, match="reduction='avg'"):
        cross_entropy(x, t, reduction="avg")
    with pytest.warns(UserWarning, match="z_loss=0.01 is above 0.001"):
        cross_entropy(x, t, z_loss=1e-2)
    w = torch.randn(10, 6)
    with pytest.raises(ValueError, match="weight dtype torch.float64 differs"):
        linear_cross_entropy(torch.randn(4, 6), w.double(), t)
    with pytest.raises(ValueError, match=r"must end in H=6"):
        linear_cross_entropy(torch.randn(4, 5), w, t)
    with pytest.raises(ValueError, match=r"bias shape \(9,\)"):
        linear_cross_entropy(torch.randn(4, 6), w, t, bias=torch.zeros(9))
    with pytest.raises(ValueError, match="chunk_size=0"):
        linear_cross_entropy(torch.randn(4, 6), w, t, chunk_size=0)


def test_public_names_and_model_loss():
    assert sg.cross_entropy is cross_entropy and LossOutput is LossOutput
    assert sg.linear_cross_entropy is linear_cross_entropy and router_z_loss is router_z_loss
    torch.manual_seed(10)
    model = sg.GPT(sg.GPTConfig.tiny(tie_embeddings=False))
    idx, tgt = torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8))
    h = model(idx)
    out = model.loss(h, tgt)
    logits = (h @ model.lm_head.weight.T).reshape(-1, 256)
    torch.testing.assert_close(out.ce, F.cross_entropy(logits, tgt.reshape(-1)))
    lse = torch.logsumexp(logits, -1)
    torch.testing.assert_close(out.log_z, lse.mean())
    torch.testing.assert_close(out.loss, out.ce + 1e-4 * lse.square().mean())
    assert math.isclose(model.cfg.z_loss, 1e-4)
    with pytest.raises(ValueError, match="GPTConfig.z_loss=-0.001 must be >= 0"):
        sg.GPTConfig(z_loss=-1e-3)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("fused", [False, True], ids=["cross_entropy", "linear_cross_entropy"])
def test_double_backward_raises_torchs_once_differentiable_error(fused, reduction):
    torch.manual_seed(12)
    h = torch.randn(8, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(10, 6, dtype=torch.float64, requires_grad=True)
    t = torch.tensor([1, 2, -100, 3, 4, 5, 6, 7])
    out = (linear_cross_entropy(h, w, t, reduction=reduction) if fused
           else cross_entropy(F.linear(h, w), t, reduction=reduction))
    loss = out.loss.sum()
    (g_ref,) = torch.autograd.grad(_ref_loss(F.linear(h, w), t, 1e-4)[0] if reduction == "mean"
                                   else (cross_entropy(F.linear(h, w), t, reduction="none")
                                         .loss.sum()), h, retain_graph=True)
    # a graph-building backward still gives the right first-order gradient ...
    (g,) = torch.autograd.grad(loss, h, create_graph=True)
    torch.testing.assert_close(g.detach(), g_ref, rtol=1e-10, atol=1e-14)
    # ... and differentiating it again says why it cannot, instead of returning a silent zero
    with pytest.raises(RuntimeError, match="differentiate twice.*once_differentiable"):
        (g.square().sum() + h.sum()).backward()


def test_autocast_reaches_the_logits_matmul_and_the_dtype_error_says_so():
    torch.manual_seed(13)
    hidden, weight = torch.randn(40, 16), torch.randn(300, 16)
    t = _targets(40, 300)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = linear_cross_entropy(hidden, weight, t, chunk_size=16)
    # under autocast the logits come from a bf16 matmul: exactly the loss on bf16-cast inputs
    cast = linear_cross_entropy(hidden.bfloat16(), weight.bfloat16(), t, chunk_size=16)
    for got, want in zip(inside, cast):
        assert torch.equal(got, want)
    assert not torch.equal(inside.loss, linear_cross_entropy(hidden, weight, t).loss)
    with pytest.raises(ValueError, match="under torch.autocast the logits matmul inside already"):
        linear_cross_entropy(hidden.bfloat16(), weight, t)


def _ratios(stdout: str) -> dict[str, float]:
    """variant -> time ratio against its group's baseline, from the benchmark's ratio lines."""
    return {name: float(r) for name, r in re.findall(r"^time ratio (.+) / .+: (\S+)$", stdout, re.M)}


def test_benchmark_smoke(sub_env):
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_losses.py"), "--smoke"],
                         env=sub_env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    ratios = _ratios(res.stdout)
    from benchmarks.bench_losses import CE_VARIANTS, lce_variants

    lce = lce_variants()  # without torch's F.linear_cross_entropy (torch 2.11) its rows go
    assert set(ratios) == set(CE_VARIANTS + lce), res.stdout
    assert ratios[CE_VARIANTS[0]] == ratios[lce[0]] == 1.0  # each group's baseline
    assert all(math.isfinite(r) and r > 0 for r in ratios.values()), ratios

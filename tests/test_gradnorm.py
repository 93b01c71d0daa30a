"""grad_stats / clip_grad_norm_ in one process, against float64 math and torch's own clip."""

import contextlib
import math
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import spikeguard as sg
from spikeguard import GPT, GPTConfig
from tests.conftest import ROOT


def _gpt_with_grads(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    model = GPT(GPTConfig.tiny())
    idx = torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(seed + 1))
    model.loss(model(idx[:, :-1]), idx[:, 1:]).loss.backward()
    return model


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters() if p.grad is not None]


def _ref_norm(grads: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float(g.double().square().sum()) for g in grads))


def _bits(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    return [g.detach().clone().view(torch.int32) for g in grads]


@contextlib.contextmanager
def no_host_reads():
    """Fail on any read of a tensor's value on the host: the healthy path must not sync."""
    names = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__")
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def trap(name):
        def fn(*args, **kwargs):
            raise AssertionError(f"host read Tensor.{name} on the healthy path")
        return fn

    for n in names:
        setattr(torch.Tensor, n, trap(n))
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


def test_all_ones_gives_sqrt_of_numel_exactly():
    model = _gpt_with_grads()
    n = sum(p.numel() for p in model.parameters())
    for g in _grads(model):
        g.fill_(1.0)
    stats = sg.grad_stats(model.parameters())
    assert stats.norm.dtype == torch.float32
    assert stats.norm == torch.tensor(math.sqrt(n), dtype=torch.float32)
    assert stats.numel == n
    assert stats.nonfinite == 0 and stats.nan_frac == 0.0


def test_real_batch_matches_float64_and_torch_clip():
    ours, theirs = _gpt_with_grads(), _gpt_with_grads()
    ref = _ref_norm(_grads(ours))
    c = 0.25 * ref  # so that clipping engages
    norm = sg.clip_grad_norm_(ours.parameters(), c)
    torch_norm = torch.nn.utils.clip_grad_norm_(theirs.parameters(), c, foreach=True)
    assert norm.item() == pytest.approx(ref, rel=1e-6)
    assert norm.item() == pytest.approx(torch_norm.item(), rel=1e-6)
    for a, b in zip(_grads(ours), _grads(theirs)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
    clipped = _ref_norm(_grads(ours))
    assert clipped == pytest.approx(c, rel=1e-5)


def test_clip_keeps_the_direction_and_never_scales_up():
    model = _gpt_with_grads()
    before = [g.clone() for g in _grads(model)]
    norm = sg.clip_grad_norm_(model.parameters(), 1e9)
    assert all(torch.equal(a, b) for a, b in zip(before, _grads(model)))
    norm2 = sg.clip_grad_norm_(model.parameters(), 0.5)
    assert norm2 == norm
    scale = 0.5 / (norm.double().item() + 1e-6)
    for a, b in zip(before, _grads(model)):
        torch.testing.assert_close(b.double(), a.double() * scale, rtol=1e-6, atol=1e-12)


def test_healthy_path_reads_nothing_on_the_host():
    model = _gpt_with_grads()
    extras = torch.tensor([2.5, 1.25])
    with no_host_reads():
        stats = sg.grad_stats(model.parameters(), extras=extras)
        coef = stats.clip_(1.0)
        norm = sg.clip_grad_norm_(model.parameters(), 1.0)
    assert norm.item() <= 1.0 + 1e-5 and 0 < coef.item() < 1
    assert torch.equal(stats.extras, extras)


def test_one_nan_element():
    model = _gpt_with_grads()
    n = sum(p.numel() for p in model.parameters())
    _grads(model)[3].view(-1)[7] = float("nan")
    before = _bits(_grads(model))
    stats = sg.grad_stats(model.parameters())
    assert torch.isnan(stats.norm) and not bool(stats.finite)
    assert stats.nonfinite == 1 and stats.nan_frac == 1 / n
    stats.clip_(1.0)
    assert all(torch.equal(a, b) for a, b in zip(before, _bits(_grads(model))))
    assert torch.isnan(stats.exact_norm())


def test_finite_1e20_grads_flag_the_step_and_exact_norm_recovers():
    model = _gpt_with_grads()
    grads = _grads(model)
    n = sum(g.numel() for g in grads)
    for i, g in enumerate(grads):
        g.copy_(torch.randn_like(g) * 1e20 if i % 2 else g)  # mix: overflowing and normal tensors
    assert torch.isinf(torch.nn.utils.get_total_norm(grads))  # torch's own norm overflows
    before = _bits(grads)
    norm = sg.clip_grad_norm_(model.parameters(), 1.0)
    assert torch.isinf(norm)
    assert all(torch.equal(a, b) for a, b in zip(before, _bits(grads)))
    stats = sg.grad_stats(model.parameters())
    assert stats.nonfinite == 0 and stats.nan_frac == 0.0 and stats.numel == n
    exact = stats.exact_norm()
    assert exact.dtype == torch.float64
    assert exact.item() == pytest.approx(_ref_norm(grads), rel=1e-12)


def test_mixed_dtypes_and_empty_inputs():
    a = torch.nn.Parameter(torch.zeros(5, dtype=torch.bfloat16))
    b = torch.nn.Parameter(torch.zeros(3, 4))
    c = torch.nn.Parameter(torch.zeros(7, dtype=torch.float64))
    for p, seed in ((a, 1), (b, 2), (c, 3)):
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)).to(p.dtype)
    ref = _ref_norm([a.grad, b.grad, c.grad])
    assert sg.grad_stats([a, b, c]).norm.item() == pytest.approx(ref, rel=1e-6)
    assert sg.grad_stats([b, c, a]).norm.item() == pytest.approx(ref, rel=1e-6)
    assert sg.grad_stats(b).norm.item() == pytest.approx(_ref_norm([b.grad]), rel=1e-6)
    empty = sg.grad_stats([torch.nn.Parameter(torch.ones(3))], extras=torch.tensor([1.0]))
    assert empty.norm == 0 and empty.numel == 0 and empty.nan_frac == 0.0


def test_bad_input_names_the_field():
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="max_norm="):
            sg.clip_grad_norm_([p], bad)
    with pytest.raises(ValueError, match="extras="):
        sg.grad_stats([p], extras=torch.ones(2, 2))
    with pytest.raises(ValueError, match="pp_group="):
        sg.grad_stats([p], pp_group=object())


def test_matches_cross_entropy_model_of_the_dist_tests():
    from tests._gradnorm_common import Toy, batch

    torch.manual_seed(0)
    model = Toy()
    x, y = batch()
    F.cross_entropy(model(x), y).backward()
    assert sg.grad_stats(model.parameters()).norm.item() == pytest.approx(
        _ref_norm(_grads(model)), rel=1e-6)
    assert sum(p.numel() for p in model.parameters()) == Toy.NUMEL


def test_benchmark_smoke(sub_env):
    out = subprocess.run([sys.executable, "benchmarks/bench_gradnorm.py", "--smoke"], cwd=ROOT,
                         env=sub_env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    found = re.findall(r"^ratio grad_stats\+clip / torch clip_grad_norm_\(foreach=True\): (\S+)x$",
                       out.stdout, flags=re.M)
    assert len(found) == 1, out.stdout
    assert math.isfinite(float(found[0])) and float(found[0]) > 0, out.stdout

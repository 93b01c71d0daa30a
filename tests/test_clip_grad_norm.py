"""sg.clip_grad_norm_ as a drop-in for torch.nn.utils.clip_grad_norm_, one process.

Every case runs torch's own function on an identical copy of the gradients as the reference: each
norm type it supports, foreach True/False/None, a single tensor, empty inputs, error_if_nonfinite
and non-finite gradients, float64 and 16-bit gradients. Under sharding the same cases run in
tests/test_gradnorm_dist.py.
"""

import inspect
import math

import pytest
import torch

import spikeguard as sg
from spikeguard.measure.gradnorm import nonfinite_params

NORM_TYPES = [2.0, 1.0, 3.5, 0.5, math.inf, -math.inf, 0.0, -1.0, -2.0, "inf"]
INF, NAN = math.inf, math.nan


def _params(grads: list[list[float]] | list[torch.Tensor],
            dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    out = []
    for g in grads:
        g = torch.as_tensor(g, dtype=dtype)
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        out.append(p)
    return out


def _random(seed: int = 0, dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    """Tensors of several shapes, one with exact zeros (so 0- and negative norms mean something)."""
    g = torch.Generator().manual_seed(seed)
    grads = [torch.randn(shape, generator=g, dtype=torch.float64) for shape in
             ((17, 5), (64,), (3, 4, 2), (1,))]
    grads.append(torch.zeros(6))
    grads[0][2, 3] = 0.0
    return _params([t.to(dtype) for t in grads], dtype)


def _grads(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    return [p.grad for p in params]


def test_same_signature_as_torch():
    ours = list(inspect.signature(sg.clip_grad_norm_).parameters.values())
    theirs = list(inspect.signature(torch.nn.utils.clip_grad_norm_).parameters.values())
    assert [(p.name, p.default, p.kind) for p in ours[:len(theirs)]] == \
        [(p.name, p.default, p.kind) for p in theirs]
    assert [(p.name, p.kind) for p in ours[len(theirs):]] == \
        [("pp_group", inspect.Parameter.KEYWORD_ONLY), ("tp_group", inspect.Parameter.KEYWORD_ONLY)]


@pytest.mark.parametrize("foreach", [None, True, False])
@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_every_norm_type_matches_torch(norm_type, foreach):
    ours, theirs = _random(), _random()
    ref = float(torch.nn.utils.get_total_norm(_grads(theirs), norm_type))
    max_norm = 0.5 * ref if 0 < ref < INF else 1.0  # so that clipping engages
    want = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type, foreach=foreach)
    got = sg.clip_grad_norm_(ours, max_norm, norm_type, foreach=foreach)
    assert got.dtype == want.dtype == torch.float32
    if float(norm_type) in (INF, -INF, 0.0):  # a max, a min or a count: exact
        assert got.item() == want.item()
    else:
        assert got.item() == pytest.approx(want.item(), rel=1e-6)
    for a, b in zip(_grads(ours), _grads(theirs)):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=0)


def test_norm_zero_is_torch_count_of_nonzero_tensors_and_inf_is_the_max():
    params = _params([[1.0, 0.0, 3.0], [0.0, 0.0], [2.0, -4.0], [0.0, 5.0, 0.0]])
    assert sg.clip_grad_norm_(params, 1e9, 0).item() == 3.0  # three tensors hold a non-zero
    assert sg.clip_grad_norm_(params, 1e9, "inf").item() == 5.0
    assert sg.clip_grad_norm_(params, 1e9, 1).item() == 15.0
    assert sg.clip_grad_norm_(params, 1e9, -INF).item() == 0.0


def test_a_single_tensor_and_the_bare_tensor_form():
    ours, theirs = _random()[0], _random()[0]
    for norm_type in (2.0, INF, 1.0):
        want = torch.nn.utils.clip_grad_norm_(theirs, 0.3, norm_type)
        got = sg.clip_grad_norm_(ours, 0.3, norm_type)
        assert got.item() == pytest.approx(want.item(), rel=1e-6)
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=2e-6, atol=0)


def test_empty_generator_warns_like_torch_and_an_empty_list_does_not():
    with pytest.warns(UserWarning) as theirs:
        want = torch.nn.utils.clip_grad_norm_((p for p in []), 1.0)
    with pytest.warns(UserWarning) as ours:
        got = sg.clip_grad_norm_((p for p in []), 1.0)
    assert [str(w.message) for w in ours] == [str(w.message) for w in theirs]
    assert "empty generator" in str(ours[0].message)
    assert ours[0].filename == theirs[0].filename == __file__  # both point at the caller
    assert got.item() == want.item() == 0.0 and got.dtype == want.dtype
    for norm_type in NORM_TYPES:  # no warning (pytest makes one an error), norm 0 like torch
        assert sg.clip_grad_norm_([], 1.0, norm_type).item() == 0.0
        assert torch.nn.utils.clip_grad_norm_([], 1.0, norm_type).item() == 0.0
    no_grad = torch.nn.Parameter(torch.ones(3))
    assert sg.clip_grad_norm_([no_grad], 1.0).item() == 0.0 and no_grad.grad is None


def _bad_grads(kind: str, value: float) -> list[list[float]]:
    """A finite tensor first, then one holding ``value`` in one or in every element."""
    bad = [1.0, value, -2.0] if kind == "one" else [value, value, value]
    return [[1.0, 0.5], bad]


CASES = [(kind, v) for kind in ("one", "all") for v in (INF, -INF, NAN, 2e22, 2e200)]


@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("kind,value", CASES)
def test_error_if_nonfinite_raises_exactly_where_torch_does(kind, value, norm_type):
    dtype = torch.float64 if value == 2e200 else torch.float32
    ours, theirs = _params(_bad_grads(kind, value), dtype), _params(_bad_grads(kind, value), dtype)
    before = [g.clone() for g in _grads(ours)]
    try:
        want = torch.nn.utils.clip_grad_norm_(theirs, 1.0, norm_type, error_if_nonfinite=True)
    except RuntimeError:
        want = None
    if want is None:
        with pytest.raises(RuntimeError, match="non-finite"):
            sg.clip_grad_norm_(ours, 1.0, norm_type, error_if_nonfinite=True)
        for a, b in zip(before, _grads(ours)):  # raised before clipping
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    else:
        got = sg.clip_grad_norm_(ours, 1.0, norm_type, error_if_nonfinite=True)
        assert got.item() == pytest.approx(want.item(), rel=1e-6)
    # without the flag: the same norm as torch, finite or not
    ours = _params(_bad_grads(kind, value), dtype)
    theirs = _params(_bad_grads(kind, value), dtype)
    got = sg.clip_grad_norm_(ours, 1.0, norm_type)
    want = torch.nn.utils.clip_grad_norm_(theirs, 1.0, norm_type)
    assert got.dtype == want.dtype
    if math.isnan(want.item()):
        assert math.isnan(got.item())
    else:
        assert got.item() == pytest.approx(want.item(), rel=1e-6)


def test_nonfinite_norm_leaves_the_gradients_unchanged_where_torch_scales_them():
    for value in (NAN, INF, 1e20):
        ours, theirs = _params([[1.0, 2.0], [value, 3.0]]), _params([[1.0, 2.0], [value, 3.0]])
        before = [g.clone() for g in _grads(ours)]
        assert not torch.isfinite(sg.clip_grad_norm_(ours, 1.0))
        assert not torch.isfinite(torch.nn.utils.clip_grad_norm_(theirs, 1.0))
        for a, b in zip(before, _grads(ours)):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
        assert not torch.equal(_grads(theirs)[0], before[0])  # torch: zeros or NaN


def test_float64_gradients_are_measured_and_clipped_in_float64():
    ours = _params([[3e39, -4e39], [1.0]], torch.float64)
    theirs = _params([[3e39, -4e39], [1.0]], torch.float64)
    got = sg.clip_grad_norm_(ours, 1.0)
    want = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    assert got.dtype == torch.float64 and got.item() == pytest.approx(5e39, rel=1e-15)
    assert got.item() == pytest.approx(want.item(), rel=1e-15)
    torch.testing.assert_close(_grads(ours)[0], torch.tensor([0.6, -0.8], dtype=torch.float64))
    for a, b in zip(_grads(ours), _grads(theirs)):
        torch.testing.assert_close(a, b, rtol=1e-15, atol=0)
    assert sg.grad_stats(ours).norm.dtype == torch.float64
    mixed = [*_params([[1e39]], torch.float64), *_params([[2.0, 2.0]])]
    stats = sg.grad_stats(mixed)
    assert stats.norm.dtype == torch.float64 and stats.norm.item() == pytest.approx(1e39)
    assert sg.grad_stats(_params([[3.0, 4.0]])).norm.dtype == torch.float32
    for norm_type in (1.0, INF, 0.0):
        assert sg.clip_grad_norm_(_params([[3e39]], torch.float64), 1.0, norm_type).dtype == \
            torch.float64


def test_16bit_gradients_are_measured_in_float32():
    g = torch.Generator().manual_seed(4)
    grads = [torch.randn(50, generator=g).to(torch.bfloat16) for _ in range(3)]
    ours, theirs = _params(grads, torch.bfloat16), _params(grads, torch.bfloat16)
    ref = math.sqrt(sum(float(t.double().square().sum()) for t in grads))
    got = sg.clip_grad_norm_(ours, 0.5 * ref)
    want = torch.nn.utils.clip_grad_norm_(theirs, 0.5 * ref)
    assert got.dtype == torch.float32 and want.dtype == torch.bfloat16
    assert got.item() == pytest.approx(ref, rel=1e-6)
    assert want.item() == pytest.approx(ref, rel=1e-2)  # torch rounds its norm to bf16
    for a, b in zip(_grads(ours), _grads(theirs)):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-3)


def test_foreach_true_on_a_device_without_foreach_kernels_fails_like_torch():
    ours = torch.nn.Parameter(torch.zeros(2, device="meta"))
    ours.grad = torch.ones(2, device="meta")
    with pytest.raises(RuntimeError, match="foreach=True"):
        torch.nn.utils.clip_grad_norm_(ours, 1.0, foreach=True)
    with pytest.raises(RuntimeError, match="foreach=True"):
        sg.clip_grad_norm_(ours, 1.0, foreach=True)


def test_bad_norm_type_and_max_norm_name_the_field():
    p = _params([[1.0]])
    for bad in ("two", None, NAN):
        with pytest.raises(ValueError, match="norm_type="):
            sg.clip_grad_norm_(p, 1.0, bad)
    with pytest.raises(ValueError, match="max_norm=-1.0 .* do not call it"):
        sg.clip_grad_norm_(p, -1.0)


def test_nonfinite_params_names_exactly_the_bad_ones():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    model(torch.ones(2, 3)).sum().backward()
    assert nonfinite_params(model.named_parameters()) == []
    model[0].bias.grad[1] = NAN
    model[1].weight.grad[0, 2] = -INF
    assert nonfinite_params(model.named_parameters()) == ["0.bias", "1.weight"]
    model[0].bias.grad = None
    half = _params([[1.0, INF], [2.0]], torch.bfloat16)  # 16-bit, and an empty grad
    empty = _params([torch.zeros(0)])
    named = [*model.named_parameters(), ("h0", half[0]), ("h1", half[1]), ("e", empty[0])]
    assert nonfinite_params(named) == ["1.weight", "h0"]


def test_no_norm_type_reads_the_device_on_the_host():
    from tests.test_gradnorm import no_host_reads

    for norm_type in NORM_TYPES:
        params = _random()
        with no_host_reads():
            sg.clip_grad_norm_(params, 1.0, norm_type)

"""Reductions, the caller's normaliser and the router z-loss mask, against float64 references
built from torch's own functions (F.cross_entropy, torch.logsumexp, autograd)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from spikeguard.prevent.losses import cross_entropy, linear_cross_entropy, router_z_loss
from tests.dist import run_distributed

ALPHA = 1e-3


def _targets(n: int, v: int, seed: int = 0) -> torch.Tensor:
    t = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(seed))
    t[::5] = -100
    return t


def _ref_tokens(logits: torch.Tensor, t: torch.Tensor, softcap: float | None):
    """Per-token (loss, ce, z term, log Z), 0 at ignored tokens, from torch's functions."""
    c = logits if softcap is None else softcap * torch.tanh(logits / softcap)
    counted = t != -100
    ce = F.cross_entropy(c.flatten(0, -2), t.flatten(), reduction="none").view(t.shape)
    lse = torch.where(counted, torch.logsumexp(c, -1), 0.0)
    z = ALPHA * lse.square()
    return ce + z, ce, z, lse


class _Case:
    """cross_entropy on logits, or linear_cross_entropy on (hidden, weight, bias), float64."""

    def __init__(self, fused: bool, seed: int = 0, batch: int = 3) -> None:
        g = torch.Generator().manual_seed(seed)
        self.fused, self.t = fused, _targets(batch * 40, 70, seed).view(batch, 40)
        if fused:
            self.inputs = (torch.randn(batch, 40, 12, generator=g, dtype=torch.float64),
                           torch.randn(70, 12, generator=g, dtype=torch.float64) * 2,
                           torch.randn(70, generator=g, dtype=torch.float64))
        else:
            self.inputs = (torch.randn(batch, 40, 70, generator=g, dtype=torch.float64) * 3,)
        for x in self.inputs:
            x.requires_grad_()

    def logits(self) -> torch.Tensor:
        return F.linear(*self.inputs) if self.fused else self.inputs[0]

    def ours(self, rows: slice = slice(None), **kw):
        """Our loss on the sequences ``rows``."""
        if self.fused:
            h, w, b = self.inputs
            return linear_cross_entropy(h[rows], w, self.t[rows], bias=b, z_loss=ALPHA,
                                        chunk_size=37, **kw)
        return cross_entropy(self.inputs[0][rows], self.t[rows], z_loss=ALPHA, **kw)


@pytest.mark.parametrize("softcap", [None, 15.0])
@pytest.mark.parametrize("mode", ["sum", "none", "normalizer", "normalizer_tensor"])
@pytest.mark.parametrize("fused", [False, True], ids=["cross_entropy", "linear_cross_entropy"])
def test_reductions_and_normalizer_match_float64_autograd(fused, mode, softcap):
    case = _Case(fused)
    counted = case.t != -100
    ref = _ref_tokens(case.logits(), case.t, softcap)
    norm = 250.0  # e.g. the count of counted tokens over every micro-batch and rank
    if mode == "none":
        out = case.ours(reduction="none", softcap=softcap)
        want = ref
    elif mode == "sum":
        out = case.ours(reduction="sum", softcap=softcap)
        want = (*(r.sum() for r in ref[:3]), ref[3].sum() / counted.sum())
    else:
        n = norm if mode == "normalizer" else torch.tensor(int(norm))  # an int tensor works too
        out = case.ours(normalizer=n, softcap=softcap)
        want = tuple(r.sum() / norm for r in ref)
    for got, w in zip(out, want):
        assert got.shape == w.shape
        torch.testing.assert_close(got.detach(), w.detach(), rtol=1e-10, atol=1e-12)
    assert not any(o.requires_grad for o in out[1:])
    # upstream weights per token: arbitrary with "none", a scalar otherwise
    weights = torch.rand(case.t.shape, dtype=torch.float64) if mode == "none" else 3.0
    grads = torch.autograd.grad((out.loss * weights).sum(), case.inputs)
    ref_grads = torch.autograd.grad((want[0] * weights).sum(), case.inputs)
    for got, w in zip(grads, ref_grads):
        torch.testing.assert_close(got, w, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("fused", [False, True], ids=["cross_entropy", "linear_cross_entropy"])
def test_normalizer_makes_micro_batches_add_up_to_the_global_mean(fused):
    """torchtitan's convention: every micro-batch divides its sum by the step's count of counted
    tokens, so the accumulated loss and gradient are those of one big batch."""
    case = _Case(fused, seed=1)
    case.t[0, 5:] = -100  # the micro-batches hold very different numbers of counted tokens
    whole = case.ours()
    whole.loss.backward()
    want = [x.grad.clone() for x in case.inputs]
    for x in case.inputs:
        x.grad = None
    n_global = (case.t != -100).sum()
    total = naive = 0.0
    for rows in (slice(0, 1), slice(1, 3)):
        part = case.ours(rows, normalizer=n_global)
        part.loss.backward()
        total = total + part.loss.detach()
        naive = naive + case.ours(rows).loss.detach() / 2  # the mean of micro-batch means
    torch.testing.assert_close(total, whole.loss.detach(), rtol=1e-12, atol=0)
    for x, w in zip(case.inputs, want):
        torch.testing.assert_close(x.grad, w, rtol=1e-10, atol=1e-14)
    assert abs(float(naive - whole.loss.detach())) > 1e-3  # the naive average is biased: the test can tell


def _ranks_share_one_normalizer(rank: int, world_size: int) -> list[list]:
    case = _Case(fused=True, seed=2, batch=4)  # same on every rank; each takes 2 sequences
    t, rows = case.t.clone(), slice(rank * 2, rank * 2 + 2)
    t[0, 3:] = -100  # rank 0 counts far fewer tokens than rank 1
    n_global = (t[rows] != -100).sum()
    dist.all_reduce(n_global)  # a tensor: no host read
    h, w, b = case.inputs
    linear_cross_entropy(h[rows], w, t[rows], bias=b, z_loss=ALPHA,
                         normalizer=n_global).loss.backward()
    for x in case.inputs:
        dist.all_reduce(x.grad)  # summed over ranks, as DDP/FSDP do before their own averaging
    return [x.grad.tolist() for x in case.inputs]


@pytest.mark.dist
def test_normalizer_across_two_gloo_ranks_equals_the_global_mean():
    results = run_distributed(_ranks_share_one_normalizer, 2)
    case = _Case(fused=True, seed=2, batch=4)
    case.t[0, 3:] = -100
    out = case.ours()  # the mean over all four sequences, in one process
    want = torch.autograd.grad(out.loss, case.inputs)
    for rank_result in results:
        for got, ref in zip(rank_result, want):
            torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), ref,
                                       rtol=1e-10, atol=1e-14)


def test_zero_normalizer_gives_zeros_and_bad_normalizers_raise():
    case = _Case(fused=True)
    case.t.fill_(-100)  # nothing counted anywhere: the global count is 0
    for n in (0, torch.tensor(0.0, dtype=torch.float64)):
        out = case.ours(normalizer=n)
        assert [float(o.detach()) for o in out] == [0.0] * 4
        grads = torch.autograd.grad(out.loss, case.inputs)
        assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)
    x, t = torch.randn(4, 6), torch.tensor([0, 1, 2, 3])
    for bad, match in ((-1.0, r"normalizer=-1.0 must be a finite number >= 0"),
                       (float("nan"), "normalizer=nan"), (True, "normalizer=True"),
                       (torch.tensor(-2.0), r"normalizer=-2.0 must be a finite"),
                       (torch.ones(2), r"0-d real tensor.*shape \(2,\)"),
                       (torch.tensor(4.0, device="meta"), "normalizer is on meta")):
        with pytest.raises(ValueError, match=match):
            cross_entropy(x, t, normalizer=bad)
    with pytest.raises(ValueError, match="reduction='mean' only"):
        linear_cross_entropy(x, torch.randn(9, 6), t, reduction="sum", normalizer=4)
    with pytest.raises(ValueError, match="reduction='avg'"):
        linear_cross_entropy(x, torch.randn(9, 6), t, reduction="avg")


def test_per_token_log_z_traces_a_spike_to_its_sequence():
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(6, 32, 16, generator=g)
    hidden[4, 20] *= 40  # one token of sequence 4 drives its logits far out
    weight = torch.randn(100, 16, generator=g) * 0.3
    t = torch.randint(0, 100, (6, 32), generator=g)
    out = linear_cross_entropy(hidden, weight, t, reduction="none")
    assert int(out.log_z.mean(1).argmax()) == 4 and int(out.log_z[4].argmax()) == 20
    mean = linear_cross_entropy(hidden, weight, t)
    torch.testing.assert_close(out.loss.mean(), mean.loss, rtol=1e-6, atol=0)


def test_none_recomputes_its_logits_under_the_forwards_autocast():
    torch.manual_seed(4)
    h = torch.randn(96, 16, requires_grad=True)
    w = torch.randn(200, 16, requires_grad=True)
    t = torch.randint(0, 200, (96,))

    def grads(reduction: str, autocast: bool) -> list[torch.Tensor]:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = linear_cross_entropy(h, w, t, chunk_size=40, reduction=reduction)
        return torch.autograd.grad(out.loss.mean(), (h, w))  # backward outside autocast

    mean_bf16, none_bf16 = grads("mean", True), grads("none", True)
    mean_fp32 = grads("mean", False)
    for a, b, c in zip(mean_bf16, none_bf16, mean_fp32):
        assert (a - b).norm() / a.norm() < 2e-6  # same bf16 logits in both passes
        assert (a - c).norm() / a.norm() > 1e-3  # bf16 logits differ visibly from fp32 ones


def test_router_z_loss_mask_is_the_mean_over_real_tokens():
    g = torch.Generator().manual_seed(5)
    r = torch.randn(3, 10, 8, generator=g, dtype=torch.float64)
    mask = torch.rand(3, 10, generator=g) > 0.3
    r[~mask] = float("nan")  # whatever sits in padding stays out
    r.requires_grad_()
    got = router_z_loss(r, mask=mask)
    (grad,) = torch.autograd.grad(got, r)
    real = r.detach()[mask].clone().requires_grad_()
    want = torch.logsumexp(real, -1).square().mean()
    (want_grad,) = torch.autograd.grad(want, real)
    torch.testing.assert_close(got, want.detach())
    torch.testing.assert_close(grad[mask], want_grad)
    assert torch.equal(grad[~mask], torch.zeros_like(grad[~mask]))
    # an integer attention_mask (1 = real token) gives the same
    torch.testing.assert_close(router_z_loss(r, mask=mask.long()), got)
    # all of it real: the unmasked formula
    clean = torch.randn(3, 10, 8, dtype=torch.float64)
    torch.testing.assert_close(router_z_loss(clean, mask=torch.ones(3, 10, dtype=torch.bool)),
                               router_z_loss(clean))


def test_router_z_loss_fully_padded_is_zero_with_zero_grads_and_bad_masks_raise():
    r = torch.randn(2, 5, 4, requires_grad=True)
    out = router_z_loss(r, mask=torch.zeros(2, 5, dtype=torch.bool))
    out.backward()
    assert float(out.detach()) == 0.0 and not out.isnan()
    assert torch.equal(r.grad, torch.zeros_like(r))
    with pytest.raises(ValueError, match=r"mask shape \(2, 4\) must equal"):
        router_z_loss(r, mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="bool or integer tensor"):
        router_z_loss(r, mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match="mask is on meta"):
        router_z_loss(r, mask=torch.ones(2, 5, dtype=torch.bool, device="meta"))


def test_accelerator_path_never_reads_a_value_on_the_host():
    """On a non-CPU device every check is a device assert and every count stays a tensor. Meta
    tensors carry no data, so any host read of a value (.item(), bool(), float()) raises."""
    dev = "meta"
    x = torch.randn(64, 100, device=dev, requires_grad=True)
    t = torch.randint(0, 100, (64,), device=dev)
    h = torch.randn(64, 8, device=dev, requires_grad=True)
    w = torch.randn(100, 8, device=dev, requires_grad=True)
    with pytest.raises(RuntimeError, match="meta"):
        bool(x.sum() > 0)  # the premise: a host read fails here
    n = torch.tensor(50, device=dev)
    for kw in ({}, {"reduction": "sum"}, {"reduction": "none"}, {"normalizer": n},
               {"normalizer": 7}, {"softcap": 30.0}):
        cross_entropy(x, t, **kw).loss.sum().backward()
        linear_cross_entropy(h, w, t, chunk_size=24, **kw).loss.sum().backward()
    r = torch.randn(4, 8, 6, device=dev, requires_grad=True)
    router_z_loss(r, mask=torch.ones(4, 8, dtype=torch.bool, device=dev)).backward()
    assert x.grad.shape == x.shape and w.grad.shape == w.shape and r.grad.shape == r.shape

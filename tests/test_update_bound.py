"""The update bound (guard/update_bound.py): against a float64 reference, its state, its
sharded result against one process, and in a real run (an LR fault bounded, a clean run
untouched)."""

import json
import math
import warnings

import pytest
import torch

import spikeguard as sg
from spikeguard.guard.update_bound import UpdateBound
from spikeguard.prevent.clipping import ClipConfig
from tests.dist import run_distributed

# per step: the update's size relative to the steady one (a 10x jump at step 7, a withheld
# step at 9 that moves nothing)
_SIZES = [1.0, 1.1, 0.9, 1.0, 1.2, 0.95, 1.05, 10.0, 1.0, 0.0, 1.1, 4.0]


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(6, 5, generator=g, dtype=torch.float64)),
            torch.nn.Parameter(torch.randn(7, generator=g, dtype=torch.float64))]


def _move(params, t, size):
    """An 'optimizer step': a drawn direction of RMS 1e-3 x size (in place)."""
    g = torch.Generator().manual_seed(100 + t)
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 1e-3 * size)


def _reference(k, beta, warmup, factors):
    """float64 by hand: the ratio, the bar, the coefficient and the weights of every step."""
    params = [p.detach().clone() for p in _weights()]
    n, ema, coefs = 0, 0.0, []
    for t, size in enumerate(_SIZES):
        before = [p.clone() for p in params]
        _move(params, t, size)
        delta = [a - b for a, b in zip(params, before)]
        moved = math.sqrt(sum(float(d.square().sum()) for d in delta))
        norm = math.sqrt(sum(float(b.square().sum()) for b in before))
        ratio = moved / norm / factors[t]
        coef = 1.0
        if n >= warmup and ratio > k * ema:
            coef = k * ema / ratio
        params = [b + coef * d for b, d in zip(before, delta)]
        if ratio > 0:
            a = beta if n >= warmup else n / (n + 1)
            ema, n = a * ema + (1 - a) * ratio * coef, n + 1
        coefs.append(coef)
    return coefs, params


def test_the_bound_is_the_float64_rule_and_moves_back_along_the_update():
    k, beta, warmup = 3.0, 0.9, 4
    factors = [1.0] * len(_SIZES)
    factors[11] = 4.0  # the guard's own LR factor (a replay's ramp) is divided out: not bounded
    params = _weights()
    bound = UpdateBound(k, beta, warmup, params)
    coefs = []
    for t, size in enumerate(_SIZES):
        bound.before()
        _move(params, t, size)
        coefs.append(float(bound.after(torch.tensor(size == 0.0), factors[t])))
    want, ref = _reference(k, beta, warmup, factors)
    assert coefs == pytest.approx(want, rel=1e-12)
    assert coefs[7] < 0.5 and coefs[11] == 1.0  # the jump bounded, the ramp's step not
    assert sum(c < 1.0 for c in coefs) == 1
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.detach(), r, rtol=0, atol=1e-14)


def test_an_unbounded_step_leaves_the_weights_bit_for_bit():
    params = [torch.nn.Parameter(p.detach().float()) for p in _weights(1)]
    bound = UpdateBound(3.0, 0.98, 1, params)
    for t in range(6):
        bound.before()
        _move(params, t, 1.0)
        moved = [p.detach().clone() for p in params]
        assert float(bound.after()) == 1.0
        assert all(torch.equal(p, m) for p, m in zip(params, moved))


def test_state_round_trip_continues_as_if_never_saved():
    params = _weights()
    bound = UpdateBound(3.0, 0.9, 3, params)
    for t, size in enumerate(_SIZES[:6]):
        bound.before()
        _move(params, t, size)
        bound.after()
    state = json.loads(json.dumps(bound.state_dict()))
    assert set(state) == {"n", "ema"} and state["n"] == 6.0 and state["ema"] > 0
    twin_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    twin = UpdateBound(3.0, 0.9, 3, twin_params)
    twin.load_state_dict(state)
    for t, size in enumerate(_SIZES[6:], start=6):
        out = []
        for b, ps in ((bound, params), (twin, twin_params)):
            b.before()
            _move(ps, t, size)
            out.append(float(b.after(torch.tensor(size == 0.0))))
        assert out[0] == out[1]
    with pytest.raises(ValueError, match="expected n and ema"):
        twin.load_state_dict({"mean": 1.0})


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="update_bound=0.5 must be 0 .off. or a number above 1"):
        ClipConfig(update_bound=0.5)
    with pytest.raises(ValueError, match="update_beta=1.0 must be in"):
        ClipConfig(update_beta=1.0)
    model = sg.GPT(sg.GPTConfig.tiny(seq_len=16))
    opt = torch.optim.AdamW(model.parameters())
    guard = sg.Guard(model, opt, config=sg.GuardConfig(clipping=ClipConfig(update_bound=3.0)))
    x = torch.randint(0, 256, (2, 16))
    with pytest.raises(ValueError, match="decide.. with ClipConfig.update_bound"):
        guard.decide(model.loss(model(x), x))


def test_the_guard_checkpoints_the_bound_with_its_state():
    cfg = sg.GuardConfig(clipping=ClipConfig(update_bound=3.0, warmup=2))
    torch.manual_seed(0)
    model = sg.GPT(sg.GPTConfig.tiny(seq_len=16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    guard = sg.Guard(model, opt, config=cfg)
    x = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    for _ in range(4):
        out = model.loss(model(x[:, :-1]), x[:, 1:])
        out.loss.backward()
        guard.step(out)
    state = json.loads(json.dumps(guard.state_dict()))
    bound = state["updater"]["update_bound"]  # the step part's state owns the bound's
    assert bound["n"] == 4.0 and bound["ema"] > 0
    other = sg.Guard(model, opt, config=cfg)
    other.load_state_dict(state)
    assert other.updater.bound.state_dict() == bound


def _train(tmp_path, name, bound, inject=()):
    from spikeguard.guard import GuardConfig
    from spikeguard.train import TrainConfig, train

    out = tmp_path / name
    cfg = TrainConfig(model="tiny", steps=80, batch_size=8, lr=3e-3, seed=0, inject=inject,
                      guard=GuardConfig(respond=False, clip=1.0,
                                        clipping=ClipConfig(update_bound=bound)),
                      out=str(out), progress=False, plot=False)
    result = train(cfg, echo=False)
    with open(out / "metrics.jsonl") as f:
        return result, [json.loads(line) for line in f]


def test_an_lr_fault_is_bounded_and_a_clean_run_is_untouched(tmp_path, one_thread):
    """LR x50 for 10 steps: gradient clipping alone cannot hold it (Adam's step ignores the
    gradient's scale); the bound moves every faulty update back, and the run ends better.
    The clean run with the bound is the clean run without it, bit for bit."""
    fault = ("lr@50:50:10",)
    free, free_recs = _train(tmp_path, "free", 0.0, fault)
    held, recs = _train(tmp_path, "held", 3.0, fault)
    bounded = [r["step"] for r in recs if r["update_coef"] < 1.0]
    assert bounded == list(range(50, 60))
    assert all("update_coef" not in r for r in free_recs)
    assert held.val_loss < free.val_loss - 0.05
    clean_free, _ = _train(tmp_path, "clean-free", 0.0)
    clean, clean_recs = _train(tmp_path, "clean", 3.0)
    assert all(r["update_coef"] == 1.0 for r in clean_recs)
    assert clean.val_loss == clean_free.val_loss


def _sharded_bound(rank, world):
    """The bound's coefficients and final weights: FSDP2 shards and TP DTensors against the
    same model whole (plain replicated weights on every rank)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from tests.test_signals import laid_out_model

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out = {}
    for kind in ("one", "fsdp", "tp"):
        model = laid_out_model(kind, mesh)
        params = list(model.parameters())
        opt = torch.optim.AdamW(params, lr=1e-3, foreach=False)
        bound = UpdateBound(3.0, 0.9, 2, params)
        coefs = []
        for t in range(5):
            g = torch.Generator().manual_seed(t)
            for p in params:  # drawn gradients, the same on every rank
                full = torch.randn(p.shape, generator=g) * 0.01
                p.grad = distribute_tensor(full, p.device_mesh, p.placements) \
                    if hasattr(p, "device_mesh") else full
            for group in opt.param_groups:
                group["lr"] = 1e-3 * (20.0 if t == 4 else 1.0)  # the fault at the last step
            bound.before()
            opt.step()
            coefs.append(float(bound.after()))
            opt.zero_grad(set_to_none=True)
        out[kind] = {"coefs": coefs, "weights": [
            (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for p in params]}
    one = out["one"]
    return {kind: {"coefs": out[kind]["coefs"], "coefs_one": one["coefs"],
                   "diff": max(float((a - b).abs().max())
                               for a, b in zip(one["weights"], out[kind]["weights"]))}
            for kind in ("fsdp", "tp")}


def test_sharded_bound_equals_one_process():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        results = run_distributed(_sharded_bound, 2)
    for result in results:
        for kind, r in result.items():
            assert r["coefs_one"][4] < 1.0, kind  # the fault's step is bounded
            assert r["coefs"] == pytest.approx(r["coefs_one"], rel=1e-5), kind
            assert r["diff"] < 2e-6, (kind, r["diff"])
    assert results[0] == results[1]  # every rank the same numbers

import math
from pathlib import Path

import pytest
import torch

import spikeguard as sg
from spikeguard.guard.step import apply_update
from spikeguard.measure.fp8 import AmaxMonitor, Fp8HeadroomWarning, fp8_eligible
from spikeguard.measure.precision import PrecisionPolicy


# ---------------------------------------------------------------- fp8 amax monitor
def _expected_warnings(series, history_len=16, margin=0, below=0.5):
    out = []
    for t, a in enumerate(series):
        hist = series[max(0, t - history_len):t]
        if hist and 2.0**margin * max(hist) / a < below:
            out.append(t)
    return out


def test_fp8_warnings_fire_exactly_where_headroom_drops_under_half():
    gen = torch.Generator().manual_seed(0)
    series = (1.0 + 0.2 * torch.rand(80, generator=gen, dtype=torch.float64)).tolist()
    series[20] = 2.5     # 2.5 / max(1.2) > 2: warns
    series[40] = 2.3     # within 16 steps of the 2.5: history max 2.5, no warning
    series[60] = 2.39    # 2.39 / 1.2 < 2: just under the line, no warning
    series[70] = 9.0     # warns
    expected = _expected_warnings(series)
    assert expected == [20, 70]
    mon = AmaxMonitor()
    with pytest.warns(Fp8HeadroomWarning) as record:
        heads = [mon.update(t, "mlp.fc", a) for t, a in enumerate(series)]
    assert [e.step for e in mon.events] == expected
    assert len(record) == len(expected)
    assert math.isinf(heads[0])
    for t in range(1, len(series)):  # headroom_t = max(history) / amax_t at margin 0
        ref = max(series[max(0, t - 16):t]) / series[t]
        assert heads[t] == pytest.approx(ref, rel=1e-12)
    assert mon.scale("mlp.fc") == pytest.approx(448.0 / max(series[-16:]))


def test_fp8_margin_and_format():
    mon = AmaxMonitor(margin=1, fmt="e5m2")
    mon.update(0, "x", 1.0)
    assert mon.scale("x") == 57344.0 / 2.0
    # margin 1 doubles the headroom: 2.5x the history is 0.8, no warning
    assert mon.update(1, "x", 2.5) == pytest.approx(0.8)
    assert mon.events == []
    with pytest.raises(ValueError, match="fmt='e3m4'"):
        AmaxMonitor(fmt="e3m4")


def test_fp8_eligibility_keeps_norms_embeddings_head_and_router_out():
    model = sg.GPT(sg.GPTConfig.tiny(tie_embeddings=False))
    names = {n for n, m in model.named_modules() if fp8_eligible(n, m)}
    assert "blocks.0.mlp.fc" in names and "blocks.1.attn.qkv" in names
    assert not any(k in n for n in names for k in ("wte", "lm_head", "ln"))
    assert not fp8_eligible("moe.router", torch.nn.Linear(64, 64))
    assert not fp8_eligible("mlp.odd", torch.nn.Linear(64, 30))


def test_fp8_hook_reads_input_amax_once_per_step():
    torch.manual_seed(0)
    model = sg.GPT(sg.GPTConfig.tiny())
    mon = AmaxMonitor()
    seen = {}
    mon.hook(model)
    model.blocks[0].mlp.fc.register_forward_pre_hook(
        lambda m, a: seen.__setitem__("fc", float(a[0].detach().abs().max())))
    model(torch.randint(0, 256, (2, 8)))
    rec = mon.flush(0)
    assert mon.last["blocks.0.mlp.fc"]["amax"] == pytest.approx(seen["fc"])
    assert math.isinf(rec["fp8_headroom_min"])
    model(torch.randint(0, 256, (2, 8)))
    assert math.isfinite(mon.flush(1)["fp8_headroom_min"])


# ---------------------------------------------------------------- fp16 / GradScaler
def _fp16_step(model, policy, opt, x, y, *, plant_inf=False, skip=False, detector=None, step=0):
    """One fp16 step; with a detector, its verdict decides the skip and is returned."""
    opt.zero_grad(set_to_none=True)
    with policy.autocast():
        loss = model.loss(model(x), y).loss
    policy.scale(loss).backward()
    if plant_inf:
        model.blocks[0].mlp.fc.weight.grad[0, 0] = float("inf")
    policy.unscale_(opt)
    verdict = None
    if detector is not None:
        grads = [p.grad for p in model.parameters()]
        norm = torch.nn.utils.get_total_norm(grads)
        bad = sum(int((~torch.isfinite(g)).sum()) for g in grads)
        verdict = detector.update(sg.StepMetrics(
            step=step, loss=float(loss.detach()), grad_norm=float(norm),
            nan_frac=bad / sum(g.numel() for g in grads), grad_scale=policy.grad_scale()))
        skip = verdict.skip
    apply_update(policy, opt, skip=skip)
    return verdict


def _fp16_setup(init_scale):
    torch.manual_seed(0)
    model = sg.GPT(sg.GPTConfig.tiny())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    policy = PrecisionPolicy(kind="fp16-mixed", init_scale=init_scale).runtime(model)
    return model, opt, policy, torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))


def _snapshot(model):
    return [p.detach().clone() for p in model.parameters()]


def test_fp16_planted_overflow_is_skipped_by_the_scaler_and_the_scale_halves():
    model, opt, policy, x, y = _fp16_setup(2.0**10)
    _fp16_step(model, policy, opt, x, y)
    assert policy.grad_scale() == 2.0**10
    before, steps = _snapshot(model), [s["step"].clone() for s in opt.state.values()]
    _fp16_step(model, policy, opt, x, y, plant_inf=True)
    assert policy.grad_scale() == 2.0**9
    for a, b in zip(before, _snapshot(model)):
        assert torch.equal(a, b)
    assert all(torch.equal(a, s["step"]) for a, s in zip(steps, opt.state.values()))


def test_guard_skip_merges_with_the_scaler_without_touching_the_scale():
    model, opt, policy, x, y = _fp16_setup(2.0**10)
    _fp16_step(model, policy, opt, x, y)
    before = _snapshot(model)
    _fp16_step(model, policy, opt, x, y, skip=True)  # a spike skip: no overflow
    assert policy.grad_scale() == 2.0**10
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(model)))
    _fp16_step(model, policy, opt, x, y)
    assert not all(torch.equal(a, b) for a, b in zip(before, _snapshot(model)))


def _cpu_flags() -> set[str]:
    """The CPU feature flags the Linux kernel reports (empty elsewhere)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return set()
    return next((set(ln.split(":", 1)[1].split()) for ln in lines if ln.startswith("flags")), set())


def test_policy_dtypes_and_validation():
    assert PrecisionPolicy(kind="fp32").runtime("cpu").autocast().__class__.__name__ == "nullcontext"
    assert PrecisionPolicy(kind="fp16-mixed").compute_dtype("cpu") == torch.float16
    for kind in ("bf16-mixed", "fp16-mixed", "fp32"):  # the dtype a matmul really runs in
        rt = PrecisionPolicy(kind=kind).runtime("cpu")
        with rt.autocast():
            out = torch.ones(4, 8) @ torch.ones(8, 2)
        assert out.dtype == rt.compute_dtype == PrecisionPolicy(kind=kind).compute_dtype("cpu")
    if {"avx512bw", "avx512vl", "avx512dq"} <= _cpu_flags():  # x86 with oneDNN's bf16 kernels
        assert PrecisionPolicy().compute_dtype("cpu") == torch.bfloat16
    mp = PrecisionPolicy().fsdp_mp_policy()
    assert (mp.param_dtype, mp.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert PrecisionPolicy(kind="fp32").fsdp_mp_policy() is None
    with pytest.raises(ValueError, match="kind='fp8'"):
        PrecisionPolicy(kind="fp8")
    with pytest.raises(ValueError, match="init_scale"):
        PrecisionPolicy(kind="fp16-mixed", init_scale=0)


def test_bf16_accumulator_loses_small_grads_fp32_keeps_them():
    contribs = [1.0] + [1e-3] * 64
    ref = math.fsum(contribs)
    acc32 = torch.zeros((), dtype=torch.float32)
    acc16 = torch.zeros((), dtype=torch.bfloat16)
    for c in contribs:
        acc32 += c
        acc16 += c
    assert abs(float(acc32) - ref) < 1e-5
    assert abs(float(acc16) - ref) > 0.05  # bf16 spacing at 1.0 is 2^-7: every 1e-3 is absorbed


# ---------------------------------------------------------------- fp16 + the spike detector
def test_fp16_overflow_is_a_scaler_skip_not_a_spike_and_ten_in_a_row_halt():
    model, opt, policy, x, y = _fp16_setup(2.0**16)
    detector = sg.SpikeDetector(sg.DetectorConfig())
    for step in range(3):
        v = _fp16_step(model, policy, opt, x, y, detector=detector, step=step)
        assert v.action == sg.Action.CONTINUE
    before = _snapshot(model)
    v = _fp16_step(model, policy, opt, x, y, plant_inf=True, detector=detector, step=3)
    assert (v.tier, v.action, tuple(v.reasons)) == (0, sg.Action.SKIP, ("scaler",))
    assert policy.grad_scale() == 2.0**15
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(model)))
    v = _fp16_step(model, policy, opt, x, y, detector=detector, step=4)
    assert v.action == sg.Action.CONTINUE and v.tier == 0  # the overflow was no Tier 3
    verdicts = [_fp16_step(model, policy, opt, x, y, plant_inf=True, detector=detector,
                           step=5 + i)
                for i in range(10)]
    assert all(v.tier == 0 and v.action == sg.Action.SKIP for v in verdicts[:9])
    assert (verdicts[9].tier, verdicts[9].action) == (3, sg.Action.HALT)
    assert policy.grad_scale() == 2.0**5

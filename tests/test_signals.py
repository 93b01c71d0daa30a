"""The early-warning signals (measure/signals.py) against float64 references, and sharded."""

import dataclasses
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import spikeguard as sg
from spikeguard.measure.gradnorm import grad_stats
from spikeguard.measure.probes import ProbeConfig, Probes
from spikeguard.measure.signals import SignalConfig, layer_of, sample_stride
from spikeguard.prevent.clipping import ClipConfig, Clipper
from tests.dist import run_distributed

EVERY = SignalConfig(update_ratio_every=1, spike_share_every=1, logit_bound_every=1, spike_k=3.0)


def _batch(seed=0, b=2, t=16):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, t), generator=g), torch.randint(0, 256, (b, t), generator=g)


def _run(model, opt, probes, steps=3, seed=0, hook=None):
    records = []
    for t in range(steps):
        probes.start_step(t)
        x, y = _batch(seed + t)
        model.loss(model(x), y).loss.backward()
        if hook is not None:
            hook(t)
        opt.step()
        records.append(probes.collect())
        opt.zero_grad(set_to_none=True)
    return records


def _sampled(n, s):
    """The sampled elements of a flat tensor of n at stride s: index i with (i // 16) % s == 0,
    below the last whole period of 16 s (every element at stride 1)."""
    i = torch.arange(n)
    return torch.ones(n, dtype=torch.bool) if s == 1 else ((i // 16) % s == 0) & (
        i < n // (16 * s) * 16 * s)


@pytest.mark.parametrize("stride", [1, 64])
def test_update_ratio_and_spike_share_equal_float64_references(stride):
    """stride 1: every element, against float64 readings of whole tensors; the default 64: the
    float64 readings of the sampled elements (``_sampled``: blocks of 16, one in every s of the
    flat tensor; sums and counts times s), and within 10% (the spike share within 0.02) of the
    whole tensors'."""
    torch.manual_seed(0)
    model = sg.GPT(sg.GPTConfig.tiny())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    signals = dataclasses.replace(EVERY, sample_stride=stride)
    probes = Probes(model, ProbeConfig(activation_max=False, layer_grad_norms=False,
                                       signals=signals), optimizer=opt)
    named = list(model.named_parameters())

    def before(t):  # float64: the weights, and the spike test on the gradient and v
        before.w = [p.detach().double().clone() for _, p in named]
        hits = total = sampled_hits = sampled_total = 0
        for _, p in named:
            v = opt.state.get(p, {}).get("exp_avg_sq")
            if v is not None:
                hit = (p.grad.double() ** 2 > 3.0 * v.double()).reshape(-1)
                hits, total = hits + int(hit.sum()), total + p.numel()
                k = sample_stride(tuple(p.shape), stride)
                sampled_hits += k * int(hit[_sampled(hit.numel(), k)].sum())
                sampled_total += k * int(_sampled(hit.numel(), k).sum())
        before.spike = hits / max(total, 1)
        before.sampled_spike = sampled_hits / max(sampled_total, 1)

    records = []
    for t in range(3):
        probes.start_step(t)
        x, y = _batch(t)
        model.loss(model(x), y).loss.backward()
        before(t)
        w0, spike, sampled_spike = before.w, before.spike, before.sampled_spike
        opt.step()
        rec = probes.collect()
        opt.zero_grad(set_to_none=True)
        groups: dict[str, list[int]] = {}
        for i, (n, _) in enumerate(named):
            groups.setdefault(layer_of(n), []).append(i)
        for g, idx in groups.items():
            moved = [(named[i][1].detach().double() - w0[i]).reshape(-1) for i in idx]
            w = [w0[i].reshape(-1) for i in idx]
            whole = math.sqrt(sum(float((m ** 2).sum()) for m in moved)
                              / sum(float((x ** 2).sum()) for x in w))
            k = [sample_stride(tuple(named[i][1].shape), stride) for i in idx]
            keep = [_sampled(m.numel(), s) for s, m in zip(k, moved)]
            sampled = math.sqrt(sum(s * float((m[i] ** 2).sum()) for s, m, i in zip(k, moved, keep))
                                / sum(s * float((x[i] ** 2).sum()) for s, x, i in zip(k, w, keep)))
            assert rec[f"update_ratio/{g}"] == pytest.approx(sampled, rel=1e-5), (t, g)
            assert rec[f"update_ratio/{g}"] == pytest.approx(whole, rel=1e-5 if stride == 1
                                                             else 0.1), (t, g)
        assert rec["update_ratio"] == max(rec[f"update_ratio/{g}"] for g in groups)
        assert rec["spike_share"] == pytest.approx(sampled_spike, abs=1e-6)
        assert rec["spike_share"] == pytest.approx(spike, abs=1e-6 if stride == 1 else 0.02)
        records.append(rec)
    assert records[0]["spike_share"] == 0.0  # no second moment before the first step
    assert 0.0 < records[1]["spike_share"] < 1.0


def _max_logit(model, x):
    """Largest |scale q.k| over every layer, head and visible pair, recomputed from the blocks'
    inputs (an independent forward of the attention scores)."""
    seen = []
    hooks = [b.ln1.register_forward_hook(lambda m, a, out: seen.append(out.detach()))
             for b in model.blocks]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    best = 0.0
    torch.set_grad_enabled(False)
    try:
        best = _scores_max(model, seen)
    finally:
        torch.set_grad_enabled(True)
    return best


def _scores_max(model, seen):
    best = 0.0
    for blk, xin in zip(model.blocks, seen):
        cfg, attn = model.cfg, blk.attn
        hd, h, hkv = cfg.head_dim, cfg.n_head, cfg.kv_heads
        qkv = F.linear(xin.double(), attn.qkv.weight.double())
        q, k, _ = qkv.split((h * hd, hkv * hd, hkv * hd), dim=-1)
        q = q.view(*q.shape[:2], h, hd).transpose(1, 2)
        k = k.view(*k.shape[:2], hkv, hd).transpose(1, 2).repeat_interleave(h // hkv, dim=1)
        if attn.qk_norm is not None:
            q = F.rms_norm(q, (hd,), attn.qk_norm.q_weight.double(), attn.qk_norm.eps)
            k = F.rms_norm(k, (hd,), attn.qk_norm.k_weight.double(), attn.qk_norm.eps)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        t = s.shape[-1]
        s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), 0.0)
        best = max(best, float(s.abs().max()))
    return best


@pytest.mark.parametrize("knobs", [dict(n_head=4, n_kv_head=2), dict(qk_norm=True, pos="rope")])
def test_logit_bound_is_never_below_the_measured_max_logit(knobs):
    torch.manual_seed(1)
    model = sg.GPT(sg.GPTConfig.tiny(**knobs))
    with torch.no_grad():  # make the logits large: scale the query/key rows and the gains
        qk_rows = model.cfg.d_model + model.cfg.kv_heads * model.cfg.head_dim
        for i, blk in enumerate(model.blocks):
            blk.attn.qkv.weight[:qk_rows].mul_(6.0 + 4 * i)
            blk.ln1.weight.uniform_(0.5, 3.0)
            blk.ln1.bias.normal_(0.0, 0.5)
            if blk.attn.qk_norm is not None:
                blk.attn.qk_norm.q_weight.uniform_(0.5, 4.0)
                blk.attn.qk_norm.k_weight.uniform_(0.5, 4.0)
    probes = Probes(model, ProbeConfig(activation_max=False, layer_grad_norms=False,
                                       signals=EVERY))
    probes.start_step(0)
    rec = probes.collect()
    bound = rec["attn_logit_bound"]
    heads = rec["attn_logit_bound_heads"]
    assert len(heads) == model.cfg.n_layer and len(heads[0]) == model.cfg.n_head
    measured = max(_max_logit(model, _batch(s, b=4, t=64)[0]) for s in range(2))
    # an input made of one repeated token maximises alignment of queries and keys
    measured = max(measured, *(_max_logit(model, torch.full((1, 64), tok))
                               for tok in range(0, 256, 51)))
    assert bound >= measured > 1.0
    _check_formula(model, heads)


def test_the_logit_bound_of_a_float64_model_is_its_float64_formula():
    """A float64 model's rows are normed in float64 (they were asked for float32, which torch
    refuses for a float64 input: a guard on a float64 model raised at its first bound)."""
    torch.manual_seed(2)
    model = sg.GPT(sg.GPTConfig.tiny(n_head=4, n_kv_head=2)).double()
    probes = Probes(model, ProbeConfig(activation_max=False, layer_grad_norms=False,
                                       signals=EVERY))
    probes.start_step(0)
    _check_formula(model, probes.collect()["attn_logit_bound_heads"])


@torch.no_grad()
def _check_formula(model, heads):
    """The float64 formula, layer 0: QK-norm gains, or the rows' norms and ln1's gain and bias."""
    cfg, blk = model.cfg, model.blocks[0]
    hd = cfg.head_dim
    if blk.attn.qk_norm is not None:
        ref = (hd / math.sqrt(hd) * float(blk.attn.qk_norm.q_weight.double().norm(32))
               * float(blk.attn.qk_norm.k_weight.double().norm(32)))
        assert heads[0] == pytest.approx([ref] * cfg.n_head, rel=1e-6)
    else:
        w = blk.attn.qkv.weight.double()
        x = (float(blk.ln1.weight.double().norm(32)) * math.sqrt(cfg.d_model)
             + float(blk.ln1.bias.double().norm()))
        kv = cfg.n_head // cfg.kv_heads
        ref = [float(w[h * hd:(h + 1) * hd].norm()) * float(
            w[cfg.d_model + (h // kv) * hd:cfg.d_model + (h // kv + 1) * hd].norm()) * x * x
               / math.sqrt(hd) for h in range(cfg.n_head)]
        assert heads[0] == pytest.approx(ref, rel=1e-5)


def test_signal_intervals_and_a_step_without_update():
    torch.manual_seed(0)
    model = sg.GPT(sg.GPTConfig.tiny())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = SignalConfig(update_ratio_every=2, spike_share_every=3, logit_bound_every=0)
    probes = Probes(model, ProbeConfig(activation_max=False, layer_grad_norms=False,
                                       signals=cfg), optimizer=opt)
    recs = _run(model, opt, probes, steps=4)
    assert [("update_ratio" in r) for r in recs] == [True, False, True, False]
    assert [("spike_share" in r) for r in recs] == [True, False, False, True]
    assert not any("attn_logit_bound" in r for r in recs)
    probes.start_step(4)  # a step whose optimizer never ran (a skip off the fused path)
    assert probes.collect()["update_ratio"] == 0.0
    with pytest.raises(ValueError, match="spike_k"):
        SignalConfig(spike_k=0.0)
    with pytest.raises(ValueError, match="sample_stride"):
        SignalConfig(sample_stride=0)


def test_the_update_ratio_sample_crosses_every_column_and_keeps_enough_elements():
    for shape in [(384, 1152), (256, 64), (64,), (1000,), (50304, 768), (7, 13), (96, 100)]:
        n, s = math.prod(shape), sample_stride(shape, 64)
        keep = _sampled(n, s)
        assert 1 <= s <= 64 and int(keep.sum()) >= min(n, 1024) * 0.98, (shape, s)
        cols = set((torch.nonzero(keep).reshape(-1) % shape[-1]).tolist())
        assert len(cols) == shape[-1], shape  # every column sampled
    assert sample_stride((384, 1152), 64) == 61  # 64, 63, 62 x 16 share 1024, 144, 32 with 1152


def _sharded_signals(rank, world):
    out = {}
    for kind in ("plain", "fsdp"):
        model = laid_out_model(kind)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=False)
        # QK-Clip on too (below the start's bounds, so it rescales): the sharded rows and gains
        signals = dataclasses.replace(EVERY, qk_clip=6.0)
        probes = Probes(model, ProbeConfig(activation_max=False, layer_grad_norms=False,
                                           signals=signals), optimizer=opt)
        calls: list[int] = []
        real = torch.distributed.all_reduce

        def spy(t, *a, calls=calls, real=real, **k):
            calls.append(t.numel())
            return real(t, *a, **k)

        recs = []
        for t in range(3):
            probes.start_step(t)
            x, y = _batch(t)  # the same batch on every rank: the mean gradient is one rank's
            model.loss(model(x), y).loss.backward()
            opt.step()
            torch.distributed.all_reduce = spy
            try:
                recs.append(probes.collect())
            finally:
                torch.distributed.all_reduce = real
            opt.zero_grad(set_to_none=True)
        out[kind] = (recs, len(calls))
    return out


def _sharded_clip(rank, world):
    from torch.distributed.fsdp import fully_shard

    out = {}
    for mode in ("zscore", "adagc", "spam"):
        finals = {}
        for kind in ("one", "fsdp"):
            torch.manual_seed(0)
            model = sg.GPT(sg.GPTConfig.tiny())
            if kind == "fsdp":
                for block in model.blocks:
                    fully_shard(block)
                fully_shard(model)
            params = list(model.parameters())
            opt = torch.optim.AdamW(params, lr=1e-2, foreach=False)
            clipper = Clipper(ClipConfig(clip_mode=mode, warmup=2, spam_k=2.0), 0.5, params)
            for t in range(3):
                g = torch.Generator().manual_seed(t)
                x = torch.randint(0, 256, (4, 33), generator=g)  # the same batch on each rank
                model.loss(model(x[:, :-1]), x[:, 1:]).loss.backward()
                # "one": plain replicated weights, each rank the whole model (one process's
                # numbers: the all-reduce adds two halves of the same share)
                with warnings.catch_warnings():  # "plain gradients treated as replicated": yes
                    warnings.simplefilter("ignore", UserWarning)
                    stats = grad_stats(params, per_tensor=clipper.per_tensor)
                clipper.clip_(stats, opt, torch.zeros((), dtype=torch.bool))
                opt.step()
                opt.zero_grad(set_to_none=True)
            finals[kind] = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
                            for p in params]
        out[mode] = max(float((a - b).abs().max()) for a, b in zip(finals["one"], finals["fsdp"]))
    return out


def laid_out_model(kind, mesh=None):
    """The tiny GQA model (seed 0): whole ("plain", "whole", "one"), FSDP2-sharded block by
    block ("fsdp"), or Megatron-style TP DTensors on ``mesh`` ("tp")."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    torch.manual_seed(0)
    model = sg.GPT(sg.GPTConfig.tiny(n_head=4, n_kv_head=2))
    if kind == "fsdp":
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    elif kind == "tp":
        for name, mod in list(model.named_modules()):
            for pname, p in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(pname, torch.nn.Parameter(distribute_tensor(
                    p.detach(), mesh, [_tp_place(name, pname)])))
    return model


def _tp_place(module_name, param_name):
    from torch.distributed.tensor import Replicate, Shard

    if param_name == "weight" and module_name.endswith(("qkv", "fc")):
        return Shard(0)  # column-parallel: the q, k, v heads' rows split across the ranks
    if param_name == "weight" and module_name.endswith(("attn.proj", "mlp.proj")):
        return Shard(1)  # row-parallel
    return Replicate()


def _tensor_parallel_signals(rank, world):
    """The signals of weights and gradients laid out as Megatron-style TP DTensors equal those
    of the same tensors whole (no forward: the gradients are drawn, the same on every rank)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out = {}
    for kind in ("whole", "tp"):
        model = laid_out_model(kind, mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=False)
        probes = Probes(model, ProbeConfig(activation_max=False, layer_grad_norms=False,
                                           signals=EVERY), optimizer=opt)
        recs = []
        for t in range(2):
            probes.start_step(t)
            g = torch.Generator().manual_seed(t)
            for p in model.parameters():
                full = torch.randn(p.shape, generator=g) * 0.01
                p.grad = distribute_tensor(full, mesh, p.placements) if kind == "tp" else full
            opt.step()
            recs.append(probes.collect())
            opt.zero_grad(set_to_none=True)
        out[kind] = recs
        out[f"clip/{kind}"] = _clip_grads(model, mesh if kind == "tp" else None)
    whole, tp = out.pop("clip/whole"), out.pop("clip/tp")  # tensors do not cross the queue
    out["clip_diff"] = {mode: max(float(((b - a).abs() / (a.abs() + 1e-6)).max())
                                  for a, b in zip(whole[mode], tp[mode])) for mode in whole}
    return out


def _clip_grads(model, mesh):
    """Each clipping mode's gradients (gathered whole) for drawn gradients, one step after a
    first that gives the optimizer its moments and the rules their statistics."""
    from torch.distributed.tensor import distribute_tensor

    params = list(model.parameters())
    out = {}
    for mode in ("zscore", "adagc", "spam"):
        opt = torch.optim.AdamW(params, lr=1e-3, foreach=False)
        clipper = Clipper(ClipConfig(clip_mode=mode, warmup=1, spam_k=2.0), 0.5, params)
        for t in range(2):
            g = torch.Generator().manual_seed(10 + t)
            for p in params:
                full = torch.randn(p.shape, generator=g) * (0.01 if t == 0 else 0.05)
                p.grad = full if mesh is None else distribute_tensor(full, mesh, p.placements)
            drawn = [p.grad.clone() for p in params]
            clipper.clip_(grad_stats(params, per_tensor=clipper.per_tensor), opt,
                          torch.zeros((), dtype=torch.bool))
            if t == 0:
                opt.step()
        assert not all(torch.equal(p.grad, d) for p, d in zip(params, drawn)), mode  # it clipped
        out[mode] = [(p.grad.full_tensor() if mesh is not None else p.grad).clone()
                     for p in params]
        opt.zero_grad(set_to_none=True)
    return out


def _sharded(rank, world):
    with warnings.catch_warnings():  # "plain gradients treated as replicated": they are
        warnings.simplefilter("ignore", UserWarning)
        tp = _tensor_parallel_signals(rank, world)
    return {"signals": _sharded_signals(rank, world), "clip": _sharded_clip(rank, world),
            "tp": tp}


def test_sharded_and_tensor_parallel_signals_and_clipping_equal_one_process():
    """FSDP2 and tensor parallelism against one process, the signals and the clipping modes, in
    one spawn (tests/test_clipping.py tests the clipping rules themselves)."""
    results = run_distributed(_sharded, 2)
    for result in results:
        for mode, diff in result["clip"].items():
            assert diff < 2e-5, (mode, diff)  # fp32 rounding of sharded vs whole AdamW, no more
        for w, p in zip(result["tp"]["whole"], result["tp"]["tp"]):
            assert set(w) == set(p) and p["spike_share"] >= 0.0
            for key in w:
                flat = (lambda v: [x for row in v for x in row]) if key.endswith("_heads") else (
                    lambda v: v)
                assert flat(p[key]) == pytest.approx(flat(w[key]), rel=1e-5, abs=1e-9), key
        assert result["tp"]["tp"][1]["spike_share"] > 0.0  # the test had elements to count
        for mode, diff in result["tp"]["clip_diff"].items():  # relative, element by element
            assert diff < 1e-4, (mode, diff)
    results = [r["signals"] for r in results]
    for rank in results:
        plain, _ = rank["plain"]
        fsdp, calls = rank["fsdp"]
        assert calls == 3  # one all-reduce per signal step (QK-Clip's runs in the step)
        assert max(f["attn_logit_bound"] for f in fsdp) <= 6.0 * (1 + 1e-5)
        for p, f in zip(plain, fsdp):
            assert set(p) == set(f)
            for key in p:
                if key.endswith("_heads"):
                    flat_f = [v for row in f[key] for v in row]
                    assert flat_f == pytest.approx([v for row in p[key] for v in row], rel=1e-5)
                else:
                    assert f[key] == pytest.approx(p[key], rel=1e-5, abs=1e-9), key
    assert results[0]["fsdp"][0] == results[1]["fsdp"][0]  # every rank holds the same numbers


def test_a_guarded_run_records_the_signals_and_diagnose_reads_them(tmp_path):
    torch.manual_seed(0)
    model = sg.GPT(sg.GPTConfig.tiny())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    cfg = sg.GuardConfig(probes=ProbeConfig(signals=SignalConfig(update_ratio_every=2)))
    guard = sg.Guard(model, opt, config=cfg, probes=True,
                     sinks=[sg.JsonlSink(tmp_path / "metrics.jsonl")])
    for t in range(5):
        x, y = _batch(t)
        out = model.loss(model(x), y)
        out.loss.backward()
        guard.step(out)
    guard.close()
    from spikeguard.diagnose import read_log

    log = read_log(tmp_path / "metrics.jsonl")
    ratio = log.columns["update_ratio"]
    assert list(log.missing["update_ratio"]) == [False, True, False, True, False]
    assert (ratio[~log.missing["update_ratio"]] > 0).all()
    assert set(log.columns) >= {"spike_share", "attn_logit_bound"}


@torch.no_grad()
def _bound64(model):
    """Every head's bound from the weights, float64 (the formula of measure/logit_bound.py)."""
    cfg, out = model.cfg, []
    hd, kv = cfg.head_dim, cfg.n_head // cfg.kv_heads
    for blk in model.blocks:
        qk = blk.attn.qk_norm
        if qk is not None:
            out += [math.sqrt(hd) * float(qk.q_weight.double().norm(32))
                    * float(qk.k_weight.double().norm(32))] * cfg.n_head
            continue
        w = blk.attn.qkv.weight.double()
        x = (float(blk.ln1.weight.double().norm(32)) * math.sqrt(cfg.d_model)
             + float(blk.ln1.bias.double().norm()))
        out += [float(w[h * hd:(h + 1) * hd].norm()) * float(
            w[cfg.d_model + (h // kv) * hd:cfg.d_model + (h // kv + 1) * hd].norm())
            * x * x / math.sqrt(hd) for h in range(cfg.n_head)]
    return out


@pytest.mark.parametrize("knobs", [dict(n_head=4, n_kv_head=2), dict(qk_norm=True)])
def test_qk_clip_holds_the_bound_after_every_step(knobs):
    torch.manual_seed(0)
    model = sg.GPT(sg.GPTConfig.tiny(**knobs))
    tau = 0.8 * min(_bound64(model))  # below every head's bound at the start: it must fire
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    probes = Probes(model, ProbeConfig(activation_max=False, layer_grad_norms=False,
                                       signals=SignalConfig(qk_clip=tau)), optimizer=opt)
    for t in range(3):
        probes.start_step(t)
        x, y = _batch(t)
        model.loss(model(x), y).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        after = _bound64(model)
        assert max(after) <= tau * (1 + 1e-5)
        assert _max_logit(model, _batch(t, b=2, t=64)[0]) <= tau
    assert max(after) == pytest.approx(tau, rel=1e-4)  # the worst head sits at tau, not below
    with pytest.raises(ValueError, match="qk_clip"):
        SignalConfig(qk_clip=-1.0)

import math
import re

import pytest
import torch

import spikeguard as sg
from spikeguard.measure.probes import ProbeConfig, Probes, layer_grad_norms


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (2, 16), generator=g), torch.randint(0, 256, (2, 16), generator=g)


def test_activation_max_equals_a_direct_computation():
    torch.manual_seed(0)
    model = sg.GPT(sg.GPTConfig.tiny())
    outputs = {}
    for name, m in model.named_modules():
        if name and not list(m.children()) and not isinstance(m, torch.nn.Dropout):
            m.register_forward_hook(lambda mod, a, out, n=name: outputs.__setitem__(n, out.detach()))
    probes = Probes(model)
    x, y = _batch()
    probes.start_step(0)
    model.loss(model(x), y).loss.backward()
    rec = probes.collect()
    ref_name, ref = max(((n, float(o.abs().max())) for n, o in outputs.items()), key=lambda t: t[1])
    assert rec["activation_max"] == pytest.approx(ref, rel=1e-6)
    assert rec["activation_max_module"] == ref_name


def test_layer_grad_norms_equal_float64_reference_and_respect_interval():
    torch.manual_seed(0)
    model = sg.GPT(sg.GPTConfig.tiny())
    probes = Probes(model, ProbeConfig(grad_norms_every=3, activation_every=2))
    x, y = _batch()
    seen = []
    for step in range(4):
        model.zero_grad()
        probes.start_step(step)
        model.loss(model(x), y).loss.backward()
        seen.append(probes.collect())
    assert [("layer_grad_norm/blocks.0" in r) for r in seen] == [True, False, False, True]
    assert [("activation_max" in r) for r in seen] == [True, False, True, False]
    norms = layer_grad_norms(model)
    assert set(norms) == {"wte", "wpe", "blocks.0", "blocks.1", "ln_f"}
    for layer in norms:
        grads = [p.grad.double().flatten() for n, p in model.named_parameters()
                 if n == layer or n.startswith(layer + ".")]
        assert norms[layer] == pytest.approx(float(torch.cat(grads).norm()), rel=1e-6)  # per-tensor norms in fp32, combined in fp64
    probes.remove()
    probes.start_step(0)
    model(x)
    assert "activation_max" not in probes.collect()


def test_probe_config_validation():
    with pytest.raises(ValueError, match="activation_every=0"):
        ProbeConfig(activation_every=0)


def test_probe_benchmark_smoke(sub_env):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "benchmarks/bench_probes.py", "--smoke"], env=sub_env,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    ratios = dict(re.findall(r"^  (\S+) +\S+ ms  ratio (\S+)  \(", out, flags=re.M))
    assert set(ratios) == {"baseline", "baseline-again", "default", "every-step"}, out
    assert float(ratios["baseline"]) == 1.0, out
    assert all(math.isfinite(float(r)) and float(r) > 0 for r in ratios.values()), out


def test_attention_logit_p99_per_head_and_layer_equals_torch_quantile():
    torch.manual_seed(0)
    model = sg.GPT(sg.GPTConfig.tiny())
    qs = {}
    for i, blk in enumerate(model.blocks):
        blk.attn.qkv.register_forward_hook(lambda m, a, out, i=i: qs.__setitem__(i, out.detach()))
    probes = Probes(model, ProbeConfig(attn_logit_p99=True, attn_every=2, activation_max=False))
    x, _ = _batch()
    x = x[:, :12]  # 2 x 78 visible pairs: fewer than the sample, so the p99 is exact
    seen = []
    for step in range(3):
        probes.start_step(step)
        model(x)
        seen.append(probes.collect())
    assert "attn_logit_p99" not in seen[1]
    rec = seen[2]
    cfg = model.cfg
    ref = []
    for i in range(cfg.n_layer):
        q, k, _ = qs[i].view(2, 12, 3, cfg.n_head, cfg.head_dim).permute(2, 0, 3, 1, 4)
        logits = (q.double() @ k.double().transpose(-1, -2)) / cfg.head_dim**0.5
        mask = torch.ones(12, 12, dtype=torch.bool).tril()
        vals = logits.abs().permute(1, 0, 2, 3)[:, :, mask]  # [H, B, pairs]
        ref.append(torch.quantile(vals.flatten(1), 0.99, dim=1, interpolation="higher").tolist())
    for got_layer, ref_layer in zip(rec["attn_logit_p99_heads"], ref):
        assert got_layer == pytest.approx(ref_layer, rel=1e-5)
    assert rec["attn_logit_p99"] == pytest.approx(max(max(r) for r in ref), rel=1e-5)
    flat_max = [max(r) for r in ref]
    assert rec["attn_logit_p99_layer"] == flat_max.index(max(flat_max))


def test_attn_probe_needs_a_model_that_reports_logits():
    with pytest.raises(ValueError, match="attn_logit_p99=True"):
        Probes(torch.nn.Linear(4, 4), ProbeConfig(attn_logit_p99=True))

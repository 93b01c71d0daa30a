import math

import pytest
import torch

import spikeguard as sg
from spikeguard.prevent import init
from spikeguard.prevent.init import fan_in_init_, gpt2_residual_init_


def _stream_std(n_layer: int, init: str, seed: int) -> float:
    """Std of the residual stream after the last block (before ln_f) at initialization."""
    torch.manual_seed(seed)
    model = sg.GPT(sg.GPTConfig.tiny(n_layer=n_layer, init=init))
    seen = {}
    model.blocks[-1].register_forward_hook(lambda mod, inp, out: seen.setdefault("x", out))
    with torch.no_grad():
        model(torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(seed)))
    return float(seen["x"].std())


def test_residual_scaling_keeps_the_stream_bounded_with_depth():
    # theory without scaling: L blocks add L independent contributions -> std ratio sqrt(48/6)
    plain = _stream_std(48, "standard", 0) / _stream_std(6, "standard", 0)
    scaled = _stream_std(48, "gpt2-residual", 0) / _stream_std(6, "gpt2-residual", 0)
    assert plain >= 2.0, plain
    assert 0.5 <= scaled <= 2.0, scaled
    assert abs(plain - math.sqrt(48 / 6)) < 0.6


def test_gpt2_residual_init_scales_only_the_branch_outputs():
    torch.manual_seed(0)
    model = sg.GPT(sg.GPTConfig.demo(n_layer=8, init="gpt2-residual")).requires_grad_(False)
    for block in model.blocks:
        for w in (block.attn.proj.weight, block.mlp.proj.weight):
            assert float(w.std()) == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
        assert float(block.attn.qkv.weight.std()) == pytest.approx(0.02, rel=0.05)
        assert float(block.mlp.fc.weight.std()) == pytest.approx(0.02, rel=0.05)
    assert float(model.wte.weight.std()) == pytest.approx(0.02, rel=0.05)


def test_fan_in_init_preserves_variance_through_a_deep_linear_stack():
    assert init.fan_in_std(256) == 1 / 16
    assert init.fan_in_std(8, gain=math.sqrt(2)) == pytest.approx(0.5)
    torch.manual_seed(0)
    w = torch.empty(512, 1024)
    fan_in_init_(w)
    assert float(w.std()) == pytest.approx(1 / 32, rel=0.01)
    x = torch.randn(256, 512)
    for _ in range(16):
        layer = torch.empty(512, 512)
        fan_in_init_(layer)
        x = x @ layer.T
    assert 0.5 < float(x.var()) < 2.0  # 0.02-std init would shrink it by (0.02^2 * 512)^16
    conv = torch.empty(4, 3, 5, 5)
    fan_in_init_(conv)
    assert float(conv.std()) == pytest.approx(1 / math.sqrt(75), rel=0.25)


def test_residual_scale_and_deepnorm_constants_exact_values():
    assert init.residual_scale(6) == pytest.approx(1 / math.sqrt(12))
    c = init.deepnorm_constants(8)  # (16)^(1/4) = 2, (64)^(-1/4) = 1 / (2 sqrt 2)
    assert c.alpha == pytest.approx(2.0, abs=1e-12)
    assert c.beta == pytest.approx(1 / (2 * math.sqrt(2)), abs=1e-12)
    c1 = init.deepnorm_constants(1)
    assert c1.alpha == pytest.approx(2 ** 0.25) and c1.beta == pytest.approx(8 ** -0.25)


@pytest.mark.parametrize(("call", "match"), [
    (lambda: init.fan_in_std(0), "fan_in=0"),
    (lambda: init.fan_in_std(4, gain=0.0), "gain=0.0"),
    (lambda: init.residual_scale(0), "n_layer=0"),
    (lambda: init.deepnorm_constants(-2), "n_layer=-2"),
    (lambda: fan_in_init_(torch.empty(4)), "at least 2 dims|>= 2 dims"),
    (lambda: gpt2_residual_init_([torch.empty(2, 2)], 4, std=0.0), "std=0.0"),
])
def test_init_helpers_reject_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()

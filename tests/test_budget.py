import json

import pytest

from spikeguard.cli import main
from spikeguard.prevent.budget import activation_bytes, memory_budget


def test_seed_worked_example_13b_bf16_mixed():
    b0 = memory_budget(13e9)
    assert b0.bytes_per_param == 18
    assert b0.total_bytes == pytest.approx(234e9)
    per_gpu = [memory_budget(13e9, n_gpus=8, zero_stage=z).per_gpu_bytes / 1e9 for z in (1, 2, 3)]
    assert per_gpu == pytest.approx([97.5, 52.0, 29.25])


def test_recipes_and_components():
    assert memory_budget(1e9, recipe="fp32").bytes_per_param == 16
    assert memory_budget(1e9, recipe="fp16-mixed").bytes_per_param == 16
    b = memory_budget(1e9)
    assert sum(b.components.values()) == b.bytes_per_param
    # stage 0 on many GPUs replicates everything
    assert memory_budget(1e9, n_gpus=64, zero_stage=0).per_gpu_bytes == b.total_bytes


def test_activation_formula_by_hand():
    s, b, h, a, L = 2048, 2, 1024, 16, 24
    expected = L * s * b * h * (34 + 5 * a * s / h)
    assert activation_bytes(seq_len=s, batch=b, hidden=h, n_heads=a, n_layers=L,
                            attention="eager") == expected
    # flash (the default): no s x s scores, only the fp32 log-sum-exp of each query row
    assert activation_bytes(seq_len=s, batch=b, hidden=h, n_heads=a,
                            n_layers=L) == L * (34 * s * b * h + 4 * a * s * b)
    assert activation_bytes(seq_len=s, batch=b, hidden=h, n_heads=a, n_layers=L,
                            recompute=True) == L * 2 * s * b * h


@pytest.mark.parametrize("kwargs, match", [
    ({"zero_stage": 4}, "zero_stage=4"),
    ({"n_gpus": 0}, "n_gpus=0"),
    ({"recipe": "int4"}, "recipe='int4'"),
    ({"seq_len": 128}, "missing"),
])
def test_bad_input_names_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        memory_budget(1e9, **kwargs)


def test_cli_json_and_human(capsys):
    assert main(["budget", "13b", "--gpus", "8", "--zero", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["per_gpu_bytes"] == pytest.approx(52e9)
    assert data["activation_bytes"] > 0
    assert main(["budget", "350m", "--gpus", "1", "--zero", "0"]) == 0
    out = capsys.readouterr().out
    assert "6.30 GB static" in out  # 0.35e9 * 18


def test_cli_budget_states_its_attention_assumption_and_takes_attention(capsys):
    shape = dict(seq_len=4096, batch=1, hidden=5120, n_heads=40, n_layers=40)
    for attention in ("flash", "eager"):
        assert main(["budget", "13b", "--attention", attention]) == 0
        out = " ".join(capsys.readouterr().out.split())
        gb = activation_bytes(**shape, attention=attention) / 1e9
        assert f"activations: {gb:,.2f} GB" in out and f"attention {attention}" in out
        assert "3 <- --zero" in out  # the marker says what it marks
    assert main(["budget", "13b", "--json"]) == 0  # the default is flash, as SDPA stores
    assert json.loads(capsys.readouterr().out)["activation_bytes"] == pytest.approx(
        activation_bytes(**shape))
    with pytest.raises(ValueError, match="attention='sdpa'"):
        activation_bytes(**shape, attention="sdpa")

"""The attention protocol (spikeguard.prevent.layout): the reference GPT implements it, a Hugging
Face Llama is found through its own attributes, and QK-Clip on a model where nothing is found
warns once naming the model's class. References: float64 sums over the weights, and the norms of
the queries and keys the model itself computes."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import spikeguard as sg
from spikeguard.measure.logit_bound import attention_blocks, bound_parts, bounds
from spikeguard.measure.signals import Signals
from spikeguard.prevent import layout
from spikeguard.prevent.layout import AttentionNotFoundWarning, find_attention
from spikeguard.sinks import read_metrics

transformers = pytest.importorskip("transformers")

H, H_KV, D = 4, 2, 32


def _llama(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=D, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=H,
                                   num_key_value_heads=H_KV, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(cfg).double()
    with torch.no_grad():  # gains away from 1, so that the norm's gain matters
        for layer in model.model.layers:
            layer.input_layernorm.weight.uniform_(0.5, 2.0)
    return model


def _llama_bounds_f64(model: nn.Module) -> torch.Tensor:
    """Every head's bound from the weights (measure/logit_bound.py's formula), float64."""
    hd = D // H
    out = []
    for layer in model.model.layers:
        g = layer.input_layernorm.weight.detach().double()
        x = g.abs().pow(32).sum().pow(1 / 32) * math.sqrt(D)
        q = layer.self_attn.q_proj.weight.detach().double().view(H, hd, D)
        k = layer.self_attn.k_proj.weight.detach().double().view(H_KV, hd, D)
        qn, kn = q.square().sum((1, 2)).sqrt(), k.square().sum((1, 2)).sqrt()
        out.append(qn * kn.repeat_interleave(H // H_KV) * x * x / math.sqrt(hd))
    return torch.cat(out)


def test_the_reference_gpt_and_a_llama_are_found_layer_by_layer():
    gpt = sg.GPT(sg.GPTConfig.tiny())
    assert len(find_attention(gpt)) == gpt.cfg.n_layer
    llama = _llama()
    found = find_attention(llama)
    assert [f.module for f in found] == list(llama.model.layers)
    lay = found[0].layout()
    assert (lay.n_head, lay.n_kv_head, lay.head_dim, lay.d_model) == (H, H_KV, D // H, D)
    assert lay.scale == pytest.approx(1 / math.sqrt(D // H))


def test_the_logit_bound_reads_a_llama_and_holds_over_its_queries_and_keys():
    model = _llama()
    blocks = attention_blocks(model)
    got = bounds(blocks, bound_parts(blocks, 1, torch.device("cpu")))
    torch.testing.assert_close(got, _llama_bounds_f64(model), rtol=1e-9, atol=0)
    # the model's own queries and keys (before RoPE, which keeps norms): |q| |k| scale <= bound
    seen: dict[str, torch.Tensor] = {}
    hooks = [m.register_forward_hook(lambda m, i, o, n=n: seen.__setitem__(n, o))
             for n, m in model.named_modules() if n.endswith(("q_proj", "k_proj"))]
    model(torch.randint(0, 64, (4, 16)))
    for h in hooks:
        h.remove()
    hd = D // H
    for i in range(2):
        q = seen[f"model.layers.{i}.self_attn.q_proj"].view(4, 16, H, hd).norm(dim=-1)
        k = seen[f"model.layers.{i}.self_attn.k_proj"].view(4, 16, H_KV, hd).norm(dim=-1)
        k = k.repeat_interleave(H // H_KV, dim=-1)
        worst = (q.amax((0, 1)) * k.amax((0, 1))) / math.sqrt(hd)
        assert (worst <= got[i * H:(i + 1) * H]).all()


def test_qk_clip_rescales_a_llamas_query_and_key_rows_to_the_bar():
    model = _llama()
    before = _llama_bounds_f64(model)
    tau = float(before.median())  # about half the heads are above it
    v = [layer.self_attn.v_proj.weight.detach().clone() for layer in model.model.layers]
    q0 = [layer.self_attn.q_proj.weight.detach().clone() for layer in model.model.layers]
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    signals = Signals(model, opt, sg.SignalConfig(qk_clip=tau, update_ratio_every=0,
                                                  spike_share_every=0))
    model(torch.randint(0, 64, (2, 8))).logits.sum().backward()
    opt.step()  # lr 0: only QK-Clip, in the step's post-hook, moves the weights
    signals.remove()
    after = _llama_bounds_f64(model)
    assert (after <= tau * (1 + 1e-9)).all() and (before > tau).any()
    gamma = (tau / before).clamp(max=1.0)
    hd = D // H
    for i, layer in enumerate(model.model.layers):
        torch.testing.assert_close(layer.self_attn.v_proj.weight, v[i], rtol=0, atol=0)
        factor = gamma[i * H:(i + 1) * H].sqrt().repeat_interleave(hd).unsqueeze(1)
        torch.testing.assert_close(layer.self_attn.q_proj.weight, q0[i] * factor)


class MysteryAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wqkv = nn.Linear(8, 24)


class MysteryModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = MysteryAttention()


@pytest.fixture
def fresh_warnings(monkeypatch):
    """Forget which (defense, class) pairs this process has warned about already."""
    monkeypatch.setattr(layout, "_warned", set())


def _not_found(recwarn) -> list[str]:
    return [str(w.message) for w in recwarn if issubclass(w.category, AttentionNotFoundWarning)]


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))


def _train(model: nn.Module, guard: sg.Guard, steps: int) -> None:
    for _ in range(steps):
        x = torch.randn(4, 8)
        loss = model(x).square().mean()
        loss.backward()
        guard.step(loss)


def test_the_default_logit_bound_on_an_mlp_warns_once_naming_its_class_and_the_fix(
        fresh_warnings, recwarn, tmp_path):
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = sg.Guard(model, opt, sinks=[sg.JsonlSink(tmp_path / "m.jsonl")])
    _train(model, guard, 12)  # past a logit-bound step (every 10): the warning came at build
    guard.close()
    second = _mlp()  # another model of the same class, another guard: no second warning
    _train(second, sg.Guard(second, torch.optim.AdamW(second.parameters(), lr=1e-3),
                            sinks=[sg.JsonlSink(tmp_path / "n.jsonl")]), 3)
    (msg,) = _not_found(recwarn)
    assert msg.startswith("the attention-logit bound found no attention it can read in "
                          "Sequential: it does nothing")
    assert "HasAttentionLayout" in msg and "attention_layout()" in msg
    assert "SignalConfig(logit_bound_every=0)" in msg  # the way off, for a model without one
    records = read_metrics(tmp_path / "m.jsonl")
    assert len(records) == 12 and not any("attn_logit_bound" in r for r in records)


def test_the_logit_bound_turned_off_does_not_warn(fresh_warnings, recwarn):
    off = sg.SignalConfig(logit_bound_every=0)
    Signals(_mlp(), None, off).remove()
    assert _not_found(recwarn) == []


def test_qk_clip_on_a_model_it_cannot_read_warns_once_naming_its_class(fresh_warnings, recwarn):
    opt = torch.optim.SGD(MysteryModel().parameters(), lr=0.1)
    for _ in range(3):  # three models of the class, each with the bound on too: one warning
        Signals(MysteryModel(), opt, sg.SignalConfig(qk_clip=100.0)).remove()
    (msg,) = _not_found(recwarn)
    assert msg.startswith("QK-Clip found no attention it can read in MysteryModel")
    assert "HasAttentionLayout" in msg and "SignalConfig(qk_clip=None)" in msg
    # the bound alone is another defense: its own one warning for the class
    for _ in range(2):
        Signals(MysteryModel(), opt, sg.SignalConfig()).remove()
    assert [m.split(" found")[0] for m in _not_found(recwarn)] == \
        ["QK-Clip", "the attention-logit bound"]


def test_the_reference_gpt_and_a_llama_warn_about_nothing(fresh_warnings, recwarn):
    from spikeguard.prevent.mup import mup_param_groups

    gpt = sg.GPT(sg.GPTConfig.tiny())
    llama = _llama()
    for model, x in ((gpt, torch.randint(0, 256, (2, 8))), (llama, torch.randint(0, 64, (2, 8)))):
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        signals = Signals(model, opt, sg.SignalConfig(qk_clip=100.0, logit_bound_every=1))
        for step in range(3):
            signals.start_step(step)
            out = model(x)
            (out.logits if hasattr(out, "logits") else out).float().square().mean().backward()
            opt.step()
            values = signals.gather()
            assert values.heads is not None  # the bound was read
        signals.remove()
    mup = sg.GPT(sg.GPTConfig.tiny(init="mup", tie_embeddings=False))
    assert mup_param_groups(mup, lr=1e-2, weight_decay=0.1)
    assert _not_found(recwarn) == []


def test_mup_reads_a_llamas_width_from_its_attention_and_groups_its_parameters():
    from spikeguard.prevent.mup import mup_param_groups

    model = _llama()
    model.config.tie_word_embeddings = False
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())  # untied
    groups = {g["name"]: g for g in mup_param_groups(model, lr=1e-2, weight_decay=0.1,
                                                     base_width=8)}
    assert groups["hidden"]["lr"] == pytest.approx(1e-2 * 8 / D)
    hidden = {id(p) for p in groups["hidden"]["params"]}
    layer = model.model.layers[0]
    for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj,
                layer.mlp.down_proj):
        assert id(lin.weight) in hidden
    assert [id(p) for p in groups["input"]["params"]] == [id(model.model.embed_tokens.weight)]
    assert [id(p) for p in groups["output"]["params"]] == [id(model.lm_head.weight)]
    assert all(p.dim() == 1 for p in groups["vector"]["params"])
    assert sum(len(g["params"]) for g in groups.values()) == len(list(model.parameters()))
    with pytest.raises(ValueError, match="needs base_width="):
        mup_param_groups(model, lr=1e-2, weight_decay=0.1)
    with pytest.raises(ValueError, match="no attention in MysteryModel.*HasAttentionLayout"):
        mup_param_groups(MysteryModel(), lr=1e-2, weight_decay=0.1, base_width=8)

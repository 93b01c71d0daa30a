"""muP: the coordinate check, the model's muP pieces against independent references, the
per-layer learning rates, and a smoke run of benchmarks/mup_sweep.py."""

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from spikeguard.model import GPT, GPTConfig
from spikeguard.prevent.mup import mup_param_groups, mup_roles

ROOT = Path(__file__).resolve().parents[1]
HEAD_DIM = 16


def _cfg(width: int, init: str = "mup", **kw) -> GPTConfig:
    """Fixed head_dim: width grows by adding heads."""
    base = {"n_layer": 2, "n_head": width // HEAD_DIM, "d_model": width, "seq_len": 16,
            "tie_embeddings": False, "init": init}
    return GPTConfig(**(base | kw))


def _coordinate_deltas(width: int, init: str, *, lr: float = 3e-3, steps: int = 3) -> dict:
    """RMS of (activation after ``steps`` Adam updates - activation at init), per layer, on one
    fixed batch trained on at a fixed LR and seed."""
    torch.manual_seed(0)
    model = GPT(_cfg(width, init))
    groups = (mup_param_groups(model, lr=lr, weight_decay=0.0) if init == "mup"
              else [{"params": list(model.parameters()), "lr": lr}])
    opt = torch.optim.Adam(groups)
    gen = torch.Generator().manual_seed(1234)
    x, y = (torch.randint(0, 256, (4, 16), generator=gen) for _ in range(2))
    layers = ["wte"] + [f"blocks.{i}{p}" for i in range(2) for p in (".attn", ".mlp", "")]

    def activations() -> dict:
        out, hooks = {}, []
        for name in layers:
            def keep(_m, _i, o, name=name):
                out[name] = o.detach().clone()
            hooks.append(model.get_submodule(name).register_forward_hook(keep))
        with torch.no_grad():
            out["ln_f"] = model(x)
            out["logits"] = model.logits(out["ln_f"])
        for h in hooks:
            h.remove()
        return out

    before = activations()
    for _ in range(steps):
        loss = model.loss(model(x), y).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = activations()
    return {k: float((after[k] - before[k]).pow(2).mean().sqrt()) for k in before}


def test_coordinate_check_mup_updates_are_width_independent_standard_logits_grow():
    mup = {w: _coordinate_deltas(w, "mup") for w in (64, 256)}
    sp = {w: _coordinate_deltas(w, "standard") for w in (64, 256)}
    assert set(mup[64]) == {"wte", "blocks.0.attn", "blocks.0.mlp", "blocks.0", "blocks.1.attn",
                            "blocks.1.mlp", "blocks.1", "ln_f", "logits"}
    for layer in mup[64]:
        assert mup[64][layer] > 0 and sp[64][layer] > 0, layer
        assert mup[256][layer] / mup[64][layer] <= 2.0, (layer, mup[256][layer], mup[64][layer])
    # standard parametrization: an Adam step moves a width-n layer's output by ~lr * n
    assert sp[256]["logits"] / sp[64]["logits"] >= 2.5, (sp[256]["logits"], sp[64]["logits"])


def test_mup_logits_and_fused_loss_equal_the_float64_reference():
    torch.manual_seed(0)
    cfg = _cfg(64, z_loss=1e-3)
    model = GPT(cfg)
    assert cfg.output_multiplier == 128 / 64 == cfg.mup_base_width / cfg.d_model
    h = torch.randn(2, 8, 64)
    tgt = torch.randint(0, 256, (2, 8))
    ref = (h.double() @ model.lm_head.weight.double().T) * (128 / 64)
    torch.testing.assert_close(model.logits(h).double(), ref, rtol=1e-5, atol=1e-5)
    out = model.loss(h, tgt)
    ce = F.cross_entropy(ref.flatten(0, 1), tgt.flatten())
    z = torch.logsumexp(ref.flatten(0, 1), -1)
    torch.testing.assert_close(out.ce.double(), ce, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.loss.double(), ce + 1e-3 * z.pow(2).mean(), rtol=1e-5, atol=1e-6)
    # the gradient reaches the unscaled weight through the multiplier
    out.loss.backward()
    w = model.lm_head.weight.detach().double().requires_grad_()
    logits = (h.double() @ w.T) * 2.0
    lz = torch.logsumexp(logits.flatten(0, 1), -1)
    (F.cross_entropy(logits.flatten(0, 1), tgt.flatten()) + 1e-3 * lz.pow(2).mean()).backward()
    torch.testing.assert_close(model.lm_head.weight.grad.double(), w.grad, rtol=1e-4, atol=1e-7)


def test_mup_attention_scores_are_scaled_by_one_over_head_dim():
    torch.manual_seed(0)
    model = GPT(_cfg(64))
    attn = model.blocks[0].attn
    assert model.cfg.attn_scale == 1 / HEAD_DIM and GPTConfig().attn_scale is None
    x = torch.randn(2, 10, 64)
    q, k, v = attn.qkv(x).double().view(2, 10, 3, 4, HEAD_DIM).permute(2, 0, 3, 1, 4)
    scores = (q @ k.transpose(-1, -2)) / HEAD_DIM
    scores = scores.masked_fill(torch.ones(10, 10, dtype=torch.bool).triu(1), -math.inf)
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 10, 64)
    ref = y @ attn.proj.weight.double().T
    torch.testing.assert_close(attn(x).double(), ref, rtol=1e-5, atol=1e-6)
    # the attention-logit probe reads the same scaled scores (all pairs: exact p99)
    attn.logit_p99_request = True
    attn(x)
    visible = (q @ k.transpose(-1, -2)).abs().div(HEAD_DIM)[..., torch.ones(10, 10).tril() > 0]
    want = torch.quantile(visible.permute(1, 0, 2).flatten(1), 0.99, dim=1, interpolation="higher")
    torch.testing.assert_close(attn.last_logit_p99.double(), want, rtol=1e-5, atol=1e-6)


def test_mup_init_scales_hidden_matrices_by_sqrt_base_over_width():
    torch.manual_seed(0)
    model = GPT(_cfg(512, mup_base_width=128))
    want = 0.02 * math.sqrt(128 / 512)
    roles = mup_roles(model)
    for name, p in model.named_parameters():
        role = roles[name]
        if role == "hidden":
            assert abs(p.std().item() / want - 1) < 0.02, name
        elif role in ("input", "output"):
            assert abs(p.std().item() / 0.02 - 1) < 0.02, name
        else:
            assert torch.all(p == (1.0 if name.endswith("weight") else 0.0)), name


def test_mup_param_groups_cover_every_parameter_once_with_muP_learning_rates():
    model = GPT(_cfg(256, mup_base_width=64, qk_norm=True))
    groups = mup_param_groups(model, lr=1e-2, weight_decay=0.1)
    by_name = {g["name"]: g for g in groups}
    assert set(by_name) == {"input", "hidden", "output", "vector"}
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    assert by_name["hidden"]["lr"] == pytest.approx(1e-2 * 64 / 256)
    for role in ("input", "output", "vector"):
        assert by_name[role]["lr"] == 1e-2
    assert all(g["weight_decay"] == 0.1 for g in groups)
    hidden = {id(p) for g in groups if g["name"] == "hidden" for p in g["params"]}
    for block in model.blocks:
        for lin in (block.attn.qkv, block.attn.proj, block.mlp.fc, block.mlp.proj):
            assert id(lin.weight) in hidden
    assert {id(model.wte.weight), id(model.wpe.weight)} == {id(p) for p in by_name["input"]["params"]}
    assert [id(p) for p in by_name["output"]["params"]] == [id(model.lm_head.weight)]
    # a schedule scales every group alike; the groups keep their ratio
    opt = torch.optim.AdamW(groups)
    torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)  # applies lambda(0) at once
    lrs = {g["name"]: g["lr"] for g in opt.param_groups}
    assert lrs["input"] == 0.5e-2 and lrs["hidden"] == pytest.approx(0.5e-2 * 64 / 256)
    # at the base width every group gets the one learning rate; rotary: no position table
    base = GPT(_cfg(128, pos="rope"))
    assert {g["lr"] for g in mup_param_groups(base, lr=3e-3, weight_decay=0.0)} == {3e-3}
    assert mup_param_groups is mup_param_groups


@pytest.mark.parametrize("call, match", [
    (lambda: mup_param_groups(GPT(GPTConfig.tiny()), lr=1e-3, weight_decay=0.0),
     "init='mup'"),
    (lambda: mup_param_groups(torch.nn.Linear(2, 2), lr=1e-3, weight_decay=0.0),
     "reference GPT"),
    (lambda: mup_param_groups(GPT(_cfg(64)), lr=1e-3, weight_decay=0.0, base_width=64),
     "base_width=64 differs"),
    (lambda: mup_param_groups(GPT(_cfg(64)), lr=0.0, weight_decay=0.0), "lr=0.0"),
    (lambda: mup_param_groups(GPT(_cfg(64)), lr=1e-3, weight_decay=-1.0), "weight_decay=-1.0"),
])
def test_mup_param_groups_reject_bad_input(call, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        call()


def _sweep(sub_env, *args):
    r = subprocess.run([sys.executable, "benchmarks/mup_sweep.py", "--smoke", *args], cwd=ROOT,
                       env=sub_env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r


def test_mup_sweep_smoke_prints_a_table_that_parses(sub_env, tmp_path):
    results = tmp_path / "runs.jsonl"
    r = _sweep(sub_env, "--results", str(results))
    rows, best, shift = {}, {}, {}
    for line in r.stdout.splitlines():
        parts = line.split()
        if parts[:1] == ["row"]:
            rows[(parts[1], int(parts[2]), float(parts[3]))] = [float(v) for v in parts[4].split(",")]
        elif parts[:1] == ["best"]:
            best[(parts[1], int(parts[2]))] = float(parts[3])
        elif parts[:1] == ["shift"]:
            shift[parts[1]] = int(parts[2])
    assert len(rows) == 2 * 2 * 2 and set(shift) == {"mup", "standard"}
    assert all(len(v) == 2 and all(math.isfinite(x) and x > 0 for x in v) for v in rows.values())
    grid = sorted({lr for (_, _, lr) in rows})
    for param in ("mup", "standard"):
        widths = sorted({w for (p, w, _) in rows if p == param})
        assert widths == [32, 64]
        for w in widths:  # the printed best is the argmin of the seed mean
            means = {lr: sum(rows[(param, w, lr)]) / 2 for lr in grid}
            assert best[(param, w)] == min(means, key=means.get)
        idx = [grid.index(best[(param, w)]) for w in widths]
        assert shift[param] == abs(idx[-1] - idx[0])
    # a second run with the same results file trains nothing and prints the same table
    again = _sweep(sub_env, "--results", str(results))
    assert again.stdout.count("from " + str(results)) == 16
    table = [ln for ln in r.stdout.splitlines() if ln.split()[:1] in (["row"], ["best"], ["shift"])]
    assert table == [ln for ln in again.stdout.splitlines()
                     if ln.split()[:1] in (["row"], ["best"], ["shift"])]


def test_spikeguard_train_init_mup_builds_mups_param_groups():
    from spikeguard.train import TrainConfig
    from spikeguard.train.loop import _optimizer

    def groups(**gpt):
        cfg = TrainConfig(model="tiny", lr=1e-3, gpt=GPTConfig(**gpt)).resolved()
        model = GPT(cfg.gpt_config(256))
        opt = _optimizer(model, cfg, torch.device("cpu"))
        assert {id(p) for g in opt.param_groups for p in g["params"]} == \
            {id(p) for p in model.parameters()}
        return {g.get("name"): g["lr"] for g in opt.param_groups}

    # tiny is d_model 64 against the base width 128: hidden matrices at 2x the learning rate
    assert groups(init="mup", tie_embeddings=False) == \
        {"input": 1e-3, "hidden": 2e-3, "output": 1e-3, "vector": 1e-3}
    assert groups(init="mup", tie_embeddings=False, mup_base_width=64)["hidden"] == 1e-3
    assert groups() == {None: 1e-3}

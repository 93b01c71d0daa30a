import numpy as np
import pytest
import torch
import torch.nn.functional as F

import spikeguard as sg
from spikeguard.data import load_corpus
from spikeguard.model import count_params
from spikeguard.train import TrainConfig, evaluate, train


@pytest.mark.parametrize("pos", ["learned", "rope"])
def test_forward_shapes_and_causality(pos):
    torch.manual_seed(0)
    model = sg.GPT(sg.GPTConfig.tiny(pos=pos))
    idx = torch.randint(0, 256, (2, 16))
    h = model(idx)
    assert h.shape == (2, 16, 64)
    # changing a later token never changes an earlier position's hidden state
    idx2 = idx.clone()
    idx2[:, 10] = (idx2[:, 10] + 1) % 256
    h2 = model(idx2)
    torch.testing.assert_close(h[:, :10], h2[:, :10])
    assert not torch.allclose(h[:, 10:], h2[:, 10:])


def test_loss_equals_torch_cross_entropy_on_logits():
    torch.manual_seed(0)
    model = sg.GPT(sg.GPTConfig.tiny(tie_embeddings=False))
    idx, tgt = torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8))
    h = model(idx)
    ref = F.cross_entropy((h @ model.lm_head.weight.T).reshape(-1, 256), tgt.reshape(-1))
    torch.testing.assert_close(model.loss(h, tgt).ce, ref)
    # at init the loss is close to ln(vocab)
    assert abs(float(ref.detach()) - np.log(256)) < 0.1


def test_presets_and_validation():
    assert sg.GPTConfig.demo().n_layer == 4 and sg.GPTConfig.demo().d_model == 128
    bench = sg.GPTConfig.bench()
    assert (bench.n_layer, bench.d_model, bench.seq_len) == (6, 384, 256)
    assert count_params(sg.GPTConfig.tiny()) == sg.GPT(sg.GPTConfig.tiny()).num_params()
    with pytest.raises(ValueError, match="not divisible by n_head"):
        sg.GPTConfig(d_model=100, n_head=3)
    with pytest.raises(ValueError, match="exceeds GPTConfig.seq_len"):
        sg.GPT(sg.GPTConfig.tiny())(torch.zeros(1, 65, dtype=torch.long))


@pytest.mark.parametrize("n_kv_head", [1, 2])
@pytest.mark.parametrize("knobs", [{}, {"pos": "rope", "qk_norm": True}, {"attn_softcap": 20.0}],
                         ids=["sdpa", "rope-qknorm", "capped-eager"])
def test_grouped_query_attention_equals_multi_head_with_kv_heads_repeated(n_kv_head, knobs):
    """Reference: the multi-head model whose key/value projections repeat each of the grouped
    model's kv heads for its group of query heads (query head h reads kv head h // (H / H_kv))."""
    torch.manual_seed(0)
    cfg = sg.GPTConfig.tiny(n_head=4, n_kv_head=n_kv_head, **knobs)
    gqa, mha = sg.GPT(cfg), sg.GPT(sg.GPTConfig.tiny(n_head=4, **knobs))
    h, d, hd = 4, cfg.d_model, cfg.head_dim
    assert gqa.blocks[0].attn.qkv.weight.shape == (d + 2 * n_kv_head * hd, d)
    assert mha.num_params() - gqa.num_params() == cfg.n_layer * 2 * (h - n_kv_head) * hd * d
    state = gqa.state_dict()
    for name, w in list(state.items()):
        if name.endswith("attn.qkv.weight"):
            wq, wk, wv = w.split((h * hd, n_kv_head * hd, n_kv_head * hd))
            grow = [x.view(n_kv_head, hd, d).repeat_interleave(h // n_kv_head, 0).reshape(-1, d)
                    for x in (wk, wv)]
            state[name] = torch.cat([wq, *grow])
    mha.load_state_dict(state)
    idx = torch.randint(0, 256, (2, 24))
    torch.testing.assert_close(gqa(idx), mha(idx), rtol=1e-5, atol=1e-5)
    out = gqa.loss(gqa(idx[:, :-1]), idx[:, 1:])
    out.loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in gqa.parameters())


def test_n_kv_head_validation_names_the_field_and_the_fix():
    assert sg.GPTConfig(n_head=4).kv_heads == 4 and sg.GPTConfig(n_head=4, n_kv_head=1).kv_heads == 1
    with pytest.raises(ValueError, match=r"n_kv_head=3 does not divide n_head=4; pick a divisor"):
        sg.GPTConfig(n_head=4, n_kv_head=3)
    for bad in (0, -2, 2.0, True):
        with pytest.raises(ValueError, match=r"GPTConfig.n_kv_head=.* must be an integer >= 1"):
            sg.GPTConfig(n_head=4, n_kv_head=bad)


@pytest.mark.slow
def test_reference_gpt_learns_the_default_corpus(tmp_path):
    corpus = load_corpus("pydoc")
    # the unigram byte entropy, computed here independently of Corpus.unigram_entropy
    p = np.bincount(corpus.train, minlength=256) / len(corpus.train)
    entropy = -sum(x * np.log(x) for x in p if x > 0)
    assert 3.0 < entropy < 3.5
    cfg = TrainConfig(steps=100, model="demo", seed=0, out=str(tmp_path), progress=False,
                      plot=False)
    result = train(cfg, echo=False)
    assert result.val_loss <= 0.9 * entropy, (result.val_loss, entropy)
    assert np.mean(result.losses[-20:]) < np.mean(result.losses[:20]) - 1.0


def test_evaluate_is_deterministic():
    corpus = load_corpus("pydoc")
    model = sg.GPT(sg.GPTConfig.tiny())
    a = evaluate(model, corpus.val, batches=2, batch_size=2)
    b = evaluate(model, corpus.val, batches=2, batch_size=2)
    assert a == b


def test_mup_config_validation_names_the_field_and_the_fix():
    cfg = sg.GPTConfig.tiny(init="mup", tie_embeddings=False)
    assert cfg.mup_base_width == 128 and cfg.output_multiplier == 2.0 and cfg.attn_scale == 1 / 32
    assert sg.GPTConfig.tiny().output_multiplier == 1.0
    with pytest.raises(ValueError, match="tie_embeddings=True.*set tie_embeddings=False"):
        sg.GPTConfig.tiny(init="mup")
    with pytest.raises(ValueError, match="GPTConfig.mup_base_width=0 must be an integer >= 1"):
        sg.GPTConfig.tiny(init="mup", tie_embeddings=False, mup_base_width=0)
    with pytest.raises(ValueError, match="GPTConfig.init='mu-p' must be 'standard', "
                                         "'gpt2-residual' or 'mup'"):
        sg.GPTConfig.tiny(init="mu-p")


def test_mup_at_the_base_width_is_the_standard_model_but_for_the_attention_scale():
    torch.manual_seed(0)
    std = sg.GPT(sg.GPTConfig.tiny(tie_embeddings=False))
    torch.manual_seed(0)
    mup = sg.GPT(sg.GPTConfig.tiny(tie_embeddings=False, init="mup", mup_base_width=64))
    # same draws for every weight but the re-drawn hidden matrices, which have the same std
    for (name, a), (_, b) in zip(std.named_parameters(), mup.named_parameters()):
        if ".attn." in name or ".mlp." in name:
            assert a.shape == b.shape
        else:
            assert torch.equal(a, b), name
    h = torch.randn(2, 5, 64)
    assert torch.equal(mup.logits(h), std.logits(h))  # multiplier 1 at the base width

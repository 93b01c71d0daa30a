import json

import numpy as np
import pytest
import torch

from spikeguard import TokenStream, load_corpus


def _tokens(n: int = 4097) -> np.ndarray:
    return (np.arange(n, dtype=np.int64) * 7919 % 65521).astype(np.uint16)


def _take(stream: TokenStream, n: int) -> list[torch.Tensor]:
    return [next(stream)[0] for _ in range(n)]


def test_batches_are_corpus_windows_with_shifted_targets():
    tokens = _tokens()
    s = TokenStream(tokens, batch_size=3, seq_len=16, seed=1)
    x, y = next(s)
    assert x.shape == y.shape == (3, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    for row, start in zip(x, s._window_ids(0) * 16):
        assert torch.equal(row, torch.from_numpy(tokens[start: start + 16].astype(np.int64)))


def test_one_epoch_visits_every_window_once_and_ranks_are_disjoint():
    tokens = _tokens(64 * 16 + 1)  # exactly 64 windows of 16 (+1 target)
    ranks = [TokenStream(tokens, batch_size=4, seq_len=16, seed=3, rank=r, world_size=2)
             for r in range(2)]
    seen = [np.concatenate([s._window_ids(b) for b in range(8)]) for s in ranks]
    assert set(seen[0]).isdisjoint(seen[1])
    assert sorted(np.concatenate(seen).tolist()) == list(range(64))
    # the next epoch is another order of the same windows
    again = np.concatenate([ranks[0]._window_ids(b) for b in range(8, 16)])
    assert len(set(again)) == 32 and not np.array_equal(again, seen[0])


def test_same_seed_same_batches_other_seed_other_batches():
    a, b, c = (TokenStream(_tokens(), batch_size=2, seq_len=16, seed=s) for s in (5, 5, 6))
    xa, xb, xc = _take(a, 4), _take(b, 4), _take(c, 4)
    assert all(torch.equal(p, q) for p, q in zip(xa, xb))
    assert not all(torch.equal(p, q) for p, q in zip(xa, xc))


def test_memmapped_uint16_bin_keeps_ids_above_255(tmp_path):
    tokens = _tokens()
    tokens.tofile(tmp_path / "corpus.bin")
    s = TokenStream.from_bin(tmp_path / "corpus.bin", batch_size=2, seq_len=32, seed=0)
    assert isinstance(s.tokens, np.memmap)
    ref = TokenStream(tokens, batch_size=2, seq_len=32, seed=0)
    x, _ = next(s)
    assert torch.equal(x, next(ref)[0]) and int(x.max()) > 255


def test_default_corpus_stream():
    s = TokenStream.from_corpus("pydoc", batch_size=2, seq_len=64, seed=0)
    assert s.n_windows == (len(load_corpus("pydoc").train) - 1) // 64
    assert int(next(s)[0].max()) < 256


def test_resume_from_json_state_equals_never_stopping():
    ref = TokenStream(_tokens(), batch_size=2, seq_len=16, seed=9)
    want = _take(ref, 10)
    a = TokenStream(_tokens(), batch_size=2, seq_len=16, seed=9)
    got = _take(a, 4)
    state = json.loads(json.dumps(a.state_dict()))
    b = TokenStream(_tokens(), batch_size=2, seq_len=16, seed=9)
    b.load_state_dict(state)
    got += _take(b, 6)
    assert all(torch.equal(p, q) for p, q in zip(want, got))


@pytest.mark.parametrize(("c", "o", "d"), [(3, 6, 9), (3, 4, 4), (0, 1, 12)])
def test_rollback_replays_c_to_o_and_removes_exactly_o_to_d(c, o, d):
    n = 20
    ref = TokenStream(_tokens(), batch_size=2, seq_len=16, seed=2)
    uninterrupted = _take(ref, n + (d - o + 1))
    run = TokenStream(_tokens(), batch_size=2, seq_len=16, seed=2)
    seen = _take(run, c + 1)                      # batches 0..c, then the checkpoint at c
    ckpt = json.loads(json.dumps(run.state_dict()))
    _take(run, d - c)                             # c+1..d: the anomaly, detected at d
    run = TokenStream(_tokens(), batch_size=2, seq_len=16, seed=2)
    run.load_state_dict(ckpt)                     # roll back to c
    run.skip(o, d)
    assert run.state_dict()["skip_ranges"] == [[o, d]]
    seen += _take(run, n - (c + 1))
    expected = [b for i, b in enumerate(uninterrupted) if not o <= i <= d][:n]
    assert len(seen) == len(expected) == n
    assert all(torch.equal(p, q) for p, q in zip(seen, expected))
    # a later restore keeps the range
    again = TokenStream(_tokens(), batch_size=2, seq_len=16, seed=2)
    again.load_state_dict(json.loads(json.dumps(run.state_dict())))
    assert torch.equal(next(again)[0], next(run)[0])


def test_index_of_maps_step_counts_past_skips():
    s = TokenStream(_tokens(), batch_size=1, seq_len=16)
    s.skip(2, 4)
    s.skip(5, 5)
    assert [s.index_of(k) for k in range(4)] == [0, 1, 6, 7]


def test_works_inside_a_dataloader_with_the_state_protocol():
    s = TokenStream(_tokens(), batch_size=2, seq_len=16, seed=4)
    loader = torch.utils.data.DataLoader(s, batch_size=None)
    it = iter(loader)
    first = [next(it)[0] for _ in range(3)]
    ref = TokenStream(_tokens(), batch_size=2, seq_len=16, seed=4)
    assert all(torch.equal(p, q) for p, q in zip(first, _take(ref, 3)))
    assert s.state_dict()["position"] == 3


def test_bad_input_names_the_field():
    with pytest.raises(ValueError, match="seq_len"):
        TokenStream(_tokens(100), batch_size=4, seq_len=64)
    s = TokenStream(_tokens(), batch_size=2, seq_len=16, seed=1)
    state = s.state_dict() | {"seed": 2}
    with pytest.raises(ValueError, match="seed=2"):
        s.load_state_dict(state)
    with pytest.raises(ValueError, match="skip range"):
        s.skip(5, 3)

import json
import pickle
import time

import numpy as np
import pytest
import torch

from spikeguard import TokenStream
from spikeguard.data import load_corpus


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


# -- DataLoader workers ----------------------------------------------------------------------

def _stream(**kw) -> TokenStream:
    return TokenStream(_tokens(20001), batch_size=2, seq_len=16, seed=4, **kw)


@pytest.mark.parametrize("workers", [0, 1, 2, 3])
def test_loader_yields_the_streams_own_batches_for_any_num_workers(workers):
    ref = _stream()
    ref.position = 3
    ref.skip(5, 6)
    ref.skip(9, 9)
    want = [(ref.next_index(), next(ref)) for _ in range(10)]
    s = _stream()
    s.position = 3
    s.skip(5, 6)
    s.skip(9, 9)
    with s.loader(num_workers=workers, prefetch_factor=3 if workers else None) as loader:
        for k, (index, (x, y)) in enumerate(want):
            got_x, got_y = next(loader)
            assert torch.equal(got_x, x) and torch.equal(got_y, y)
            assert s.position == loader.position == index + 1
            assert loader.last_worker == (k % workers if workers else 0)
    assert [i for i, _ in want] == [3, 4, 7, 8, 10, 11, 12, 13, 14, 15]


def test_state_after_k_batches_resumes_at_k_whatever_the_workers_prefetched():
    ref = _stream()
    want = [next(ref)[0] for _ in range(12)]
    s = _stream()
    loader = s.loader(num_workers=2, prefetch_factor=4)
    got = [next(loader)[0] for _ in range(5)]
    time.sleep(0.3)  # the two workers fill their queues: up to 8 batches past the 5th
    state = json.loads(json.dumps(loader.state_dict()))
    assert state["position"] == 5
    got += [next(loader)[0] for _ in range(3)]
    loader.close()
    resumed = _stream()
    resumed.load_state_dict(state)
    with resumed.loader(num_workers=3) as again:
        tail = [next(again)[0] for _ in range(7)]
    assert all(torch.equal(p, q) for p, q in zip(got, want[:8]))
    assert all(torch.equal(p, q) for p, q in zip(tail, want[5:12]))
    # restoring under a running loader drops what its workers prefetched
    with s.loader(num_workers=2) as live:
        for _ in range(4):
            next(live)
        live.load_state_dict(state)
        assert torch.equal(next(live)[0], want[5]) and s.position == 6


def test_skip_and_rollback_under_workers_equal_the_stream_without_workers():
    c, o, d, n = 3, 6, 9, 16
    ref = _stream()
    plain = [next(ref)[0] for _ in range(c + 1)]
    ckpt = json.loads(json.dumps(ref.state_dict()))
    ref.load_state_dict(ckpt)
    ref.skip(o, d)
    plain += [next(ref)[0] for _ in range(n - c - 1)]
    ref.skip(ref.position + 1, ref.position + 2)  # a range the workers have already prefetched
    plain += [next(ref)[0] for _ in range(4)]

    s = _stream()
    with s.loader(num_workers=2, prefetch_factor=4) as loader:
        got = [next(loader)[0] for _ in range(c + 1)]
        ckpt2 = loader.state_dict()
        anomaly = [next(loader)[0] for _ in range(d - c)]  # c+1..d, detected at d
        loader.load_state_dict(ckpt2)                   # roll back to c
        loader.skip(o, d)
        got += [next(loader)[0] for _ in range(n - c - 1)]
        time.sleep(0.2)
        loader.skip(s.position + 1, s.position + 2)
        got += [next(loader)[0] for _ in range(4)]
    assert ckpt2 == ckpt and s.state_dict() == ref.state_dict()
    assert len(got) == len(plain) and all(torch.equal(p, q) for p, q in zip(got, plain))
    assert all(torch.equal(a, s.batch(i)[0]) for a, i in zip(anomaly, range(c + 1, d + 1)))
    assert [s.index_of(k) for k in range(c + 1, c + 5)] == [4, 5, 10, 11]
    assert s.skip_ranges == [(6, 9), (21, 22)]


def test_plain_dataloader_with_workers_refuses_and_names_the_loader():
    loader = torch.utils.data.DataLoader(_stream(), batch_size=None, num_workers=1)
    with pytest.raises(RuntimeError, match=r"stream\.loader\(num_workers=1\)"):
        next(iter(loader))
    with pytest.raises(ValueError, match="StreamLoader sets batch_size itself"):
        _stream().loader(num_workers=2, batch_size=4)
    with pytest.raises(ValueError, match="persistent_workers"):
        _stream().loader(num_workers=2, persistent_workers=True)
    with pytest.raises(ValueError, match="num_workers=-1"):
        _stream().loader(num_workers=-1)


def test_memmapped_stream_travels_to_spawned_workers_as_its_path(tmp_path):
    tokens = _tokens(200_001)
    tokens.tofile(tmp_path / "corpus.bin")
    s = TokenStream.from_bin(tmp_path / "corpus.bin", batch_size=2, seq_len=16, seed=0)
    s.position = 7
    next(s)  # fills the permutation cache (100 kB), which stays behind
    blob = pickle.dumps(s)
    assert len(blob) < 2_000  # 400 kB of tokens and the cache are not in it
    copy = pickle.loads(blob)
    assert isinstance(copy.tokens, np.memmap) and copy.position == 8
    assert torch.equal(copy.batch(3)[0], s.batch(3)[0])
    arr = TokenStream(tokens, batch_size=2, seq_len=16, seed=0)
    assert torch.equal(pickle.loads(pickle.dumps(arr)).batch(3)[0], s.batch(3)[0])


def test_rank_and_world_size_default_to_one_process_and_refuse_half_given(monkeypatch):
    s = _stream()
    assert (s.rank, s.world_size) == (0, 1)
    with pytest.raises(ValueError, match="rank=1, world_size=None: give both"):
        _stream(rank=1)
    with pytest.raises(ValueError, match=r"rank=2 must be an integer in \[0, world_size=2\)"):
        _stream(rank=2, world_size=2)
    assert _stream(rank=1, world_size=2).rank == 1
    monkeypatch.setenv("WORLD_SIZE", "4")  # launched by torchrun, no process group yet
    with pytest.raises(ValueError, match="WORLD_SIZE=4 ranks but torch.distributed is not init"):
        _stream()
    assert _stream(rank=3, world_size=4).rank == 3

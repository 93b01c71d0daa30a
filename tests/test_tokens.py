"""The input-token check (guard/tokens.py): its score against float64 math, garbage inside the
warmup skipped with nothing changed, a change of data re-learned after at most max_run skips,
a resumed check equal to one never stopped, and every rank withholding alike."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import torch

import spikeguard as sg
from spikeguard.guard.tokens import BINS, DECAY, TokenCheck
from tests.dist import run_distributed
from tests.guard_harness import Fault, guarded_run, unchanged


def _batches(n: int, rows: int = 8, seed: int = 0) -> list[torch.Tensor]:
    stream = sg.TokenStream.from_corpus("pydoc", batch_size=rows, seq_len=64, seed=seed)
    return [next(stream)[0] for _ in range(n)]


def _reference_scores(batches: list[torch.Tensor]) -> list[float]:
    """Each batch's mean surprise under the decayed counts of the batches before it, in float64
    Python arithmetic (no batch is flagged here)."""
    counts: dict[int, float] = {}
    out = []
    for x in batches:
        ids = [int(v) % BINS for v in x.flatten()]
        n, seen = sum(counts.values()), sum(c > 0 for c in counts.values()) + 1
        out.append(math.nan if n == 0 else sum(
            -math.log((counts.get(i, 0.0) + 0.5) / (n + 0.5 * seen)) for i in ids) / len(ids))
        counts = {k: v * (1 - 1 / DECAY) for k, v in counts.items()}
        for i, c in Counter(ids).items():
            counts[i] = counts.get(i, 0.0) + c
    return out


def _feed(check: TokenCheck, batches: list[torch.Tensor]) -> list[tuple[float, bool]]:
    seen = []
    for x in batches:
        check.add(x)
        score, flag = check.gate()
        seen.append((float(score), bool(flag)))
        check.observe(float(score), bool(flag))
    return seen


def test_the_score_is_the_batch_surprise_under_the_run_frequencies():
    batches = _batches(40)
    got = _feed(TokenCheck(10.0, 5), batches)
    ref = _reference_scores(batches)
    assert math.isnan(got[0][0]) and math.isnan(ref[0])
    for (score, flag), want in zip(got[1:], ref[1:]):
        assert score == pytest.approx(want, rel=1e-12) and not flag


def test_padding_marked_negative_is_left_out():
    """Ids marked -1 (padding, a share that varies by batch) give exactly the scores and counts
    of the batches without them; a batch of padding only gives no score and changes nothing."""
    batches = _batches(30)
    padded = []
    for i, x in enumerate(batches):
        x = x.clone()
        x[i % 8, (i * 7) % 64:] = -1  # a tail of padding on one row
        padded.append(x)
    plain, masked = TokenCheck(10.0, 5), TokenCheck(10.0, 5)
    got = _feed(masked, padded)
    want = _feed(plain, [x[x >= 0] for x in padded])
    for (a, fa), (b, fb) in zip(got[1:], want[1:]):
        assert a == pytest.approx(b, rel=1e-12) and fa == fb
    assert torch.equal(masked.counts, plain.counts)
    before = masked.counts.clone()
    masked.add(torch.full((8, 64), -1))
    score, flag = masked.gate()
    assert math.isnan(float(score)) and not bool(flag)
    assert torch.equal(masked.counts, before)


def test_random_and_repeated_ids_are_flagged_real_text_is_not():
    """At 32 rows of 64 bytes: the most frequent byte repeated (a space) is some 25 spreads
    under the median (at 8 rows only about 12, inside the bar: the weak case)."""
    check = TokenCheck(10.0, 5)
    _feed(check, _batches(30, rows=32))
    gen = torch.Generator().manual_seed(0)
    for garbage in (torch.randint(0, 256, (32, 64), generator=gen),
                    torch.full((32, 64), int(torch.argmax(check.counts)))):
        saved = check.counts.clone()
        check.add(garbage)
        _, flag = check.gate()
        assert bool(flag)
        assert torch.equal(check.counts, saved)  # a flagged batch is never folded in
    check.add(_batches(31, rows=32)[30])
    assert not bool(check.gate()[1])


def test_a_resumed_check_equals_one_never_stopped():
    batches = _batches(60, seed=3)
    whole = TokenCheck(10.0, 5)
    first = _feed(whole, batches)
    half = TokenCheck(10.0, 5)
    _feed(half, batches[:25])
    resumed = TokenCheck(10.0, 5)
    resumed.load_state_dict(json.loads(json.dumps(half.state_dict())))
    assert resumed.bar() == half.bar()
    assert _feed(resumed, batches[25:]) == first[25:]


def test_token_ids_must_be_integers():
    with pytest.raises(ValueError, match="integer tensor"):
        TokenCheck(10.0, 5).add(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="token_z"):
        sg.GuardConfig(token_z=-1.0)


def _tokens_reasons(run) -> dict[int, tuple[str, ...]]:
    return {v.step: v for v in run.verdicts if any(r.startswith("tokens:") for r in v.reasons)}


@pytest.mark.parametrize("read_lag", [0, 1])
def test_garbage_inside_the_warmup_is_skipped_only_with_the_check(read_lag):
    garbage = [Fault("garbage", 10)]
    run = guarded_run(steps=60, tokens=True, faults=garbage, watch=(10,), read_lag=read_lag)
    flagged = _tokens_reasons(run)
    assert set(flagged) == {10}, sorted(flagged)
    v = flagged[10]
    assert v.tier == 1 and v.skip and v.action is sg.Action.SKIP
    assert unchanged(*run.around[10])  # weights and optimizer state as they were
    assert run.guard.withheld == 1
    if read_lag == 0:
        blind = guarded_run(steps=60, faults=[Fault("garbage", 10)], watch=(10,))
        assert not unchanged(*blind.around[10])  # without tokens= no rule sees it in the warmup


def test_a_change_of_data_is_relearned_after_at_most_max_run_skips():
    run = guarded_run(steps=80, tokens=True, faults=[Fault("shift", 40, mult=97)])
    flagged = _tokens_reasons(run)
    n = run.guard.config.detector.max_consecutive_skips
    assert sorted(flagged) == list(range(40, 40 + n))
    assert "re-learns" in flagged[40 + n - 1].reasons[-1]
    assert run.halted is None  # (the loss rules judge the new data on their own)


def _ranks(rank: int, world: int) -> list[tuple[int, bool, bool]]:
    """Two ranks, the garbage on rank 1's batch at step 12 only: (step, skip, tokens reason)."""
    torch.manual_seed(0)
    model = sg.GPT(sg.GPTConfig.tiny())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    guard = sg.Guard(model, opt, config=sg.GuardConfig(
        detector=sg.DetectorConfig.for_run(40), weights_check=False))
    stream = sg.TokenStream.from_corpus("pydoc", batch_size=4, seq_len=64, seed=rank)
    seen = []
    for t in range(20):
        x, y = next(stream)
        if rank == 1 and t == 12:
            x = torch.randint(0, 256, x.shape, generator=torch.Generator().manual_seed(5))
        out = model.loss(model(x), y)
        guard.backward(out)
        for v in guard.step(out, tokens=x):
            seen.append((v.step, v.skip, any(r.startswith("tokens:") for r in v.reasons)))
    return seen


@pytest.mark.dist
def test_every_rank_withholds_a_batch_one_rank_finds_off():
    a, b = run_distributed(_ranks, 2)
    assert a == b
    assert [s for s, skip, tok in a if skip or tok] == [12]

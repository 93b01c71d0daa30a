"""The input-token check's false alarms on clean data, and the garbage it catches.

``guard/tokens.py`` skips a batch whose input ids average a surprise under the run's own token
frequencies more than ``GuardConfig.token_z`` (10) of the run's own spreads from its median,
either way. This runs the guard's ``TokenCheck`` itself (the same ``add``/``gate``/``observe``
the guard calls, the host read right after each step as at read_lag 0) over clean
``sg.TokenStream`` batches of 64 tokens a row, no model needed:

- **clean**: every batch of ``--steps`` (1,000), each scored against the bar it met; the batches
  flagged (the false alarms, per 1,000 armed batches) and the largest distance from the median
  in the run's spreads (the bar is ``token_z`` spreads, widened by 1 + 8/n over n scores);
- **planted**, not trained on (the clean run goes on with its own batch): at steps 10 (inside a
  20-step warmup, where no rule that reads the model can tell), 50, 150 and every 250th after,
  a batch of random ids (the zoo's outlier), a batch of one id repeated (the most frequent one
  so far: the least surprising garbage there is) and a batch whose rows are half random: the
  z each gets and the share past the bar.

Settings: byte tokens (vocab 256) and a byte-level BPE of 4,096 ids trained on the corpus, at
4, 8, 32 and 64 rows; the pydoc corpus seeds 0-3 are where the bar was chosen (tuning), the
stdlib corpus (Python source: another language of tokens) and pydoc seeds 4-7 are held out.

    PYTHONPATH=src:. python benchmarks/token_far.py [--steps 1000] [--z 10]

``--matrix``: instead, every clean stream of ``benchmarks/detection.py``'s matrix as
``spikeguard train`` draws it (tiny: batch 8, seeds 0-9, its longest run of 1,000 steps plus
the 100 a run may make up; demo: batch 16, seeds 0-4, 300 + 100), through the check: the check
reads nothing but the ids, so a stream with no batch flagged here is a guarded clean run that
the check leaves bit for bit as it was (the flag is the only thing it adds to a step).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

__all__ = ["main", "measure"]

ROWS = (4, 8, 32, 64)
PLANT = (10, 50, 150)
HALVES = {"tuning": (("pydoc", (0, 1, 2, 3)),),
          "held-out": (("pydoc", (4, 5, 6, 7)), ("stdlib", (0, 1, 2, 3)))}


def _z(check: Any, score: float) -> tuple[float, bool]:
    """The distance of ``score`` from the check's median in its spreads, and whether it is past
    the bar (NaN, False while unarmed)."""
    bar = check.bar()
    if bar is None:
        return float("nan"), False
    return (score - bar[0]) / bar[1], abs(score - bar[0]) > bar[2]


def _probe(check: Any, x: torch.Tensor) -> tuple[float, bool]:
    """``_z`` of batch ``x`` against ``check`` as it stands, nothing folded in."""
    saved = check.counts.clone()
    check.add(x)
    score, _ = check.gate()
    check.counts = saved
    return _z(check, float(score))


def measure(tokens: Any, rows: int, seed: int, steps: int, z: float,
            vocab: int) -> dict[str, Any]:
    import spikeguard as sg
    from spikeguard.guard.tokens import TokenCheck

    check = TokenCheck(z, max_run=5)
    stream = sg.TokenStream(tokens, batch_size=rows, seq_len=64, seed=seed)
    gen = torch.Generator().manual_seed(1000 + seed)
    zs, flags, armed, planted = [], 0, 0, {"random": [], "repeat": [], "half": []}
    for t in range(steps):
        x, _ = next(stream)
        if check.bar() is not None and (t in PLANT or (t > 0 and t % 250 == 0)):
            ids = torch.randint(0, vocab, x.shape, generator=gen)
            top = int(torch.argmax(check.counts))
            half = x.clone()
            half[: max(1, rows // 2)] = ids[: max(1, rows // 2)]
            planted["random"].append(_probe(check, ids))
            planted["repeat"].append(_probe(check, torch.full_like(x, top)))
            planted["half"].append(_probe(check, half))
        was_armed = check.bar() is not None
        check.add(x)
        score, flag = check.gate()
        if was_armed:
            armed += 1
            zs.append(abs(_z(check, float(score))[0]))
        flags += bool(flag)
        check.observe(float(score), bool(flag))
    return {"armed": armed, "flags": flags, "max_z": max(zs), "planted": planted}


def _data(corpus: str, bpe: bool) -> Any:
    from spikeguard.train.data import load_train_data
    return load_train_data(corpus=corpus, data=None, tokenizer="bpe" if bpe else "bytes",
                           vocab_size=4096 if bpe else None)


def matrix(z: float) -> int:
    """The matrix's clean streams through the check (module docstring); returns the flags."""
    import spikeguard as sg
    from spikeguard.guard.tokens import TokenCheck
    from spikeguard.train.data import load_train_data

    data = load_train_data(corpus="pydoc", data=None, tokenizer="bytes", vocab_size=None)
    total = 0
    for model, rows, seeds, steps in (("tiny", 8, 10, 1100), ("demo", 16, 5, 400)):
        seq = getattr(sg.GPTConfig, model)().seq_len
        for seed in range(seeds):
            check = TokenCheck(z, max_run=5)
            stream = sg.TokenStream(data.train, batch_size=rows, seq_len=seq, seed=seed)
            flags, worst = [], 0.0
            for t in range(steps):
                x, _ = next(stream)
                bar = check.bar()
                check.add(x)
                score, flag = check.gate()
                if bar is not None:
                    worst = max(worst, abs(float(score) - bar[0]) / bar[1])
                if bool(flag):
                    flags.append(t)
                check.observe(float(score), bool(flag))
            total += len(flags)
            print(f"{model} seed {seed}: {steps} batches of {rows}x{seq}, flagged {flags or 'none'}, "
                  f"largest distance {worst:.1f} spreads", flush=True)
    print(f"matrix clean streams: {total} batches flagged")
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--z", type=float, default=10.0)
    p.add_argument("--matrix", action="store_true", help="the detection matrix's clean streams")
    args = p.parse_args(argv)
    if args.matrix:
        matrix(args.z)
        return 0
    print("| half | corpus | tokens | rows | runs | armed batches | false skips (per 1k) | "
          "largest distance (spreads) | random: past the bar (least distance) | repeat | "
          "half random |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for half, groups in HALVES.items():
        for corpus, seeds in groups:
            for bpe in (False, True):
                data = _data(corpus, bpe)
                for rows in ROWS:
                    res = [measure(data.train, rows, s, args.steps, args.z, data.vocab_size)
                           for s in seeds]
                    _row(half, corpus, "bpe 4096" if bpe else "bytes", rows, res)
    return 0


def _row(half: str, corpus: str, kind: str, rows: int, res: list[dict[str, Any]]) -> None:
    armed, flags = sum(r["armed"] for r in res), sum(r["flags"] for r in res)

    def caught(key: str) -> str:
        v = [x for r in res for x in r["planted"][key]]
        return f"{sum(past for _, past in v)}/{len(v)} ({min(abs(d) for d, _ in v):.1f})"
    print(f"| {half} | {corpus} | {kind} | {rows} | {len(res)} | {armed} | {flags} "
          f"({1000 * flags / armed:.2f}) | {max(r['max_z'] for r in res):.1f} | "
          f"{caught('random')} | {caught('repeat')} | {caught('half')} |", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())

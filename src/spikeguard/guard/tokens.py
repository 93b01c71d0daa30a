"""The batch's input tokens against the run's own: garbage that no training number shows yet.

Inside the LR warmup the loss falls fast and the grad norm moves with it, so a batch of random
token ids (a corrupt shard, a reader gone wrong) looks like any other step to every rule that
reads the model: its loss is the loss of a model that has learned little yet, and a row of
random input scores only 2-9 robust z within its batch (``benchmarks/quarantine_far.py``). Its
inputs are what is wrong, and they are visible before any weight moves.

The statistic: the batch's mean surprise under the run's own token frequencies, in nats,
``-mean log p(token)`` with ``p(v) = (c_v + 1/2) / (N + K/2)``; ``c`` the counts of the batches
kept so far (decayed by ``1 - 1/DECAY`` per kept batch, so a slow change of the data mix is
followed), ``N`` their sum, ``K`` the bins seen plus one. Token ids fall into ``BINS`` bins
(``id mod BINS``: exact up to 65,536 ids, merged above, which only blunts the test); a
negative id is padding and is left out of the counts and the score, so a batch whose share of
padding varies is judged on its real tokens only. Random ids
are surprising; one id repeated is unsurprising far below any real batch; so the test is
two-sided: ``|score - median| > z x spread x (1 + ARM_AFTER / n)`` over the last ``n <=
WINDOW`` kept batches (spread: 1.4826 x the median absolute deviation, at least ``REL_FLOOR`` of
the median), armed from ``ARM_AFTER`` kept batches. The widening is for the first batches, when
the counts are thin (a byte seen for the first time is very surprising) and a spread read off 8
scores is often too narrow: in clean pydoc streams the largest distance in the first 64 batches
was 11.7 spreads, after them 6. The bar ``GuardConfig.token_z`` is a count of the run's own spreads;
its false-alarm rate and the garbage it catches are measured on clean runs by
``benchmarks/token_far.py`` (docs/design.md, "The input tokens").

All of it runs on the tokens' device: a histogram by ``index_add_`` into float64 (counts are
exact integers), the score, and the flag against the bar the host set from the read-back scores
(one step late on a GPU); no host read. A flagged batch is withheld on every rank (the flag is
agreed with the step's one all-reduce), never folded into the counts or the scores, and the
step is a Tier 1 skip blamed on its data: the weights do not choose the input. ``max_run``
flags in a row are a change of data, not garbage (a new mix, a new source): the check forgets
what it learned and re-learns from the next batch, so it never withholds more than ``max_run``
batches in a row, and the reason says so.

The counts and scores are each rank's own (its own data), and they go into the guard's state
as JSON: a checkpointer that keeps one copy of the guard's state for all ranks (rank 0's)
restores rank 0's counts and scores on every rank, so after such a resume the other ranks'
bars re-form from the same corpus over their next 64 batches; the flag stays agreed.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any

import torch

from ..measure.spread import MAD_SCALE
from ..record import Action

__all__ = ["TokenCheck", "tokens_judged"]

BINS = 1 << 16
DECAY = 1024
WINDOW = 64
ARM_AFTER = 8
REL_FLOOR = 0.005


class TokenCheck:
    """The batch's token frequencies against the run's (module docstring)."""

    def __init__(self, z: float, max_run: int) -> None:
        self.z = z
        """The bar in spreads (``GuardConfig.token_z``); 0: off."""
        self.max_run = max_run
        self.counts: torch.Tensor | None = None
        self._batch: torch.Tensor | None = None
        self.scores: deque[float] = deque(maxlen=WINDOW)
        """The scores of the last ``WINDOW`` batches kept (read back, host floats)."""
        self.run = 0
        """Flags in a row, as read back."""
        self._forget = False

    @classmethod
    def of(cls, config: Any) -> TokenCheck:
        """The check a GuardConfig asks for (off under ``respond=False``: nothing is withheld
        there, as for the LR jump)."""
        return cls(config.token_z if config.respond else 0.0,
                   config.detector.max_consecutive_skips)

    @property
    def active(self) -> bool:
        return self.z > 0

    def add(self, tokens: Any) -> None:
        """Note one micro-batch's input token ids (any shape; on any device) for this step's
        check; a negative id is padding, left out (``ids.masked_fill(attention_mask == 0, -1)``
        marks it without a host read). ValueError for anything but integer ids."""
        if not self.active or tokens is None:
            return
        if (not isinstance(tokens, torch.Tensor) or tokens.is_floating_point()
                or tokens.is_complex() or tokens.dtype == torch.bool):
            kind = tokens.dtype if isinstance(tokens, torch.Tensor) else type(tokens).__name__
            raise ValueError(f"tokens= must be the batch's input token ids (an integer tensor), got "
                             f"{kind}; pass the ids the model embeds (x), not its embeddings or "
                             "logits, or leave tokens out to turn the check off for the loop")
        ids = tokens.detach().reshape(-1).long()
        if self._batch is not None:
            ids = torch.cat([self._batch, ids.to(self._batch.device)])
        self._batch = ids

    def clear(self) -> None:
        """Forget the ids added since the last step (micro-batches dropped: a rollback, a
        framework's dry run)."""
        self._batch = None

    def bar(self) -> tuple[float, float, float] | None:
        """(median, spread, allowed distance) of the scores kept so far; None while unarmed.
        The distance is ``z`` spreads widened by ``1 + ARM_AFTER / n`` over ``n`` scores (2x at
        arming, 1.125x with the window full): a spread read off a few early batches, against
        counts still thin, is too narrow (module docstring)."""
        n = len(self.scores)
        if n < ARM_AFTER:
            return None
        med = statistics.median(self.scores)
        mad = statistics.median(abs(s - med) for s in self.scores)
        spread = max(MAD_SCALE * mad, REL_FLOOR * abs(med), 1e-9)
        return med, spread, self.z * (1.0 + ARM_AFTER / n) * spread

    def gate(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This step's (score, flag) as 0-d device tensors, the batch folded into the counts
        unless flagged; None when no tokens came this step."""
        ids, self._batch = self._batch, None
        if ids is None:
            return None
        w = (ids >= 0).to(torch.float64)  # a negative id is padding: left out
        ids = ids.clamp(min=0).remainder(BINS)
        if self.counts is None or self._forget:
            self.counts, self._forget = torch.zeros(BINS, dtype=torch.float64,
                                                    device=ids.device), False
        c = self.counts = self.counts.to(ids.device)
        b = torch.zeros_like(c).index_add_(0, ids, w)
        n, seen, m = c.sum(), (c > 0).sum() + 1, w.sum()
        # -mean log p(id), p = (c + 1/2) / (n + seen/2): only the batch's own ids are read
        mean_log_p = (w * torch.log(c[ids] + 0.5)).sum() / m.clamp(min=1)
        surprise = torch.log(n + 0.5 * seen) - mean_log_p
        # NaN before any batch was kept (no frequencies to be surprised by) or for a batch of
        # padding only: no score, no flag
        score = torch.where((n > 0) & (m > 0), surprise, math.nan)
        bar = self.bar()
        if bar is None:
            flag = torch.zeros((), dtype=torch.bool, device=b.device)
        else:
            flag = (score - bar[0]).abs() > bar[2]
        keep = (~flag & (m > 0)).to(c.dtype)
        c.mul_(1.0 - keep / DECAY).add_(b * keep)
        return score, flag

    def observe(self, score: float, flagged: bool) -> str | None:
        """The host's read of a step's (score, agreed flag); a reason when the step is withheld
        for its tokens."""
        if not flagged:
            if math.isfinite(score):
                self.scores.append(score)
            self.run = 0
            return None
        self.run += 1
        bar = self.bar()
        why = (f"tokens: the batch's input ids average {score:.3f} nats of surprise under the "
               f"run's own token frequencies, {abs(score - bar[0]) / bar[1]:.1f} spreads from "
               f"the median of the last {len(self.scores)} kept batches ({bar[0]:.3f}; bar "
               f"+-{bar[2]:.3f})" if bar is not None and math.isfinite(score) else
               "tokens: another rank's batch of input ids was past its bar")
        if self.run >= self.max_run:
            self.scores.clear()
            self.run, self._forget = 0, True
            why += (f"; {self.max_run} batches in a row: taken as a change of the data, the "
                    "check forgets the run's frequencies and re-learns from the next batch")
        return why

    def state_dict(self) -> dict[str, Any]:
        """JSON-ready: the counts as {bin: count} of the nonzero bins (a host read)."""
        counts: dict[int, float] = {}
        if self.counts is not None:
            c = self.counts.cpu()  # one copy
            idx = torch.nonzero(c).flatten()
            counts = dict(zip(idx.tolist(), c[idx].tolist()))
        return {"counts": counts, "scores": list(self.scores), "run": self.run,
                "forget": self._forget}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if not state:
            return
        self.scores = deque((float(s) for s in state["scores"]), maxlen=WINDOW)
        self.run, self._forget = int(state["run"]), bool(state.get("forget", False))
        counts = state.get("counts") or {}
        if counts:
            c = torch.zeros(BINS, dtype=torch.float64)
            idx = torch.tensor([int(k) for k in counts], dtype=torch.long)
            c[idx] = torch.tensor([float(v) for v in counts.values()], dtype=torch.float64)
            self.counts = c
        else:
            self.counts = None


def tokens_judged(out: Any, why: str | None) -> Any:
    """A step withheld for its input tokens (``why``) is a Tier 1 skip blamed on its data (or
    stays the higher tier another rule gave it, a halt included)."""
    v = out.verdict
    if why is None or v.tier >= 3:
        return out
    out.cause = "data"
    out.verdict = v._replace(tier=max(v.tier, 1), reasons=(*v.reasons, why), skip=True,
                             action=Action.SKIP if v.tier <= 1 else v.action)
    return out

"""Attribution of a skipped step: was it the data or the machine, and which sequences did it.

A Tier 1 skip leaves the weights as they were before the step, so re-running the step's batch (the
``rerun`` closure given to ``guard.step``) is cheap and must reproduce it: loss and grad norm equal
within ``rerun_rtol`` (bit-equal on deterministic kernels) mean the data caused the spike; anything
else means a transient fault (hardware, a numeric accident). ``rerun_budget`` (a share of the steps
so far) plus ``rerun_allowance`` (a fixed number a run) bound the re-runs. From the per-sequence
values of the loss (``LossOutput.sequences``, no extra pass) the sequences whose mean loss or log Z
stands out against the rest of the batch (a robust z-score: median and MAD over the rows of every
data-parallel rank) are quarantined, one JSON line each in ``quarantine.jsonl`` beside the metrics
file. With ``drop_sequences`` the guard re-runs the step without them (``guard.backward`` weighs
each rank's loss so that the update is the mean over the tokens kept on every rank) and applies
that update if it passes the gate; a Tier 2 rollback drops them from its data range instead of
skipping it whole.

A skip that the re-run reproduced with nothing in the batch out of place (the grad norm alone
flagged it, its loss within one robust spread of the recent median, no sequence that explains it:
``_no_evidence``) is let through at read_lag 0: the step part applies the clipped gradients
still in place (``Updater.release``), cause ``unknown``. Such a spike is the weights' more often
than the batch's, and skipping it can leave the weights where the next batches spike too. A
quarantined sequence explains it only when the batch without it passes the gate (one more
re-run, ``Updater.apply_without(apply=False)``): the z-score bar alone is passed by the top row
of 85-162 clean batches in 1,000 at 4-8 rows (367-444 at 32), on the pydoc corpus
(``benchmarks/quarantine_far.py``), and at a spike such a row need not be its cause.

Every decision here is taken from all-reduced or gathered numbers, so every rank takes it alike.
``Attribution.judge`` returns a :class:`Finding` (cause, rows, keep mask); it applies nothing:
the re-run without the quarantined rows goes through the step part (``Updater.apply_without``),
the one place an update is applied.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import _dist
from .._validate import check_int, check_positive
from ..sinks import encode_record
from .outliers import outliers, robust_z

__all__ = ["Attribution", "AttributionConfig", "Finding", "kept_weight", "outliers", "robust_z"]

log = logging.getLogger("spikeguard")

_KEEP = 1000
"""Skipped steps whose cause and quarantined sequences the guard remembers (Tier 2 looks back)."""


def _ordinary(verdict: Any, f: Finding) -> bool:
    """A Tier 1 skip on the grad norm alone, its loss within the loss's own noise of the recent
    median (at most one robust spread above it, ``loss_spread``: the step-to-step noise the loss
    bar is sized from) and less than one loss bar below it, reproduced by the re-run (not
    transient): nothing in the batch moved the loss (garbage does: random bytes raise it,
    repeated bytes collapse it). A bar at the median itself, which half of all healthy batches
    pass, skipped every such spike on Python source (the zoo's stdlib cell: 5 reproduced grad
    spikes of 2.7-4.3x the median at 0.1-0.9 spreads above the median loss, in 4 clean runs)."""
    ev = verdict.evidence
    loss, med, limit = ev.get("loss", math.nan), ev.get("loss_median", math.nan), ev.get(
        "loss_limit", math.nan)
    noise = ev.get("loss_spread", math.nan)
    top = med + noise if noise == noise else med  # NaN (no spread yet): the median itself
    return (verdict.tier == 1 and ev.get("loss_flag") is False
            and med - (limit - med) <= loss <= top and f.cause == "data")


def _named(rows: list[dict[str, Any]]) -> str:
    """The first four rows, named for the reasons."""
    return ", ".join(f"batch {q['stream_index']} rank {q['rank']} row {q['row']} (micro-batch "
                     f"{q['micro_batch']} row {q['micro_row']}, z {q['z']:.3g})"
                     for q in rows[:4])


def _no_evidence(verdict: Any, f: Finding) -> bool:
    """An ordinary skip (``_ordinary``) that no sequence explains: none quarantined (outlier
    rows without which the batch still fails the gate are not: ``Attribution._explain``).
    Tiny, LR 1e-2, seed 5: such a batch skipped at step 76 (10x the median grad norm) left
    weights on which the next batches reached 57x; two more skips, 3.7% worse."""
    return _ordinary(verdict, f) and not f.quarantined


@dataclass(kw_only=True, frozen=True)
class AttributionConfig:
    """What the guard does after a skip: re-run it, quarantine sequences, drop them."""

    rerun: bool = True
    """Re-run a skipped step's batch to tell data-caused from transient (needs guard.step(rerun=))."""
    rerun_budget: float = 0.01
    """Steps that may be re-run, as a share of the steps so far, rounded up (the first one may),
    on top of ``rerun_allowance``."""
    rerun_allowance: int = 4
    """Steps that may be re-run beyond the share, whenever they come: grad spikes come in
    clusters (a 200x spike, then three of 2-15x within 12 steps, on a small BPE model) that the
    share alone leaves unexamined, and so skipped. At most this many extra forward and backward
    passes in a whole run (two each where a quarantined sequence is tested)."""
    rerun_rtol: float = 1e-3
    """Loss and grad norm reproduced within this relative difference mean the data caused it."""
    quarantine_z: float = 5.0
    """Quarantine a sequence of a skipped batch whose loss or log Z has a robust z-score (median,
    MAD) above this. The top row of a clean batch of 4-8 rows passes 5 about once in eight
    batches (pydoc; 32 rows: four in ten), so a quarantined row holds a grad-only skip at an
    ordinary loss only if the batch without it passes the gate."""
    drop_sequences: bool = False
    """Re-run a data-caused skip without its quarantined sequences and apply that update; a
    non-finite step whose non-finite values all come from some sequences (a corrupt sample)
    is re-run without them instead of halting (a non-finite value no sequence explains halts)."""

    def __post_init__(self) -> None:
        check_positive(self.rerun_budget, "AttributionConfig.rerun_budget", default=0.01,
                       hint="0.01 allows one re-run per 100 steps")
        check_int(self.rerun_allowance, "AttributionConfig.rerun_allowance", minimum=0,
                  default=4, hint="0 leaves only the share")
        check_positive(self.rerun_rtol, "AttributionConfig.rerun_rtol", default=1e-3)
        check_positive(self.quarantine_z, "AttributionConfig.quarantine_z", default=5.0,
                       hint="z > 5 is far outside ordinary batch-to-batch spread")
        for name in ("rerun", "drop_sequences"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"AttributionConfig.{name}={getattr(self, name)!r} must be "
                                 "True or False")


def _close(a: float, b: float, rtol: float) -> bool:
    if not (math.isfinite(a) and math.isfinite(b)):  # a non-finite value reproduced is the same
        return (math.isnan(a) and math.isnan(b)) or a == b
    return a == b or abs(a - b) <= rtol * max(abs(a), abs(b))


def _takes_keep(fn: Any) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "keep" or p.kind is p.VAR_KEYWORD for p in params)


@dataclass
class Finding:
    """Attribution's decision for one skipped step: the cause, the rows, what to drop."""

    cause: str = "unknown"
    """"data" (the re-run reproduced the step), "transient" (it did not) or "unknown"."""
    reasons: list[str] = field(default_factory=list)
    """Text for the verdict's reasons."""
    rerun: dict[str, float] | None = None
    """The verifying re-run's loss and grad norm (None: not re-run)."""
    rows: list[dict[str, Any]] = field(default_factory=list)
    """Every rank's rows of the step (gathered)."""
    quarantined: list[dict[str, Any]] = field(default_factory=list)
    keep: torch.Tensor | None = None
    """When the step should be re-run without its quarantined rows: this rank's rows to keep."""
    weight: float = 1.0
    """This rank's loss weight in that re-run (R n_r / N: the global token mean)."""
    drop: Any = None
    """What the re-run without the quarantined rows did (the step part's RerunUpdate)."""

    def record(self) -> dict[str, Any]:
        """The record's keys of this finding (``cause`` is the outcome's)."""
        rec: dict[str, Any] = {}
        if self.rerun is not None:
            rec["rerun"] = self.rerun
        if self.quarantined:
            rec["quarantined"] = len(self.quarantined)
        if self.drop is not None:
            rec.update(kept_rows=[len(self.rows) - len(self.quarantined), len(self.rows)],
                       kept_loss=self.drop.loss, kept_grad_norm=self.drop.grad_norm)
        return rec


class Attribution:
    """The guard's attribution of skipped steps (module docstring); state in ``state_dict``.

    Built with what it reads: the step part (``Updater``: ``measure_rerun`` measures a re-run's
    gradients, ``apply_without`` re-runs without some rows), the batch ledger (rows of a batch)
    and the sinks (``quarantine.jsonl`` goes beside the JSONL sink's file)."""

    def __init__(self, config: AttributionConfig, *, updater: Any = None, ledger: Any = None,
                 sinks: Any = None) -> None:
        self.config = config
        self.updater, self.ledger, self.sinks = updater, ledger, sinks
        self.measure: Callable[..., Any] | None = (updater.measure_rerun if updater is not None
                                                   else None)
        self.reruns = 0
        """Steps re-run so far, against the budget: each cost one extra forward and backward,
        two when the re-run without the quarantined sequences followed."""
        self.skips: deque[tuple[int, str, list[tuple[int | None, int, int]]]] = deque(maxlen=_KEEP)
        """(step, cause, quarantined (stream index, rank, row)) of each skip; cause is "data",
        "transient" or "unknown" (not re-run)."""
        self.path: Path | None = None
        """The quarantine file; None: ``quarantine.jsonl`` beside the guard's JSONL sink's file."""
        self._warned_keep = self._warned_weight = False

    def _allowed(self, step: int) -> bool:
        cfg = self.config
        return self.reruns + 1 <= cfg.rerun_allowance + math.ceil(cfg.rerun_budget * (step + 1))

    # -- the skip -----------------------------------------------------------------------------
    def release_asked(self, verdict: Any, f: Finding) -> bool:
        """Whether the skip carries no evidence against its batch (``_no_evidence``), so the
        clipped update should go through after all."""
        return _no_evidence(verdict, f)

    def judge(self, p: Any, verdict: Any, loss: float, norm: float) -> Finding:
        """Attribute the skipped step ``p`` (its ``rerun`` and per-sequence ``rows``; ``verdict``
        the detector's): re-run it within the budget, quarantine outlier rows, and say whether
        to re-run without them; for an ordinary skip, whether they explain it. Runs with the
        caller's gradients set aside (``GradsAside``)."""
        cfg, f, tier = self.config, Finding(), verdict.tier
        if cfg.rerun and p.rerun is not None and self._allowed(p.step):
            self.reruns += 1
            loss1, _, norm1, _ = self.measure(p.rerun())
            same = ((_close(loss, loss1, cfg.rerun_rtol) or math.isnan(loss1))
                    and _close(norm, norm1, cfg.rerun_rtol))
            f.cause = "data" if same else "transient"
            f.rerun = {"loss": loss1, "grad_norm": norm1}
            f.reasons.append(f"rerun: {f.cause} (loss {loss:.4g} -> {loss1:.4g}, grad norm "
                             f"{norm:.4g} -> {norm1:.4g})")
        f.rows = self._rows(p) if f.cause != "transient" else []
        f.quarantined = outliers(f.rows, cfg.quarantine_z)
        if tier == 3:  # a non-finite step: only the rows with non-finite values explain it
            f.quarantined = [q for q in f.quarantined if q["z"] == math.inf]
        at = len(f.reasons)  # the quarantine's reason goes here, before the drop's or test's
        # the same re-run step: the budget was charged by the verifying pass. A non-finite
        # step (Tier 3) whose non-finite values all sit in some rows is re-run without them
        # whatever the verifying pass said: the re-run without them is the test (it must be
        # finite and pass the gate to be applied); a non-finite step no row explains halts
        some = 0 < len(f.quarantined) < len(f.rows)
        if cfg.drop_sequences and some and ((tier == 1 and f.cause == "data") or tier == 3):
            self._plan_drop(p, f)
        elif some and _ordinary(verdict, f):
            self._explain(p, f)  # rows that do not explain the skip are not quarantined
        if f.quarantined:
            self._write(p.step, f.quarantined)
            f.reasons.insert(at, f"quarantined {len(f.quarantined)} sequence(s): "
                             + _named(f.quarantined))
        self.skips.append((p.step, f.cause, [(q["stream_index"], q["rank"], q["row"])
                                             for q in f.quarantined]))
        return f

    def _plan_drop(self, p: Any, f: Finding) -> None:
        if not _takes_keep(p.rerun):
            if not self._warned_keep:
                self._warned_keep = True
                log.warning("spikeguard: drop_sequences needs a rerun closure that takes keep= "
                            "(a bool tensor of the rows to keep); skipping whole batches instead")
            f.reasons.append("drop: rerun takes no keep=; skipped the batch")
            return
        f.keep, f.weight = self._kept(p, f)

    def _kept(self, p: Any, f: Finding) -> tuple[torch.Tensor, float]:
        """(this rank's rows to keep: all but the quarantined, their loss weight)."""
        rank = _dist.rank()
        gone = {q["pos"] for q in f.quarantined if q["rank"] == rank}
        n_local = sum(1 for r in f.rows if r["rank"] == rank)
        device = (p.rows[0].ce.device if p.rows and p.rows[0] is not None
                  else torch.device("cpu"))
        keep = torch.tensor([i not in gone for i in range(n_local)], dtype=torch.bool,
                            device=device)
        return keep, kept_weight(f.rows, f.quarantined, rank)

    def _explain(self, p: Any, f: Finding) -> None:
        """Whether the outlier rows explain an ordinary skip: re-run without them (nothing
        applied; the same re-run step, as a drop's) and ask the gate. Rows that do not explain
        it are not quarantined (``f.quarantined`` emptied; the reasons name them). Without a
        rerun that takes keep= (or an updater) they are taken to explain it, as before."""
        if self.updater is None or not _takes_keep(p.rerun):
            return
        keep, weight = self._kept(p, f)
        result = self.updater.apply_without(p, keep, weight, apply=False)
        kept, total = len(f.rows) - len(f.quarantined), len(f.rows)
        if result.passes:
            f.reasons.append(f"the {kept}/{total} other rows pass the gate (grad norm "
                             f"{result.grad_norm:.4g}): the quarantined explain it")
            return
        f.reasons.append(f"not quarantined: {len(f.quarantined)} sequence(s) past the z bar ("
                         f"{_named(f.quarantined)}), but the {kept}/{total} other rows still "
                         f"fail the gate (grad norm {result.grad_norm:.4g}): they do not "
                         "explain it")
        f.quarantined = []

    def dropped(self, f: Finding, result: Any) -> None:
        """Note what the re-run without the quarantined rows did (``result``: the step part's
        RerunUpdate) in the finding."""
        if not result.weighed and f.weight != 1.0 and not self._warned_weight:
            self._warned_weight = True
            log.warning("spikeguard: rerun did not call guard.backward: the update without "
                        "the quarantined rows is each rank's own mean, not the global one")
        f.drop = result
        kept, total = len(f.rows) - len(f.quarantined), len(f.rows)
        if not result.applied:
            f.reasons.append(f"drop: the {kept}/{total} kept rows still fail the gate (loss "
                             f"{result.loss:.4g}, grad norm {result.grad_norm:.4g}); skipped the "
                             "batch")
        else:
            f.reasons.append(f"drop: applied the update of {kept}/{total} rows (grad norm "
                             f"{result.grad_norm:.4g})")

    def _rows(self, p: Any) -> list[dict[str, Any]]:
        """Every rank's rows of the step (stream index, rank, row, loss, log Z), gathered."""
        seqs = [s for s in (p.rows or ()) if s is not None]
        local: list[dict[str, Any]] = []
        if seqs:
            values = torch.stack([torch.cat([getattr(s, k) for s in seqs]).double()
                                  for k in ("ce", "log_z", "tokens")]).tolist()
            span = p.batches
            one_each = span is not None and span[1] - span[0] + 1 == len(seqs)
            # one batch of the stream split into micro-batches: rows count through the batch
            split = span is not None and span[0] == span[1] and len(seqs) > 1
            full = (self.ledger.rows_of(span[0], sum(len(s.ce) for s in seqs))
                    if split and self.ledger is not None else None)
            rank, pos = _dist.rank(), 0
            for i, s in enumerate(seqs):
                index = span[0] + i if one_each else span[0] if split else None
                ids = (self.ledger.rows_of(index, len(s.ce))
                       if self.ledger is not None and not split else list(range(len(s.ce))))
                for j, row in enumerate(ids):
                    local.append({"stream_index": index, "micro_batch": i, "micro_row": j,
                                  "rank": rank, "row": int(full[pos] if full else row),
                                  "loss": values[0][pos], "log_z": values[1][pos],
                                  "tokens": values[2][pos], "pos": pos})
                    pos += 1
        if _dist.world_size() == 1:
            return local
        gathered: list[Any] = [None] * _dist.world_size()
        torch.distributed.all_gather_object(gathered, local)
        return [r for part in gathered for r in part]

    def _write(self, step: int, quarantined: list[dict[str, Any]]) -> None:
        path = self.path if self.path is not None else self._beside_sink()
        if path is None or (self.path is not None and _dist.rank() != 0):
            return
        keys = ("stream_index", "micro_batch", "micro_row", "rank", "row", "loss", "log_z", "z")
        lines = [encode_record({"step": step, **{k: q[k] for k in keys}}) for q in quarantined]
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write("".join(line + "\n" for line in lines))

    def _beside_sink(self) -> Path | None:
        """``quarantine.jsonl`` beside the file of the first JSONL sink that writes on this rank
        (with one file per rank, rank 0's); None without one."""
        for s in getattr(self.sinks, "sinks", None) or ():
            path = getattr(s, "path", None)
            if (path is not None and str(path).endswith(".jsonl") and getattr(s, "active", True)
                    and (getattr(s, "rank", 0) is not None or _dist.rank() == 0)):
                return Path(path).parent / "quarantine.jsonl"
        return None

    # -- Tier 2 -------------------------------------------------------------------------------
    def summary(self, onset: int, step: int) -> dict[str, Any]:
        """The skips in [onset, step] by cause, and their quarantined sequences."""
        skips = [s for s in self.skips if onset <= s[0] <= step]
        return {cause: [s for s, c, _ in skips if c == cause]
                for cause in ("data", "transient", "unknown")} | {
            "quarantined": [[s, *q] for s, _, qs in skips for q in qs]}

    def range_drops(self, onset: int, step: int) -> dict[int, list[int]] | None:
        """This rank's rows to drop instead of skipping the batches of steps [onset, step]:
        only with ``drop_sequences`` and when every skip there was data-caused and quarantined
        sequences of known stream index; else None (skip the range). Same answer on every
        rank (the history is gathered)."""
        skips = [s for s in self.skips if onset <= s[0] <= step]
        if (not self.config.drop_sequences or not skips
                or any(c != "data" or not qs or any(q[0] is None for q in qs)
                       for _, c, qs in skips)):
            return None
        rank, drops = _dist.rank(), {}
        for _, _, qs in skips:
            for index, r, row in qs:
                if r == rank:
                    drops.setdefault(int(index), []).append(int(row))
        return drops

    # -- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"reruns": self.reruns,
                "skips": [[s, c, [list(q) for q in qs]] for s, c, qs in self.skips]}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if not state:
            return
        # a rollback restores an older state: re-runs already spent stay spent
        self.reruns = max(self.reruns, int(state["reruns"]))
        self.skips = deque(((int(s), str(c), [tuple(q) for q in qs])
                            for s, c, qs in state["skips"]), maxlen=_KEEP)


def kept_weight(rows: list[dict[str, Any]], quarantined: list[dict[str, Any]], rank: int) -> float:
    """This rank's loss weight without the quarantined rows: R n_r / N (kept tokens n_r here, N on
    all R ranks with rows): the averaged gradients are those of the global token mean."""
    out = {(q["rank"], q["pos"]) for q in quarantined}
    kept = [r for r in rows if (r["rank"], r["pos"]) not in out]
    mine = sum(r["tokens"] for r in kept if r["rank"] == rank)
    total = sum(r["tokens"] for r in kept)
    return len({r["rank"] for r in rows}) * mine / total if mine > 0 and total > 0 else 1.0

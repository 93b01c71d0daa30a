"""What a Tier 2 page suggests doing about the trouble, read from the rules that fired and the
run's own history: a list of sentences, each naming the signal, what it did, and the defense
that targets it. A rollback returns to weights from before the onset; when the trouble is a
missing defense (output logits without a z-loss, attention logits without QK-norm), the replay
meets it again, and the remedy is the defense, not the rollback.

- **Attention logits.** The guard's signals read an upper bound on every attention logit every
  tenth step (``measure/logit_bound.py``). When the bound at the page is above
  ``DetectorConfig.qk_advice_bound`` (100: Kimi K2's QK-Clip threshold) and
  ``qk_advice_growth`` times the run's first reading, the page suggests QK-norm (OLMo 2) or
  QK-Clip (``--set qk_clip=100``). The bound is loose without QK-norm, so both
  conditions are needed: on the tiny GPT at LR 1.0 without QK-norm (the attention-logit
  instability of Wortsman et al. 2023) it reads 1,000-1,600,000 from the first few dozen steps,
  while a healthy Llama of the same size under AdamW reaches 88-91 in 300 steps (7-7.4x its start)
  and the tiny GPT with QK-norm stays at 7-11.
- **Output logits.** A log Z rule among the reasons: a z-loss (PaLM's 1e-4 x log Z squared)
  pulls log Z back toward 0.
- **The update's own size.** The LR-jump check or the update-ratio rule among the reasons: the
  LR or the optimizer's state jumped, which a smaller gradient cannot repair; look at what sets
  the LR, and replay at a lower LR.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["ATTENTION", "remedies", "remedy_settings"]

ATTENTION = "attention logits"
"""The first words of the attention remedy (GuardConfig.rollback_qk_clip's rollback reads it)."""


def _attention(bounds: list[tuple[int, float]], first: tuple[int, float] | None,
               config: Any) -> str | None:
    if not bounds or first is None:
        return None
    step, last = bounds[-1]
    at, start = first
    if not (math.isfinite(last) and last > config.qk_advice_bound
            and last > config.qk_advice_growth * start):
        return None
    return (f"{ATTENTION}: their upper bound is {last:,.0f} at step {step} (it was "
            f"{start:,.0f} at step {at}); add QK-norm to the attention (as OLMo 2 does) or "
            f"QK-Clip (answer with --set qk_clip={config.qk_advice_bound:g}, Kimi K2's "
            "threshold); a rollback alone goes back to weights that grow them again")


def remedies(reasons: list[str] | tuple[str, ...], bounds: list[tuple[int, float]],
             first_bound: tuple[int, float] | None, config: Any) -> list[str]:
    """The remedies of a Tier 2 page (module docstring): ``reasons`` the verdict's, ``bounds``
    the (step, attention-logit bound) readings up to the page, ``first_bound`` the run's first,
    ``config`` the DetectorConfig (its ``qk_advice_*`` fields)."""
    out = []
    attention = _attention(bounds, first_bound, config)
    if attention is not None:
        out.append(attention)
    if any(r.startswith("log_z") for r in reasons):
        out.append("output logits: log Z rose; add or raise a z-loss (PaLM uses 1e-4): answer "
                   "with --set z_loss=1e-4 on the reference GPT, or pass z_loss to "
                   "sg.cross_entropy in your own loop")
    if any(r.startswith("lr jump") for r in reasons):
        out.append("the LR itself jumped: check what sets it (the scheduler, a resume that "
                   "rebuilt it, a manual change of the optimizer's param_groups)")
    elif any(r.startswith("update_ratio") for r in reasons):
        out.append("the update's own size jumped (the update ratio), which clipping the "
                   "gradient cannot bound: check the LR schedule and the optimizer's state; a "
                   "replay at a lower LR (--set lr_scale=0.5) does not retrace it")
    return out


def remedy_settings(lines: list[str], config: Any) -> list[str]:
    """The ``--set`` values an answer can carry for the remedies ``lines`` (the on-call page's
    ``rollback_with_remedy`` answer): QK-Clip at ``qk_advice_bound`` for the attention logits,
    which the guard applies to any model whose attention its signals find. (A z-loss needs the
    reference GPT's config and the LR a person's judgement: the lines say those.)"""
    return ([f"qk_clip={config.qk_advice_bound:g}"]
            if any(r.startswith(ATTENTION) for r in lines) else [])

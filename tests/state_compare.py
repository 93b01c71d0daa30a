"""Snapshots of a model's parameters and an optimizer's moments, compared exactly (the framework
integration tests: a skipped step must leave both bit-identical)."""

from __future__ import annotations

import torch

__all__ = ["same", "same_moments"]


def same(a: dict, b: dict) -> bool:
    """Every tensor of snapshot ``a`` equals the one under its name in ``b``."""
    return all(torch.equal(a[k], b[k]) for k in a)


def same_moments(a: dict, b: dict) -> bool:
    """Two optimizer-state snapshots (parameter -> {name: tensor or number}) hold equal values."""
    return a.keys() == b.keys() and all(
        all(torch.equal(x[k], y[k]) if torch.is_tensor(x[k]) else x[k] == y[k] for k in x)
        for x, y in zip(a.values(), b.values()))


def same_record(a: dict, b: dict) -> bool:
    """Records equal but for which reference batch the weights check re-ran: its closures are
    not in a checkpoint, so a resumed run's is younger (guard/weights.py); the decision, the
    numbers and everything else must be the same."""
    def strip(r):
        return {**{k: v for k, v in r.items() if k != "weights_check"},
                "reasons": [x for x in r.get("reasons", []) if not x.startswith("weights check")]}

    return strip(a) == strip(b) and ("weights_check" in a) == ("weights_check" in b) and (
        a.get("weights_check") or {}).get("weights") == (b.get("weights_check") or {}).get("weights")

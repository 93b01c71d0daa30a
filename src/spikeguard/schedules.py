"""Learning-rate schedules, importable as ``spikeguard.schedules``; defined in
``spikeguard.prevent.schedules`` (picklable ``step -> multiplier`` callables for LambdaLR)."""

from .prevent.schedules import constant_with_warmup, extend, warmup_cosine, wsd

__all__ = ["constant_with_warmup", "extend", "warmup_cosine", "wsd"]

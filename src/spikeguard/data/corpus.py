"""The default corpus: real English and code text that ships with Python itself.

Nothing is downloaded. ``pydoc`` is the language reference's topic pages that ``help()`` shows
(``pydoc_data.topics``, about 0.5 MB); ``stdlib`` is the standard library's own ``.py`` sources.
Tokens are bytes (vocabulary 256). The split is contiguous: the first ``1 - val_fraction`` of
the bytes train, the rest is held out. The sha256 of the bytes is recorded, since the text
differs between Python versions.
"""

from __future__ import annotations

import hashlib
import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

__all__ = ["CORPORA", "Corpus", "load_corpus"]

CORPORA = ("pydoc", "stdlib")
VOCAB_SIZE = 256


@dataclass(frozen=True, eq=False)
class Corpus:
    """Byte tokens of one corpus, split into train and held-out parts (uint8 arrays).

    Two corpora are equal when they hold the same bytes split the same way (name, sha256 of the
    bytes, split sizes, vocabulary); the arrays themselves are never compared element-wise."""

    name: str
    train: np.ndarray
    val: np.ndarray
    sha256: str
    vocab_size: int = VOCAB_SIZE

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Corpus):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def _key(self) -> tuple:
        return (self.name, self.sha256, len(self.train), len(self.val), self.vocab_size)

    def unigram_entropy(self) -> float:
        """Entropy in nats of the train split's byte distribution: the loss of the best model
        that ignores context, so a model that learned anything beats it."""
        counts = np.bincount(self.train, minlength=self.vocab_size).astype(np.float64)
        p = counts[counts > 0] / counts.sum()
        return float(-(p * np.log(p)).sum())

    def describe(self) -> str:
        return (f"corpus {self.name}: {len(self.train):,} train + {len(self.val):,} held-out bytes, "
                f"sha256 {self.sha256[:16]}")


def _pydoc_bytes() -> bytes:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics)).encode("utf-8")


def _stdlib_bytes(max_bytes: int = 8_000_000) -> bytes:
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"\n".join(chunks)[:max_bytes]


def load_corpus(name: Literal["pydoc", "stdlib"] = "pydoc", *, val_fraction: float = 0.1) -> Corpus:
    """Load a corpus that ships with the running Python as byte tokens."""
    if name not in CORPORA:
        raise ValueError(f"corpus {name!r} is unknown; choose one of {CORPORA}")
    if not 0.0 < val_fraction < 0.5:
        raise ValueError(f"val_fraction={val_fraction} must be in (0, 0.5)")
    raw = _pydoc_bytes() if name == "pydoc" else _stdlib_bytes()
    tokens = np.frombuffer(raw, dtype=np.uint8)
    cut = len(tokens) - max(1, math.floor(len(tokens) * val_fraction))
    return Corpus(name=name, train=tokens[:cut].copy(), val=tokens[cut:].copy(),
                  sha256=hashlib.sha256(raw).hexdigest())

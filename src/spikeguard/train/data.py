"""The training data of ``spikeguard train``: a corpus that ships with Python, or ``--data``.

``--data PATH`` takes a text file, a folder of text files (every ``*.txt``, ``*.md``, ``*.rst``
and ``*.py`` below it, in sorted order) or a pre-tokenized ``.bin`` of little-endian uint16 token
ids (memory-mapped). Text becomes byte tokens (vocabulary 256) or, with ``--tokenizer bpe``, the
ids of a byte-level BPE trained on the training split with the ``tokenizers`` library. The last
10% is held out. The sha256 of the bytes identifies the data in the run's config.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..data import load_corpus

__all__ = ["TrainData", "load_train_data"]

_TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py")
_VAL_FRACTION = 0.1


@dataclass(frozen=True)
class TrainData:
    """Token ids split into train and held-out parts, with what identifies them."""

    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    sha256: str
    describe: str


def _split(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    cut = len(tokens) - max(1, math.floor(len(tokens) * _VAL_FRACTION))
    return tokens[:cut], tokens[cut:]


def _text_bytes(path: Path) -> bytes:
    if path.is_file():
        return path.read_bytes()
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in _TEXT_SUFFIXES)
    if not files:
        raise ValueError(f"--data {path}: the folder holds no text files "
                         f"({', '.join(_TEXT_SUFFIXES)})")
    return b"\n".join(p.read_bytes() for p in files)


def _bpe(raw: bytes, vocab_size: int) -> np.ndarray:
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise ValueError("--tokenizer bpe needs the tokenizers library "
                         "(pip install tokenizers; the hf extra brings it)") from None
    text = raw.decode("utf-8", errors="replace")
    train_text = text[: int(len(text) * (1 - _VAL_FRACTION))]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([train_text[i:i + 4096] for i in range(0, len(train_text), 4096)],
                            trainer=trainer)
    ids = tok.encode(text).ids
    return np.asarray(ids, dtype=np.int64)


def load_train_data(*, corpus: str, data: str | None, tokenizer: str,
                    vocab_size: int | None) -> TrainData:
    """Load ``--data`` (or the named corpus) as token ids; ValueError says what is wrong."""
    if data is None:
        c = load_corpus(corpus)
        raw = np.concatenate([c.train, c.val]).tobytes()
        if tokenizer == "bytes":
            return TrainData(c.train, c.val, 256, c.sha256, c.describe())
        source = f"corpus {corpus}"
    else:
        path = Path(data)
        if not path.exists():
            raise ValueError(f"--data {data}: no such file or folder")
        if path.suffix == ".bin":
            if path.stat().st_size < 4 or path.stat().st_size % 2:
                raise ValueError(f"--data {data}: a .bin must hold little-endian uint16 token "
                                 f"ids (an even number of bytes, at least two tokens)")
            tokens = np.memmap(path, dtype="<u2", mode="r")
            top = int(tokens.max()) + 1
            if vocab_size is not None and top > vocab_size:
                raise ValueError(f"--data {data} holds token {top - 1}, not below "
                                 f"--vocab-size {vocab_size}")
            sha = hashlib.sha256(path.read_bytes()).hexdigest()
            train, val = _split(tokens)
            return TrainData(train, val, vocab_size or top, sha,
                             f"{path.name}: {len(train):,} + {len(val):,} tokens (vocab "
                             f"{vocab_size or top}), sha256 {sha[:16]}")
        raw = _text_bytes(path)
        if not raw:
            raise ValueError(f"--data {data} is empty")
        source = path.name
    sha = hashlib.sha256(raw).hexdigest()
    if tokenizer == "bpe":
        size = vocab_size or 4096
        tokens = _bpe(raw, size)
        sha = hashlib.sha256(raw + f"|bpe{size}".encode()).hexdigest()
    else:
        size, tokens = 256, np.frombuffer(raw, dtype=np.uint8)
    train, val = _split(tokens)
    return TrainData(train, val, size, sha, f"{source}: {len(train):,} + {len(val):,} "
                     f"{tokenizer} tokens (vocab {size}), sha256 {sha[:16]}")

"""The digests a checkpoint manifest may name, behind hashlib's interface."""

from __future__ import annotations

import hashlib
import zlib
from typing import Any, Literal

__all__ = ["DEFAULT_DIGEST", "DIGESTS", "Digest"]

Digest = Literal["xxh3", "crc32", "sha256"]


class _Crc32:
    """zlib's CRC-32 behind hashlib's interface (zlib releases the GIL on large buffers)."""

    def __init__(self) -> None:
        self._value = 0

    def update(self, data: Any) -> None:
        self._value = zlib.crc32(data, self._value)

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


class _Xxh3:
    """xxHash's XXH3-128 (python-xxhash, imported on first use): about 4x zlib's CRC-32 here,
    and it lets other threads run while it hashes a large buffer."""

    def __init__(self) -> None:
        import xxhash

        self._h = xxhash.xxh3_128()

    def update(self, data: Any) -> None:
        self._h.update(data)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


DIGESTS = {"xxh3": _Xxh3, "crc32": _Crc32, "sha256": hashlib.sha256}
"""Digests a manifest may name; each recorded digest reads ``"<name>:<hex>"``."""
DEFAULT_DIGEST = "xxh3"
"""What CheckpointManager writes unless told otherwise (it reads every one of DIGESTS)."""

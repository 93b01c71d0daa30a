"""The torchtitan CPU helper the tests use: spikeguard.integrations.torchtitan_cpu (import it
before anything imports torchtitan)."""

from spikeguard.integrations.torchtitan_cpu import (  # noqa: F401
    PATCHES,
    ByteTokenizer,
    CorpusLoader,
    debug_config,
    laptop,
)

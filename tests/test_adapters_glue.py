"""The lines of glue per stack in docs/adapters.md are the lines marked ``# sg`` in each stack's
example (counted from the comment tokens, so a marker inside a string does not count), and the
nanoGPT shape stays within 8."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

from tests.conftest import ROOT

_ROW = re.compile(r"^\| ([^|]+?) \| `(examples/[\w.]+\.py)` \| (\d+) \|", re.M)


def marked_lines(path: Path) -> set[int]:
    """Line numbers holding a comment that starts with ``# sg``."""
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return {t.start[0] for t in tokens
            if t.type == tokenize.COMMENT and re.match(r"#\s*sg\b", t.string)}


def test_the_glue_table_matches_the_marked_lines_of_every_example():
    rows = _ROW.findall((ROOT / "docs" / "adapters.md").read_text())
    stacks = {stack for stack, _, _ in rows}
    assert {"plain loop", "nanoGPT", "HF Trainer", "accelerate", "Lightning",
            "OLMo-core"} <= stacks, stacks
    for stack, file, lines in rows:
        assert len(marked_lines(ROOT / file)) == int(lines), f"{stack}: {file}"


def test_the_nanogpt_shape_takes_at_most_8_lines():
    assert 0 < len(marked_lines(ROOT / "examples" / "nanogpt.py")) <= 8


def test_a_marker_in_a_string_is_not_counted(tmp_path):
    f = tmp_path / "x.py"
    f.write_text('s = "# sg not code"\nx = 1  # sg: glue\n# sgx is not a marker\n')
    assert marked_lines(f) == {2}

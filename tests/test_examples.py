import pytest
from examples.train_loop import main

import spikeguard as sg
from spikeguard.sinks import read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")  # the tiny model: threads only contend


def test_train_loop_example_skips_the_injected_outlier_and_nothing_else(tmp_path):
    verdicts = main(steps=130, out=str(tmp_path), inject_at=120)
    flagged = {i: v for i, v in enumerate(verdicts) if v.action is not sg.Action.CONTINUE}
    assert list(flagged) == [120]
    assert flagged[120].action is sg.Action.SKIP and flagged[120].tier == 1
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(130))
    assert records[120]["action"] == "skip" and records[119]["action"] == "continue"
    assert records[-1]["loss"] < records[0]["loss"] - 1.0  # it learned
    assert (tmp_path / "checkpoints" / "step_00000100").is_dir()


def test_readme_shows_the_example_loop_verbatim():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    section = readme[readme.index("## Use in your loop"):]
    block = section[section.index("```python\n") + 10:section.index("```\n", 10)]
    assert block.startswith("def main(") and "guard.resume()" in block
    assert block in (root / "examples" / "train_loop.py").read_text()


def test_readme_loop_run_twice_keeps_one_record_per_step(tmp_path):
    first = main(steps=53, out=str(tmp_path), inject_at=None)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert len(first) == 53 and [r["step"] for r in records] == list(range(53))
    again = main(steps=53, out=str(tmp_path), inject_at=None)  # resumes from the checkpoint at 50
    assert [v.step for v in again] == [51, 52]
    rerun = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rerun] == list(range(53))  # not 55 records: 51 and 52 once
    assert rerun == records  # and the steps run again computed the same numbers


def test_exit_status_table_in_readme_is_the_commands():
    import re
    from pathlib import Path

    from spikeguard.cli import EXIT_STATUS

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = readme[readme.index("| exit status | meaning |"):]
    rows = re.findall(r"^\| (\d+) \|", table.split("\n\n")[0], re.M)
    assert [int(r) for r in rows] == sorted(EXIT_STATUS)


def test_a_halt_leaves_the_example_script_with_exit_status_3_and_the_report(tmp_path):
    """The documented exit pattern: a TrainingHalted in the user's script becomes report.txt and
    exit status 3 (as ``spikeguard train``), not a traceback and status 1. LR 1e4 makes the
    weights non-finite after the first update: Tier 3 at step 1."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(root / "examples" / "train_loop.py"), "--steps",
                           "30", "--lr", "1e4", "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 3, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith("HALT at step 1")
    assert f"report: {tmp_path / 'report.txt'}" in done.stderr
    assert (tmp_path / "report.txt").read_text().startswith("HALT at step 1")
    assert read_metrics(tmp_path / "metrics.jsonl")[-1]["action"] == "halt"


def test_every_field_of_the_configs_a_loop_builds_has_a_docstring():
    """The configs README's loop and the integrations build: each field documents itself (the
    CLI's --help reads the same docstrings)."""
    import dataclasses

    from spikeguard._config_cli import field_docs
    from spikeguard.guard.attribution import AttributionConfig
    from spikeguard.measure.precision import PrecisionPolicy
    from spikeguard.measure.probes import ProbeConfig
    from spikeguard.prevent.clipping import ClipConfig

    for cls in (sg.GuardConfig, AttributionConfig, ClipConfig, sg.DetectorConfig, ProbeConfig,
                PrecisionPolicy):
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name, "").strip()]
        assert not missing, f"{cls.__name__}: {missing}"

from examples.train_loop import main

import spikeguard as sg
from spikeguard.sinks import read_metrics


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

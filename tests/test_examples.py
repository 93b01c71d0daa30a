from examples.train_loop import main

import spikeguard as sg


def test_train_loop_example_skips_the_injected_outlier_and_nothing_else(tmp_path):
    verdicts = main(steps=130, out=str(tmp_path), inject_at=120)
    flagged = {i: v for i, v in enumerate(verdicts) if v.action is not sg.Action.CONTINUE}
    assert list(flagged) == [120]
    assert flagged[120].action is sg.Action.SKIP and flagged[120].tier == 1
    records = sg.read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(130))
    assert records[120]["action"] == "skip" and records[119]["action"] == "continue"
    assert records[-1]["loss"] < records[0]["loss"] - 1.0  # it learned
    assert (tmp_path / "checkpoints" / "step_00000100").is_dir()

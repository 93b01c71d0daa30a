"""``spikeguard train --tier2 ask`` on 2 gloo ranks under torchrun: one answer, read by rank 0 and
broadcast, is applied alike on both ranks at the same step boundary."""

import json
import subprocess
import sys

import pytest

from spikeguard import cli
from spikeguard.sinks import read_metrics
from tests._oncall_hook import hook
from tests.conftest import ROOT
from tests.test_oncall import DRIFT, TINY


@pytest.mark.dist
@pytest.mark.slow
def test_two_ranks_apply_one_answer_alike(tmp_path, sub_env, capsys):
    out = tmp_path / "run"
    env = {**sub_env, "OMP_NUM_THREADS": "1"}
    with hook() as h:
        proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
             "2", "-m", "spikeguard", "train", *TINY, "--steps", "160", *DRIFT, "--parallel",
             "ddp", "--tier2", "ask", "--answer-within-s", "600", "--page-to", h.url, "--no-plot",
             "--out", str(out)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
        try:
            (post,) = h.wait(1)  # one page for the job (rank 0 pages)
            page = post["body"]
            to = page["summary"]["rollback_checkpoint"]
            assert cli.main(["respond", str(out), "rollback", "--incident", page["incident"],
                             "--to", str(to), "--set", "z_loss=1e-4"]) == 0
            stdout, stderr = proc.communicate(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, stdout + stderr
    # one page for the job, and its resolve once the run recovered: rank 0 alone pages
    assert [p["body"]["event"] for p in h.posts] == ["trigger", "resolve"]
    ranks = [json.loads((out / "ranks" / f"rank{i}.json").read_text()) for i in (0, 1)]
    assert ranks[0]["rollbacks"] == ranks[1]["rollbacks"] == 1  # only an answer rolls back here
    for key in ("steps", "applied", "skipped", "made_up"):
        assert ranks[0][key] == ranks[1][key], key
    noted = [r for r in read_metrics(out / "metrics.jsonl") if "oncall" in r]
    assert [r["oncall"]["rollback_to"] for r in noted] == [to]
    assert json.loads((out / "config.json").read_text())["config"]["gpt"]["z_loss"] == 1e-4

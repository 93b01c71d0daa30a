"""2 gloo ranks x 2 DataLoader workers over the token stream, killed and resumed under torchrun:
distinct batches per (rank, worker), the resume at the right batch on every rank, and one
metrics.jsonl with one line per step."""

import pytest

from tests._data_dist_job import check, kill_and_resume


@pytest.mark.dist
@pytest.mark.slow
def test_two_ranks_two_workers_kill_9_and_resume(tmp_path):
    summary = check(kill_and_resume(tmp_path, world=2, steps=8, every=3, hold_at=5))
    assert summary["resumed_at"] == 4 and summary["metrics_lines"] == 5 + 4

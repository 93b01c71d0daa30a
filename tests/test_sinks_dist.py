"""One logger per job: on 2 gloo ranks each sink writes on its one rank (rank 0 by default),
opens nothing on the others, and with rank=None writes per rank to paths with {rank}."""

import io
import os

import pytest

from spikeguard.record import StepMetrics, metrics_record
from spikeguard.sinks import ConsoleSink, JsonlSink, Sinks, TensorBoardSink, read_metrics
from tests.dist import run_distributed


def _log_everywhere(rank: int, world_size: int, out: str) -> dict:
    import sys

    os.environ.update(WANDB_MODE="offline", WANDB_DIR=out, WANDB_SILENT="true")
    from rich.console import Console

    from spikeguard.sinks import WandbSink

    buf, buf_all = io.StringIO(), io.StringIO()
    sinks = {
        "job": JsonlSink(f"{out}/metrics.jsonl"),
        "per_rank": JsonlSink(f"{out}/metrics-rank{{rank}}.jsonl", rank=None),
        "on_1": JsonlSink(f"{out}/from-rank-1.jsonl", rank=1),
        "tb": TensorBoardSink(f"{out}/tb"),
        "tb_per_rank": TensorBoardSink(f"{out}/tb-{{rank}}", rank=None),
        "console": ConsoleSink(console=Console(file=buf, width=200), every=1),
        "console_all": ConsoleSink(console=Console(file=buf_all, width=200), every=1, rank=None),
        "wandb": WandbSink(mode="offline", dir=out),
    }
    group = Sinks([sinks["job"], sinks["on_1"]])
    alone = Sinks([sinks["on_1"]])
    # rank 1 neither started a W&B run nor imported wandb
    wandb_opened = "wandb" in sys.modules and sys.modules["wandb"].run is not None
    imported = {"wandb": "wandb" in sys.modules}
    for step in range(4):
        record = metrics_record(StepMetrics(step=step, loss=10.0 * rank + step, grad_norm=1.0))
        for sink in sinks.values():
            sink.log(record, step)
    for sink in sinks.values():
        sink.close()
    return {"active": {k: s.active for k, s in sinks.items()}, "wandb_opened": wandb_opened,
            "imported": imported,
            "group": group.active, "alone": alone.active,
            "console": buf.getvalue(), "console_all": buf_all.getvalue()}


@pytest.mark.dist
def test_each_sink_writes_on_one_rank_or_per_rank_on_two_gloo_ranks(tmp_path):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    r0, r1 = run_distributed(_log_everywhere, 2, str(tmp_path), timeout=180)
    # one metrics.jsonl for the job, one line per step, written by rank 0 alone
    assert [(x["step"], x["loss"]) for x in read_metrics(tmp_path / "metrics.jsonl")] == \
        [(s, float(s)) for s in range(4)]
    assert [x["loss"] for x in read_metrics(tmp_path / "from-rank-1.jsonl")] == [10, 11, 12, 13]
    for r in range(2):
        assert [x["loss"] for x in read_metrics(tmp_path / f"metrics-rank{r}.jsonl")] == \
            [10.0 * r + s for s in range(4)]
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".jsonl") == \
        ["from-rank-1.jsonl", "metrics-rank0.jsonl", "metrics-rank1.jsonl", "metrics.jsonl"]
    # TensorBoard: one writer for the job (rank 1 opened none), one per rank with {rank}
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 1
    assert all(len(list((tmp_path / f"tb-{r}").glob("events.*"))) == 1 for r in range(2))
    # W&B: one run for the job
    assert r0["wandb_opened"] and not r1["wandb_opened"]
    assert r0["imported"]["wandb"] and not r1["imported"]["wandb"]
    assert len(list((tmp_path / "wandb").glob("offline-run-*"))) == 1
    # console: rank 0 prints; rank=None prints everywhere, each line headed by its rank
    assert "step       3" in r0["console"] and r1["console"] == ""
    assert "[rank 1] step       3 | loss 13.0000" in r1["console_all"]
    assert r0["active"] == {**dict.fromkeys(r0["active"], True), "on_1": False}
    assert r1["active"] == {k: k in ("per_rank", "on_1", "tb_per_rank", "console_all")
                            for k in r1["active"]}
    assert r0["group"] and r1["group"] and r0["alone"] is False and r1["alone"]


def test_rank_is_validated_and_none_needs_a_placeholder(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"JsonlSink\(rank=None\) writes on every rank, so "
                                         r"path='.*m\.jsonl' must hold a \{rank\} placeholder"):
        JsonlSink(tmp_path / "m.jsonl", rank=None)
    pytest.importorskip("tensorboard")
    with pytest.raises(ValueError, match=r"log_dir='.*tb' must hold a \{rank\}"):
        TensorBoardSink(tmp_path / "tb", rank=None)
    assert not (tmp_path / "tb").exists()
    with pytest.raises(ValueError, match=r"rank=1, but the job has 1 rank\(s\)"):
        JsonlSink(tmp_path / "m.jsonl", rank=1)
    with pytest.raises(ValueError, match="rank=True must be an integer >= 0"):
        ConsoleSink(rank=True)
    sink = JsonlSink(tmp_path / "m-{rank}.jsonl", rank=None)
    assert sink.path.name == "m-0.jsonl" and sink.active
    monkeypatch.setenv("WORLD_SIZE", "2")  # launched by torchrun, no process group yet
    with pytest.raises(ValueError, match="WORLD_SIZE=2 ranks but torch.distributed is not"):
        JsonlSink(tmp_path / "m.jsonl")


def test_wandb_per_rank_runs_need_rank_in_the_name(tmp_path):
    pytest.importorskip("wandb")
    from spikeguard.sinks import WandbSink

    with pytest.raises(ValueError, match=r"WandbSink\(rank=None\).*name='' must hold a \{rank\}"):
        WandbSink(mode="offline", dir=str(tmp_path), rank=None)
    assert not list(tmp_path.iterdir())

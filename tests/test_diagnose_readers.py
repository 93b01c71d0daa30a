"""diagnose's readers: every format into one columnar log, checked against independent readers
(spikeguard's own read_metrics, the values written) and the writers of the real tools."""

import json
import math

import numpy as np
import pytest

import spikeguard as sg
from spikeguard.detector.detector import DetectorConfig
from spikeguard.diagnose import read_log, read_quarantine, replay_config
from spikeguard.diagnose._columns import canonical, parse_map
from spikeguard.record import metrics_record
from spikeguard.sinks import TensorBoardSink, read_metrics


def records(n=120, start=0, every=1, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        m = sg.StepMetrics(step=start + k * every, loss=2.5 + 0.01 * rng.standard_normal(),
                           grad_norm=float(np.exp(0.1 * rng.standard_normal())),
                           log_z=7.0 + 0.05 * rng.standard_normal(), lr=1e-3)
        out.append(m)
    return out


def write_jsonl(path, metrics, **record_kw):
    sink = sg.JsonlSink(path, mode="w", defer=False)
    for m in metrics:
        sink.log(metrics_record(m, **record_kw), m.step)
    sink.close()
    return path


def as_floats(records_, key):
    return np.array([math.nan if r[key] is None else r[key] for r in records_], dtype=float)


# ---- spikeguard JSONL ------------------------------------------------------------------------

@pytest.mark.parametrize("parser", ["orjson", "json"])
def test_jsonl_columns_equal_read_metrics(tmp_path, parser):
    ms = records(3000)
    ms[100].loss, ms[200].grad_norm, ms[300].log_z = math.nan, math.inf, -math.inf
    ms[400].nan_frac = 1e-3
    for m in ms[500:600]:
        m.log_z = None  # a log without log Z for a while: written as null
    path = write_jsonl(tmp_path / "metrics.jsonl", ms)
    loads = json.loads if parser == "json" else None
    log = read_log(path, json_loads=loads)
    ref = read_metrics(path)
    assert log.format == "jsonl" and len(log) == len(ref) == 3000 and log.stride == 1
    assert log.steps.tolist() == [r["step"] for r in ref]
    for key in ("loss", "grad_norm", "log_z", "nan_frac", "lr"):
        assert np.array_equal(log.columns[key], as_floats(ref, key), equal_nan=True), key
    assert log.recorded["tier"].tolist() == [0] * 3000
    assert any("NaN or inf at 1 step(s) (first: step 100)" in w for w in log.warnings)


def test_jsonl_cut_last_line_and_bad_line_give_partial_results(tmp_path):
    path = write_jsonl(tmp_path / "metrics.jsonl", records(50))
    lines = path.read_bytes().split(b"\n")
    lines[10] = b'{"step": 10, "loss": 2.'  # damaged mid-file
    path.write_bytes(b"\n".join(lines[:-1]) + b"\n" + b'{"schema": 1, "step": 50, "lo')
    log = read_log(path)
    assert log.steps.tolist() == [s for s in range(50) if s != 10]
    text = " ".join(log.warnings)
    assert "last line was cut off" in text and "1 line(s) are not JSON objects (first: line 11)" in text
    # spikeguard's own reader drops the cut line too, but refuses the damaged one
    with pytest.raises(ValueError, match=":11:"):
        read_metrics(path)


def test_empty_and_unreadable_files_say_so(tmp_path):
    empty = tmp_path / "metrics.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty"):
        read_log(empty)
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n")
    with pytest.raises(ValueError, match="no JSON records"):
        read_log(blank)
    newer = write_jsonl(tmp_path / "new.jsonl", records(3))
    newer.write_text(newer.read_text().replace('"schema": 1', '"schema": 99'))
    with pytest.raises(ValueError, match="schema=99 is newer"):
        read_log(newer)
    with pytest.raises(ValueError, match="no such file"):
        read_log(tmp_path / "nope.jsonl")


def test_resumed_run_keeps_the_last_record_of_each_step(tmp_path):
    first = records(100, seed=1)
    again = records(100, start=50, seed=2)  # resumed from a checkpoint at 49
    path = write_jsonl(tmp_path / "metrics.jsonl", first + again)
    log = read_log(path)
    assert log.steps.tolist() == list(range(150))
    expect = [m.loss for m in first[:50]] + [m.loss for m in again]
    assert log.columns["loss"].tolist() == expect
    text = " ".join(log.warnings)
    assert "not in order" in text and "first: step 50 after 99" in text
    assert "50 step(s) have more than one loss" in text


def test_missing_loss_or_grad_columns(tmp_path):
    path = tmp_path / "g.csv"
    path.write_text("step,grad_norm\n" + "".join(f"{i},{1 + 0.01 * i}\n" for i in range(20)))
    log = read_log(path)
    assert "loss" not in log.columns and any("no loss column" in w for w in log.warnings)
    bad = tmp_path / "x.csv"
    bad.write_text("step,accuracy\n1,0.5\n")
    with pytest.raises(ValueError, match=r"no loss or grad norm column among \['step', "
                                         r"'accuracy'\]; name them with --map"):
        read_log(bad)


# ---- CSV, W&B, names -----------------------------------------------------------------------------

@pytest.mark.parametrize("name, metric", [
    ("loss", "loss"), ("train_loss", "loss"), ("train/loss", "loss"), ("train_loss_step", "loss"),
    ("Training Loss", "loss"), ("val_loss", None), ("eval_loss", None), ("train_loss_epoch", None),
    ("grad_norm", "grad_norm"), ("gradient_norm", "grad_norm"), ("grad-norm", "grad_norm"),
    ("train/grad_norm", "grad_norm"), ("log_z", "log_z"), ("logZ", "log_z"),
    ("step", "step"), ("global_step", "step"), ("train/global_step", "step"), ("_step", "step"),
    ("learning_rate", "lr"), ("lr-AdamW", "lr"), ("my-run - train/loss", "loss"),
    ("my-run - train/loss__MIN", None), ("epoch", None),
])
def test_common_column_names(name, metric):
    hit = canonical(name)
    assert (hit[0] if hit else None) == metric


def test_generic_csv_with_map_and_missing_cells(tmp_path):
    rows = ["it;my_loss;gn;lz"]
    for i in range(30):
        gn = "" if i == 7 else f"{1 + 0.1 * i:.2f}"
        rows.append(f"{i * 5};{2.0 - 0.01 * i:.3f};{gn};nan")
    path = tmp_path / "run.csv"
    path.write_text("\n".join(rows) + "\n")
    with pytest.raises(ValueError, match="no loss or grad norm column"):
        read_log(path)
    mapping = parse_map(["it=step,my_loss=loss", "gn=grad_norm"])
    log = read_log(path, mapping=mapping)
    assert log.steps.tolist() == list(range(0, 150, 5)) and log.stride == 5
    assert log.columns["loss"][3] == pytest.approx(1.97)
    # a blank cell is not filled in: NaN with its missing mask set, so it is never evidence
    assert math.isnan(log.columns["grad_norm"][7]) and log.missing["grad_norm"].tolist() == \
        [i == 7 for i in range(30)]
    assert log.columns["grad_norm"][6] == pytest.approx(1.6)
    assert not log.missing["loss"].any()
    assert any("grad_norm missing at 1 of 30 step(s) (first: 35)" in w for w in log.warnings)
    assert not any("NaN or inf" in w for w in log.warnings)
    with pytest.raises(ValueError, match="metric 'accuracy' is not one of"):
        parse_map(["gn=accuracy"])
    with pytest.raises(ValueError, match=r"column\(s\) \['nope'\]"):
        read_log(path, mapping={"nope": "loss"})


def test_csv_cut_last_row_and_unsorted_rows(tmp_path):
    path = tmp_path / "run.csv"
    body = [f"{s},{2 + s / 100},{1.0}" for s in (3, 1, 2, 0, 4)]
    path.write_text("step,loss,grad_norm\n" + "\n".join(body) + "\n5,2.0")
    log = read_log(path)
    assert log.steps.tolist() == [0, 1, 2, 3, 4]
    assert log.columns["loss"].tolist() == [2.0, 2.01, 2.02, 2.03, 2.04]
    text = " ".join(log.warnings)
    assert "last row was cut off" in text and "not in order" in text


def test_wandb_history_and_panel_exports(tmp_path):
    hist = tmp_path / "history.csv"
    hist.write_text("_step,_runtime,train/loss,train/grad_norm,train/global_step\n"
                    + "".join(f"{i},{i * 0.5},{2 + i / 100},{1.0},{i * 10}\n" for i in range(40)))
    log = read_log(hist)
    assert log.format == "wandb" and log.steps.tolist() == list(range(0, 400, 10))
    assert log.columns["loss"][5] == pytest.approx(2.05)
    panel = tmp_path / "panel.csv"
    panel.write_text('"Step","run-7 - train/loss","run-7 - train/loss__MIN","run-7 - train/loss__MAX"\n'
                     + "".join(f"{i},{2 + i / 100},{1},{3}\n" for i in range(40)))
    log = read_log(panel, fmt="wandb")
    assert log.columns["loss"].tolist() == pytest.approx([2 + i / 100 for i in range(40)])


# ---- the real tools' writers ---------------------------------------------------------------------

def test_tensorboard_logs_written_by_the_tensorboard_sink(tmp_path):
    pytest.importorskip("tensorboard")
    ms = records(60)
    ms[30].grad_norm = math.nan
    sink = TensorBoardSink(tmp_path / "tb", defer=False)
    for m in ms:
        sink.log(metrics_record(m), m.step)
    sink.close()
    log = read_log(tmp_path / "tb")
    assert log.format == "tensorboard" and log.steps.tolist() == list(range(60))
    for key in ("loss", "grad_norm", "log_z"):
        want = np.array([getattr(m, key) for m in ms], dtype=np.float32).astype(float)
        assert np.array_equal(log.columns[key], want, equal_nan=True), key


@pytest.mark.slow
def test_hf_trainer_state_sparse_log(tmp_path):
    from transformers.trainer_callback import TrainerState

    state = TrainerState(global_step=500, logging_steps=10)
    for s in range(10, 510, 10):
        state.log_history.append({"epoch": s / 500, "grad_norm": 1.0 + s / 1000,
                                  "learning_rate": 1e-4, "loss": 3.0 - s / 1000, "step": s})
        if s % 100 == 0:
            state.log_history.append({"epoch": s / 500, "eval_loss": 9.0, "step": s})
    state.log_history.append({"epoch": 1.0, "step": 500, "train_loss": 2.7, "train_runtime": 9.9})
    state.save_to_json(str(tmp_path / "trainer_state.json"))
    log = read_log(tmp_path)
    assert log.format == "hf" and log.stride == 10
    assert log.steps.tolist() == list(range(10, 510, 10))
    assert log.columns["loss"][-1] == pytest.approx(2.5)  # not the run's mean train_loss
    assert log.columns["lr"][0] == 1e-4
    assert any("sparse log" in w for w in log.warnings)
    cfg = replay_config(log)
    full = DetectorConfig()
    assert cfg.median_window == min(full.median_window // 10, len(log) // 4) == 12
    assert cfg.recovery_ema_steps == 5
    assert cfg.arm_after == DetectorConfig.for_run(len(log)).arm_after == 10


@pytest.mark.slow
def test_lightning_csv_logger_rows_split_by_hook(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    logger = CSVLogger(tmp_path, name="run")
    for s in range(25):
        logger.log_metrics({"train_loss_step": 2.0 + s / 100}, step=s)  # training_step
        logger.log_metrics({"grad_norm": 1.0 + s / 10}, step=s)         # on_before_optimizer_step
        if s % 10 == 0:
            logger.log_metrics({"val_loss": 5.0, "epoch": s // 10}, step=s)
    logger.save()
    log = read_log(tmp_path / "run" / "version_0" / "metrics.csv")
    assert log.format == "lightning" and log.steps.tolist() == list(range(25))
    assert log.columns["loss"].tolist() == pytest.approx([2.0 + s / 100 for s in range(25)])
    assert log.columns["grad_norm"].tolist() == pytest.approx([1.0 + s / 10 for s in range(25)])
    assert not any("more than one" in w for w in log.warnings)


# ---- quarantine ------------------------------------------------------------------------------------

def test_quarantine_file_reader(tmp_path):
    q = tmp_path / "quarantine.jsonl"
    q.write_text('{"step": 9, "stream_index": 41, "rank": 0, "row": 3, "loss": 9.1, "log_z": 8.0, '
                 '"z_score": 12.5}\n{"rank": 1}\n'
                 '{"step": 2, "stream_index": 7, "rank": 1, "row": 0, "loss": 7.0, "z": 6}\n')
    warnings = []
    got = read_quarantine(q, warnings)
    assert [r["step"] for r in got] == [2, 9]
    assert got[1] == {"step": 9, "stream_index": 41, "rank": 0, "row": 3, "loss": 9.1,
                      "log_z": 8.0, "z": 12.5}
    assert warnings == ["quarantine.jsonl: 1 line(s) without a readable step: skipped"]
    assert read_quarantine(tmp_path / "missing.jsonl") == []


def test_a_run_and_its_relaunches_are_one_history(tmp_path):
    first, again, third = records(160), records(129, start=101, seed=1), records(99, start=201,
                                                                                seed=2)
    write_jsonl(tmp_path / "metrics.jsonl", first)  # cancelled at 159 for a rollback
    write_jsonl(tmp_path / "relaunch1" / "metrics.jsonl", again)  # from the checkpoint at 100
    write_jsonl(tmp_path / "relaunch2" / "metrics.jsonl", third)  # from the checkpoint at 200
    for given in (tmp_path / "metrics.jsonl", tmp_path / "relaunch1" / "metrics.jsonl",
                  tmp_path / "relaunch2"):
        log = read_log(given)
        assert log.steps.tolist() == list(range(300)), given
        assert log.path == str(tmp_path / "metrics.jsonl")
        assert any("joined a run and its relaunches" in w for w in log.warnings)
        # the relaunch's records of the steps it replays win
        ref = [m.loss for m in first[:101]] + [m.loss for m in again[:100]] + \
            [m.loss for m in third]
        assert np.allclose(log.columns["loss"], ref)
    assert not list(tmp_path.glob(".joined-*"))

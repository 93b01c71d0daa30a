"""The diagnose report's plots, read from their pixels: a spike shaded by its tier where it is,
every legend beside the data (never over it), and the zoom of a short spike a zoom. The PNGs
are kept in screenshots/ (git-ignored) to look at."""

from __future__ import annotations

import numpy as np
import pytest

import spikeguard as sg
from spikeguard.record import metrics_record
from spikeguard.testing import scenarios as sc
from tests import plot_check as pc


def _diagnose(tmp_path, scenario):
    from spikeguard.diagnose import diagnose

    path = tmp_path / "metrics.jsonl"
    sink = sg.JsonlSink(path, mode="w", defer=False)
    for m in scenario.metrics:
        sink.log(metrics_record(m), m.step)
    sink.close()
    return diagnose(path)


def _blend(color: str, alpha: float) -> str:
    """``color`` at ``alpha`` over white, as the PNG holds it."""
    c = alpha * pc.rgb(color) + (1 - alpha) * 255
    return "#" + "".join(f"{round(float(v)):02x}" for v in c)


@pytest.mark.parametrize("scenario", [sc.grad_storm(0), sc.logit_drift(0, start=55_000)],
                         ids=["grad_storm", "logit_drift"])
def test_diagnose_plots_shade_the_spike_and_keep_legends_off_the_data(tmp_path, scenario):
    pytest.importorskip("matplotlib")
    from spikeguard.diagnose._plots import TIER_COLORS, _png, draw, zoom_window

    diag = _diagnose(tmp_path, scenario)
    assert diag.spikes, "the scenario has a spike to draw"
    s = diag.spikes[0]
    figs = draw(diag)
    assert {"loss", "grad_norm", "spike1"} <= set(figs)
    for name, (_, fig) in figs.items():
        png = tmp_path / f"{name}.png"
        png.write_bytes(_png(fig))
        pc.keep(png, f"diagnose_{scenario.name}_{name}.png")
        img = pc.pixels(png)
        assert fig.canvas.get_width_height() == (img.shape[1], img.shape[0])
        for ax in fig.axes:
            legend = ax.get_legend()
            if legend is not None:  # beside the axes' data area, not on it
                assert legend.get_window_extent().x0 >= ax.get_window_extent().x1, name
        if name == "loss":
            ax = fig.axes[0]
            shade = _blend(TIER_COLORS[s.tier], 0.25)
            assert pc.share_at(img, fig, ax, (s.start + s.end) / 2, shade, half=1) > 0.5
            before = diag.log.steps[0] + (s.start - diag.log.steps[0]) // 4
            assert pc.share_at(img, fig, ax, before, shade, half=1) == 0.0
    lo, hi = zoom_window(s.start, s.end, diag.find.band_steps,
                         int(diag.log.steps[-1] - diag.log.steps[0]))
    x0, x1 = figs["spike1"][1].axes[0].get_xlim()
    assert lo - 0.05 * (hi - lo) - 1 <= x0 and x1 <= hi + 0.05 * (hi - lo) + 1


def test_a_short_spike_gets_a_zoom_not_the_whole_run():
    from spikeguard.diagnose._plots import zoom_window

    assert zoom_window(88, 88, 1000, 119) == (78, 93)  # a 1-step spike in a 120-step run
    assert zoom_window(300, 319, 1000, 399) == (251, 343)  # 4x its width, 1/8 of the run
    lo, hi = zoom_window(57_184, 59_000, 1000, 7000)  # a long spike keeps its evidence band
    assert (lo, hi) == (56_309, 59_437) and np.isclose(57_184 - lo, 7000 // 8)


@pytest.mark.parametrize("name", ["deepspeed_chinese_llama_issue534.log",
                                  "hfconsole_qwen_fp16_lr0.log", "megatron_fp16_gpt2_ws1.log"])
def test_precision_logs_draw_with_the_loss_scale_and_no_false_nan_marks(name):
    pytest.importorskip("matplotlib")
    from spikeguard.diagnose import diagnose
    from spikeguard.diagnose._plots import draw
    from tests.reallog_judge import REAL

    d = diagnose(REAL / name)
    figs = draw(d)  # the scaler's records left out of the replay: the traces still line up
    assert len(d.replay.trace["loss_ema_ratio"]) == len(d.log)
    logged_nan = bool((np.isnan(d.log.columns["loss"]) & ~d.log.missing["loss"]).any())
    for key, (_, fig) in figs.items():
        for ax in fig.axes:
            labels = ax.get_legend_handles_labels()[1]
            if ax.get_ylabel() == "loss":  # a missing loss cell is no NaN
                assert ("NaN / inf" in labels) == logged_nan, key
        if key.startswith("spike") and "precision" in d.spikes[int(key[5:]) - 1].kinds:
            assert "grad_scale" in [ax.get_ylabel() for ax in fig.axes]

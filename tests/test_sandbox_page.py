"""The sandbox page in a real headless Chromium (tests/browser.py) against the CLI's server.

One server and one browser for the module; every test reloads the page. Readouts are read from
the page's text, curves from the chart's data and its canvas pixels. Screenshots of each widget
go to screenshots/ (git-ignored). Real mode trains the tiny GPT for real (about 120 steps)."""

import re
import statistics
from pathlib import Path

import pytest

from tests.browser import chromium_page
from tests.test_sandbox_server import running_sandbox

ROOT = Path(__file__).resolve().parents[1]
SHOTS = ROOT / "screenshots"
KEPT, SHAVED, RED = (0x8F, 0xBB, 0xE6), (0x17, 0x3A, 0x5E), (0xD6, 0x27, 0x28)


@pytest.fixture(scope="module")
def site():
    SHOTS.mkdir(exist_ok=True)
    with running_sandbox() as (base, _, _), chromium_page(width=1280, height=1000) as page:
        seen: dict[str, list[str]] = {"requests": [], "problems": []}
        page.on("request", lambda r: seen["requests"].append(r.url))
        page.on("console", lambda m: m.type in ("error", "warning")
                and seen["problems"].append(m.text))
        page.on("pageerror", lambda e: seen["problems"].append(str(e)))
        yield base, page, seen


def fresh(site):
    base, page, _ = site
    page.goto(base + "/")
    page.wait_for_function("() => window.sandbox && window.sandbox.renders > 0 && "
                           "window.sandbox.clipRenders > 0")
    return page


def act_and_wait(page, counter: str, action) -> None:
    """Run ``action`` and wait until the widget has drawn the server's answer to it."""
    n = page.evaluate(f"() => window.sandbox.{counter}")
    action()
    page.wait_for_function(f"() => window.sandbox.{counter} > {n}")


def close_to(rgb, want, tol=12) -> bool:
    return all(abs(a - b) <= tol for a, b in zip(rgb, want))


def test_page_is_self_contained_and_states_its_model(site):
    base, page, seen = site
    page = fresh(site)
    assert seen["requests"] and all(u.startswith(base + "/") for u in seen["requests"]), \
        seen["requests"]
    assert seen["problems"] == []  # no CSP violation, no script error, no failed load
    text = page.inner_text("body")
    assert "An SGD picture, not a claim about AdamW" in text
    assert "clipping changes the gradient it sees, not the size of the step" in text
    assert "AllReduce" in text
    assert page.is_visible("#real-mode")
    assert "GPTConfig.tiny()" in text
    page.click("summary")
    assert page.inner_text("[data-model='S0']") == "14"  # from the server's MODEL


def nan_pixel(page):
    """The canvas colour where the red flatline is drawn (a step after the NaN, top of chart)."""
    return page.evaluate("""() => {
        const u = window.sandbox.spikeChart, n = u.data[0].length;
        const x = u.valToPos(n - 20, 'x', true), y = u.valToPos(11.6, 'y', true);
        return Array.from(u.ctx.getImageData(Math.round(x), Math.round(y), 1, 1).data);
    }""")


def test_clipping_turns_a_run_that_went_nan_into_a_survivor(site):
    page = fresh(site)
    readout = page.inner_text("#nan-step")
    m = re.fullmatch(r"NaN at step (\d+)", readout)
    assert m, readout
    assert page.inner_text("#final-loss") == "NaN"
    assert close_to(nan_pixel(page)[:3], RED, tol=40)
    page.locator("#widget-spikes").screenshot(path=str(SHOTS / "sandbox_spikes_nan.png"))

    act_and_wait(page, "renders", lambda: page.check("#clip"))
    assert page.inner_text("#nan-step") == "survived"
    assert 2.0 < float(page.inner_text("#final-loss")) < 12.0
    assert int(page.inner_text("#steps-clipped")) > 0
    assert not close_to(nan_pixel(page)[:3], RED, tol=40)
    page.locator("#widget-spikes").screenshot(path=str(SHOTS / "sandbox_spikes_clipped.png"))


def test_moving_the_lr_slider_changes_the_curve(site):
    page = fresh(site)
    before = page.evaluate("() => window.sandbox.spikeChart.data[1].slice(0, 3000)")
    canvas = page.evaluate("() => window.sandbox.spikeChart.ctx.canvas.toDataURL()")
    page.focus("#peak_lr")
    for _ in range(4):  # 0.1 -> 0.12 in steps of 0.005, as a user's arrow keys do
        page.keyboard.press("ArrowRight")
    page.wait_for_function("() => window.sandbox.sim.config.peak_lr === 0.12")
    assert page.inner_text("#peak_lr-out") == "0.12"
    after = page.evaluate("() => window.sandbox.spikeChart.data[1].slice(0, 3000)")
    assert after != before
    assert page.evaluate("() => window.sandbox.spikeChart.ctx.canvas.toDataURL()") != canvas


def test_clip_widget_caps_bars_above_c_with_a_darker_shaved_part(site):
    page = fresh(site)
    got = page.evaluate("""() => {
        const u = window.sandbox.clipChart, d = u.data, c = d[3][0];
        const px = (x, y) => Array.from(u.ctx.getImageData(Math.round(x), Math.round(y), 1, 1).data);
        const X = (i) => u.valToPos(d[0][i], 'x', true), Y = (v) => u.valToPos(v, 'y', true);
        let i = 0;
        d[1].forEach((v, k) => { if (v > d[1][i]) i = k; });
        const q = d[1].findIndex((v) => v < 0.9 * c);
        return { c, norm: d[1], kept: d[2], dash: u.series[3].dash,
                 shaved: px(X(i), (Y(d[1][i]) + Y(c)) / 2), capped: px(X(i), (Y(c) + Y(0)) / 2),
                 quiet: px(X(q), (Y(d[1][q]) + Y(0)) / 2), over: px(X(q), (Y(d[1][q]) + Y(c)) / 2) };
    }""")
    c = got["c"]
    above = [i for i, n in enumerate(got["norm"]) if n > c]
    assert above, "the window has outliers above c"
    for n, k in zip(got["norm"], got["kept"]):
        assert k == pytest.approx(min(n, c))
    assert got["dash"] == [8, 6]
    assert close_to(got["shaved"][:3], SHAVED) and close_to(got["capped"][:3], KEPT)
    assert close_to(got["quiet"][:3], KEPT)
    assert got["over"][3] < 40 or min(got["over"][:3]) > 200  # above a quiet bar: background
    page.locator("#widget-clipping").screenshot(path=str(SHOTS / "sandbox_clipping.png"))

    page.focus("#cc")
    for _ in range(10):  # c = 1.0 -> 2.0
        page.keyboard.press("ArrowRight")
    page.wait_for_function("() => window.sandbox.clip.config.c === 2")
    n_above = page.evaluate("() => window.sandbox.clipChart.data[1].filter((v) => v > 2).length")
    assert 0 < n_above < len(above)


def rank_scales(page) -> list[float]:
    return [float(x) for x in page.eval_on_selector_all(
        "#rank-table td.scale", "(tds) => tds.map((td) => td.dataset.scale)")]


def test_local_norm_bug_toggle_shows_differing_rank_scales(site):
    page = fresh(site)
    g = page.evaluate("() => window.sandbox.clip.norm[window.sandbox.clip.selected]")
    scales = rank_scales(page)
    assert len(scales) == 4 and g > 1.0
    assert scales == pytest.approx([1.0 / g] * 4)  # global: one factor, min(1, c/||g||)
    act_and_wait(page, "clipRenders", lambda: page.check("#local"))
    bug = rank_scales(page)
    assert len(bug) == 4 and max(bug) / min(bug) > 1.5, bug
    assert "different factors" in page.inner_text("#rank-summary")
    page.locator("#widget-clipping").screenshot(path=str(SHOTS / "sandbox_clipping_bug.png"))


def test_real_mode_streams_a_real_run_and_shows_the_outlier_skipped(site):
    """Widget 1's toggles (all off) on the real tiny GPT, an outlier batch at step 60 of 120:
    every record arrives over server-sent events, the loss starts at ln(256) (uniform over
    bytes) and falls, and the outlier's update is withheld, drawn as a red marker."""
    base, page, seen = site
    page = fresh(site)
    page.fill("#real-steps", "5000")  # refused by the server, which says why
    page.click("#real-mode")
    page.wait_for_function("() => !document.getElementById('real-error').hidden")
    assert "steps=5000 must be <= 2000" in page.inner_text("#real-error")
    page.fill("#real-steps", "120")
    page.fill("#real-outlier-step", "60")
    page.click("#real-mode")
    page.wait_for_function("() => window.sandbox.real.outcome !== null", timeout=600_000)

    real = page.evaluate("""() => { const r = window.sandbox.real, d = r.chart.data;
        return { outcome: r.outcome, what: r.what, step: d[0], loss: d[1], skip: d[2],
                 norm: d[4], armed: r.armed }; }""")
    assert real["outcome"]["status"] == "finished", real["outcome"]
    # the skipped batch is made up by one more step, so the run applies its 120 updates
    assert real["outcome"]["made_up"] == 1
    assert int(page.inner_text("#real-points")) == 121
    assert real["step"] == list(range(121))
    assert real["what"]["clip"] is None and real["what"]["warmup_steps"] == 0
    assert real["what"]["z_loss"] == 0 and real["what"]["inject"] == ["outlier@60"]
    assert "GPTConfig.tiny()" in page.inner_text("#real-what")
    assert abs(real["loss"][0] - 5.545) < 0.3  # ln 256: an untrained model's loss on bytes
    assert statistics.mean(real["loss"][-10:]) < real["loss"][0] - 1.5
    # the outlier's gradient is several times the running median, and that step is skipped
    assert real["norm"][60] > 3 * statistics.median(real["norm"][real["armed"]:60])
    assert [i for i, v in enumerate(real["skip"]) if v is not None] == [60]
    assert real["skip"][60] == real["loss"][60]
    assert page.inner_text("#real-skips") == "60"
    status = page.inner_text("#real-status")
    assert status.startswith("finished: 120 updates applied (1 skipped batch made up")
    assert "the guard skipped step 60 (the batch)" in status  # what the guard did, and why
    marker = page.evaluate("""() => { const u = window.sandbox.real.chart;
        const x = u.valToPos(60, 'x', true), y = u.valToPos(u.data[2][60], 'y', true);
        return Array.from(u.ctx.getImageData(Math.round(x), Math.round(y), 1, 1).data); }""")
    assert close_to(marker[:3], RED, tol=40), marker
    assert all(u.startswith(base + "/") for u in seen["requests"])
    page.locator("#widget-spikes").screenshot(path=str(SHOTS / "sandbox_real.png"))

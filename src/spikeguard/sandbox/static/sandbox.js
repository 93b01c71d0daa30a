// The sandbox page: two widgets drawn with uPlot from the server's JSON (/api/simulate,
// /api/clipping). window.sandbox exposes the charts and render counters for the page tests.
"use strict";
(function () {
  const sb = { renders: 0, clipRenders: 0, spikeChart: null, clipChart: null, sim: null, clip: null };
  window.sandbox = sb;
  const $ = (id) => document.getElementById(id);

  const BLUE = "#1f6fb4", RED = "#d62728", GREY = "#8a8a8a";
  const KEPT = "#8fbbe6", SHAVED = "#173a5e";
  const Y_MAX = 12, NAN_LEVEL = 11.6;

  // A fetch loop per widget: at most one request in flight; the latest inputs win.
  function liveQuery(url, query, render, errorEl) {
    let busy = false, dirty = false;
    async function run() {
      if (busy) { dirty = true; return; }
      busy = true;
      try {
        do {
          dirty = false;
          const resp = await fetch(url + "?" + query().toString());
          const body = await resp.json();
          if (dirty) continue;
          if (!resp.ok) {
            errorEl.textContent = body.error || ("HTTP " + resp.status);
            errorEl.hidden = false;
          } else {
            errorEl.hidden = true;
            render(body);
          }
        } while (dirty);
      } catch (err) {
        errorEl.textContent = String(err);
        errorEl.hidden = false;
      } finally {
        busy = false;
      }
    }
    return run;
  }

  function showValue(id) {
    const out = $(id + "-out");
    if (out) out.textContent = $(id).value;
  }

  function chartWidth(el) {
    return Math.max(400, el.clientWidth || 900);
  }

  // ---- widget 1: the loss-spike sandbox ----
  const SIM_SLIDERS = ["peak_lr", "spike_rate", "spike_size", "clip_c", "seed"];
  const SIM_TOGGLES = ["clip", "warmup", "z_loss"];

  function simQuery() {
    const q = new URLSearchParams();
    for (const id of SIM_SLIDERS) q.set(id, $(id).value);
    for (const id of SIM_TOGGLES) q.set(id, $(id).checked ? "1" : "0");
    return q;
  }

  function makeSpikeChart() {
    const el = $("spike-chart");
    const opts = {
      width: chartWidth(el), height: 320,
      scales: { x: { time: false }, y: { range: [0, Y_MAX] },
                lr: { range: (u, lo, hi) => [0, Math.max(hi || 0, 1e-6) * 1.1] } },
      axes: [{ label: "step" }, { label: "loss (nats)" },
             { scale: "lr", side: 1, label: "learning rate", grid: { show: false } }],
      series: [{ label: "step" },
               { label: "loss", stroke: BLUE, width: 1 },
               { label: "NaN", stroke: RED, width: 3 },
               { label: "learning rate", scale: "lr", stroke: GREY, width: 1, dash: [4, 4] }],
    };
    return new uPlot(opts, [[], [], [], []], el);
  }

  function renderSim(res) {
    const n = res.config.steps, done = res.loss.length;
    const x = new Array(n), loss = new Array(n), nan = new Array(n), lr = new Array(n);
    for (let i = 0; i < n; i++) {
      x[i] = i;
      loss[i] = i < done ? res.loss[i] : null;
      lr[i] = i < done ? res.lr[i] : null;
      nan[i] = (res.nan_step !== null && i >= res.nan_step) ? NAN_LEVEL : null;
    }
    sb.spikeChart.setData([x, loss, nan, lr]);
    $("final-loss").textContent = res.survived ? res.final_loss.toFixed(3) : "NaN";
    const nanEl = $("nan-step");
    nanEl.textContent = res.survived ? "survived" : "NaN at step " + res.nan_step;
    nanEl.dataset.nanStep = res.survived ? "" : String(res.nan_step);
    nanEl.className = res.survived ? "ok" : "bad";
    $("steps-clipped").textContent = String(res.steps_clipped);
    $("peak-scale").textContent = res.peak_logit_scale.toFixed(2) + "x";
    for (const el of document.querySelectorAll("[data-model]")) {
      el.textContent = String(res.model[el.dataset.model]);
    }
    sb.sim = res;
    sb.renders += 1;
  }

  // ---- widget 2: global-norm clipping as a collective ----
  let selected = null;  // step index in the window, or null for the largest norm
  let clipTop = 1;      // the y axis shows every bar whole and the threshold

  function clipQuery() {
    const q = new URLSearchParams();
    q.set("c", $("cc").value);
    q.set("ranks", $("ranks").value);
    q.set("start", $("start").value);
    q.set("local", $("local").checked ? "1" : "0");
    return q;
  }

  function makeClipChart() {
    const el = $("clip-chart");
    const bars = uPlot.paths.bars({ size: [0.7, 40] });
    const opts = {
      width: chartWidth(el), height: 300,
      scales: { x: { time: false, range: (u, lo, hi) => [lo - 1, hi + 1] },
                y: { range: () => [0, clipTop] } },
      axes: [{ label: "step" }, { label: "||g||" }],
      series: [{ label: "step" },
               { label: "shaved off by clipping", fill: SHAVED, stroke: SHAVED, paths: bars,
                 points: { show: false } },
               { label: "||g|| after clipping", fill: KEPT, stroke: KEPT, paths: bars,
                 points: { show: false } },
               { label: "threshold c", stroke: RED, width: 2, dash: [8, 6],
                 points: { show: false } },
               { label: "update norm with local clipping", stroke: "transparent",
                 points: { show: true, size: 7, stroke: RED, fill: "#ffffff" }, show: false }],
    };
    const u = new uPlot(opts, [[], [], [], [], []], el);
    u.over.addEventListener("click", () => {
      if (u.cursor.idx !== null && u.cursor.idx !== undefined && sb.clip) {
        selected = u.cursor.idx;
        renderRanks(sb.clip);
      }
    });
    return u;
  }

  function renderRanks(res) {
    const i = selected !== null && selected < res.step.length ? selected : res.selected;
    const c = res.config.c, g = res.norm[i], scales = res.scale[i], shards = res.rank_norm[i];
    const lo = Math.min(...scales), hi = Math.max(...scales);
    const body = $("rank-table").querySelector("tbody");
    body.replaceChildren();
    shards.forEach((gr, r) => {
      const tr = document.createElement("tr");
      const cells = [String(r), gr.toFixed(3), scales[r].toFixed(3)];
      cells.forEach((text, k) => {
        const td = document.createElement("td");
        td.textContent = text;
        if (k === 2) { td.className = "scale"; td.dataset.scale = String(scales[r]); }
        tr.appendChild(td);
      });
      const td = document.createElement("td");
      const bar = document.createElement("span");
      bar.className = "scalebar";
      bar.style.width = (scales[r] * 100).toFixed(1) + "%";
      td.appendChild(bar);
      tr.appendChild(td);
      body.appendChild(tr);
    });
    $("rank-caption").textContent = "step " + res.step[i] + ": ||g|| = " + g.toFixed(3) +
      ", c = " + c + " (click a bar to pick another step)";
    const summary = $("rank-summary");
    if (res.config.local) {
      summary.textContent = "Local-norm clipping: each rank compares its own shard's norm with c, so" +
        " the ranks scale by different factors (" + lo.toFixed(3) + " to " + hi.toFixed(3) +
        "). The update changes direction and its norm is " + res.update_norm[i].toFixed(3) +
        ", not min(||g||, c) = " + res.kept[i].toFixed(3) + ".";
      summary.className = "bad";
    } else {
      summary.textContent = "Global-norm clipping: after one AllReduce every rank knows ||g|| and" +
        " scales by the same factor min(1, c/||g||) = " + hi.toFixed(3) + ".";
      summary.className = "ok";
    }
  }

  function renderClip(res) {
    const c = res.config.c;
    const u = sb.clipChart;
    clipTop = 1.1 * Math.max(c, ...res.norm, ...res.update_norm);
    u.setSeries(4, { show: res.config.local });
    u.setData([res.step, res.norm, res.kept, res.step.map(() => c), res.update_norm]);
    sb.clip = res;
    renderRanks(res);
    sb.clipRenders += 1;
  }

  // ---- wiring ----
  const runSim = liveQuery("/api/simulate", simQuery, renderSim, $("sim-error"));
  const runClip = liveQuery("/api/clipping", clipQuery, renderClip, $("clip-error"));

  function start() {
    sb.spikeChart = makeSpikeChart();
    sb.clipChart = makeClipChart();
    for (const id of SIM_SLIDERS) {
      showValue(id);
      $(id).addEventListener("input", () => { showValue(id); runSim(); });
    }
    for (const id of SIM_TOGGLES) $(id).addEventListener("change", runSim);
    for (const id of ["cc", "ranks", "start"]) {
      showValue(id);
      $(id).addEventListener("input", () => { showValue(id); selected = null; runClip(); });
    }
    $("local").addEventListener("change", runClip);
    window.addEventListener("resize", () => {
      sb.spikeChart.setSize({ width: chartWidth($("spike-chart")), height: 320 });
      sb.clipChart.setSize({ width: chartWidth($("clip-chart")), height: 300 });
    });
    runSim();
    runClip();
  }

  start();
})();

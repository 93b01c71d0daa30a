// Real mode: POST /api/real starts `spikeguard train` on GPTConfig.tiny() in a child process of
// the server, with the loss-spike widget's toggles and seed; the run's metrics records arrive
// over server-sent events (/api/real/events) and are drawn as they come. window.sandbox.real
// exposes the run's state for the page tests.
"use strict";
(function () {
  const sb = window.sandbox;
  const $ = (id) => document.getElementById(id);
  const BLUE = "#1f6fb4", RED = "#d62728", GREY = "#8a8a8a", ORANGE = "#e08a00";
  const SKIP = 2, ALERT = 3;  // series indices of the markers

  const real = { points: 0, draws: 0, run: null, what: null, outcome: null, last: null,
                 skips: [], alerts: [], rollbacks: [], armed: null, chart: null, source: null };
  sb.real = real;
  let cols = [[], [], [], [], []];  // step, loss, skip marker, alert marker, grad norm
  let drawQueued = false;

  const num = (v) => (typeof v === "number" && Number.isFinite(v)) ? v : null;

  function makeChart() {
    const el = $("real-chart");
    const marker = (color) => ({ stroke: "transparent",
                                 points: { show: true, size: 11, width: 2, stroke: color, fill: color } });
    const opts = {
      width: Math.max(400, el.clientWidth || 900), height: 300,
      legend: { markers: { show: true, width: 2, dash: "solid", stroke: (u, i) => [null, BLUE, RED, ORANGE, GREY][i],
                           fill: (u, i) => (i === SKIP ? RED : i === ALERT ? ORANGE : "transparent") } },
      scales: { x: { time: false }, g: { range: (u, lo, hi) => [0, Math.max(hi || 0, 1) * 1.1] } },
      axes: [{ label: "step" }, { label: "train loss (nats)" },
             { scale: "g", side: 1, label: "grad norm (before clipping)", grid: { show: false } }],
      series: [{ label: "step" },
               { label: "loss", stroke: BLUE, width: 1.5, points: { show: false } },
               Object.assign({ label: "skipped by the guard" }, marker(RED)),
               Object.assign({ label: "Tier 2-3: alert, rollback, halt" }, marker(ORANGE)),
               { label: "grad norm", scale: "g", stroke: GREY, width: 1, points: { show: false } }],
    };
    return new uPlot(opts, cols, el);
  }

  function draw() {
    drawQueued = false;
    real.chart.setData(cols);
    $("real-points").textContent = String(real.points);
    $("real-skips").textContent = real.skips.length ? real.skips.join(", ") : "none";
    $("real-armed").textContent = real.armed === null ? "\u2013" : "step " + real.armed;
    const l = real.last && num(real.last.loss);
    $("real-loss").textContent = l === null || l === undefined ? "\u2013" : l.toFixed(3);
    if (real.last && !real.outcome) {
      $("real-status").textContent = "running: step " + real.last.step + " of " +
        (real.what ? real.what.steps : "?");
    }
    real.draws += 1;
  }

  function queueDraw() {
    if (!drawQueued) { drawQueued = true; requestAnimationFrame(draw); }
  }

  function add(rec) {
    // after a rollback the replayed steps come again: they replace the ones they repeat
    const x = cols[0];
    if (x.length && rec.step <= x[x.length - 1]) {
      const k = x.findIndex((s) => s >= rec.step);
      cols = cols.map((c) => c.slice(0, k));
    }
    const loss = num(rec.loss);
    const top = Math.max(0, ...cols[1].filter((v) => v !== null));
    const at = loss === null ? top : loss;  // a non-finite loss: the marker sits at the top
    cols[0].push(rec.step);
    cols[1].push(loss);
    cols[SKIP].push(rec.skipped ? at : null);
    cols[ALERT].push(rec.tier >= 2 ? at : null);
    cols[4].push(num(rec.grad_norm));
    if (rec.skipped) real.skips.push(rec.step);
    if (rec.action === "alert") real.alerts.push(rec.step);
    if (rec.action === "rollback") real.rollbacks.push(rec.step);
    if (real.armed === null && rec.armed) real.armed = rec.step;
    real.points += 1;
    real.last = rec;
    queueDraw();
  }

  function describe(w) {
    const onOff = (on, text) => on ? text : "off";
    return w.model + ": " + w.n_layer + " layers, width " + w.d_model + ", context " + w.seq_len +
      ", " + w.params.toLocaleString("en") + " parameters; batch " + w.batch_size +
      ", AdamW at peak LR " + w.lr + ", " + w.precision + " on the CPU. Clipping " +
      onOff(w.clip !== null, "at " + w.clip) + ", warmup " +
      onOff(w.warmup_steps > 0, w.warmup_steps + " steps") + ", z-loss " +
      onOff(w.z_loss > 0, String(w.z_loss)) + ", QK-norm " + onOff(w.qk_norm, "on") +
      "; Tier 2: " + w.tier2 + "; " + (w.inject.length ? "fault " + w.inject.join(", ")
      : "no injected fault") + ". Data: " + w.data + ".";
  }

  function finish(out) {
    real.outcome = out;
    $("real-stop").disabled = true;
    const status = $("real-status");
    if (out.status === "finished") {
      status.textContent = "finished: " + out.applied + " updates applied" +
        (out.made_up ? " (" + out.made_up + " skipped batch" + (out.made_up > 1 ? "es" : "") +
          " made up by running past the last step)" : "") +
        (out.rollbacks ? ", " + out.rollbacks + " rollbacks" : "") +
        (out.val_loss !== null ? ", held-out loss " + out.val_loss.toFixed(3) : "") +
        (out.guard ? ". " + out.guard : "");
      status.className = "ok";
    } else if (out.status === "halted") {
      status.textContent = "halted at step " + out.halt.step + ": " + out.halt.reasons.join("; ") +
        (out.halt.detail ? " (" + out.halt.detail + ")" : "") + (out.guard ? ". " + out.guard : "");
      status.className = "bad";
    } else {
      status.textContent = out.status;
      status.className = "bad";
      if (out.message) showError(out.message);
    }
    queueDraw();
  }

  function showError(text) {
    const el = $("real-error");
    el.textContent = text;
    el.hidden = !text;
  }

  function attach(info) {
    if (real.source) real.source.close();
    cols = [[], [], [], [], []];
    Object.assign(real, { points: 0, run: info.run, what: null, outcome: null, last: null,
                          skips: [], alerts: [], rollbacks: [], armed: null });
    $("real-what").textContent = "";
    $("real-status").textContent = "starting run " + info.run + " (loading PyTorch and the data)";
    $("real-status").className = "";
    $("real-stop").disabled = false;
    showError("");
    queueDraw();
    const es = new EventSource(info.events);
    real.source = es;
    es.addEventListener("config", (e) => {
      real.what = JSON.parse(e.data);
      $("real-what").textContent = describe(real.what);
    });
    es.onmessage = (e) => add(JSON.parse(e.data));
    es.addEventListener("end", (e) => {
      es.close();
      finish(JSON.parse(e.data));
    });
    es.onerror = () => {
      if (es.readyState === EventSource.CLOSED && !real.outcome) {
        showError("lost the stream of run " + info.run + " (the server stopped or started " +
                  "another run)");
      }
    };
  }

  async function post(url) {
    const resp = await fetch(url, { method: "POST" });
    return [resp, await resp.json()];
  }

  async function startRun() {
    const q = new URLSearchParams();
    q.set("steps", $("real-steps").value);
    q.set("outlier_step", $("real-outlier-step").value);
    q.set("outlier", $("real-outlier").checked ? "1" : "0");
    q.set("rollback", $("real-rollback").checked ? "1" : "0");
    for (const id of ["clip", "warmup", "z_loss"]) q.set(id, $(id).checked ? "1" : "0");
    q.set("seed", $("seed").value);
    try {
      const [resp, body] = await post("/api/real?" + q.toString());
      if (!resp.ok) { showError(body.error || ("HTTP " + resp.status)); return; }
      attach(body);
    } catch (err) {
      showError(String(err));
    }
  }

  async function stopRun() {
    try {
      const [resp, body] = await post("/api/real/stop");
      if (!resp.ok) showError(body.error || ("HTTP " + resp.status));
    } catch (err) {
      showError(String(err));
    }
  }

  async function start() {
    real.chart = makeChart();
    $("real-mode").addEventListener("click", startRun);
    $("real-stop").addEventListener("click", stopRun);
    window.addEventListener("resize", () => {
      real.chart.setSize({ width: Math.max(400, $("real-chart").clientWidth || 900), height: 300 });
    });
    try {  // a run already going (started from another tab): follow it
      const resp = await fetch("/api/real");
      const body = await resp.json();
      if (resp.ok && body.running) attach(body);
    } catch (err) {
      showError(String(err));
    }
  }

  start();
})();

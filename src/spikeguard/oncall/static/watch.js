"use strict";
// The watch page: polls /api/state, fills the incident's summary, posts an answer as JSON.
const watch = { renders: 0, incident: null, state: null };
window.watch = watch;

function fmt(x) {
  if (x === null || x === undefined) return "-";
  if (typeof x === "number") return Number.isInteger(x) ? String(x) : x.toPrecision(4);
  if (Array.isArray(x)) return x.map(fmt).join(", ");
  if (typeof x === "object") return Object.entries(x).map(([k, v]) => k + " " + fmt(v)).join(", ");
  return String(x);
}

function text(id, value) { document.getElementById(id).textContent = value; }

function render(s) {
  watch.state = s;
  text("run", "run directory " + s.run_dir + (s.answer_waiting ? " (an answer waits for the next step)" : ""));
  const last = s.records.length ? s.records[s.records.length - 1] : null;
  text("last-step", last ? fmt(last.step) : "-");
  text("last-loss", last ? fmt(last.loss) : "-");
  text("last-logz", last ? fmt(last.log_z) : "-");
  text("last-norm", last ? fmt(last.grad_norm) : "-");
  text("pages", s.pages.sent + " sent, " + s.pages.unsent + " unsent");
  const inc = s.incident;
  if (inc) {
    const fresh = watch.incident !== inc.id;
    watch.incident = inc.id;
    text("incident-id", inc.id);
    text("incident-status", "(" + inc.status + ")");
    for (const td of document.querySelectorAll("[data-field]")) {
      td.textContent = fmt(inc.summary[td.dataset.field]);
    }
    text("decision", inc.decision ? fmt(inc.decision) : "waiting for an answer");
    text("commands", Object.values(inc.answers || {}).join("\n"));
    const img = document.getElementById("plot");
    if (fresh || img.hidden) {
      img.onload = () => { img.hidden = false; };
      img.src = "/api/plot?incident=" + encodeURIComponent(inc.id);
    }
    if (fresh) {
      const sm = inc.summary;
      document.getElementById("to").value = sm.rollback_checkpoint ?? "";
      document.getElementById("skip").value = sm.data_range ? sm.data_range.join(":") : "";
    }
  }
  watch.renders += 1;
}

async function refresh() {
  try {
    const r = await fetch("/api/state");
    if (r.ok) render(await r.json());
  } catch (e) { /* the server stopped: keep the last state on screen */ }
}

async function answer(action) {
  const out = document.getElementById("answer-result");
  const body = { incident: watch.incident, action: action };
  if (action === "rollback") {
    body.to = document.getElementById("to").value.trim();
    body.skip_data = document.getElementById("skip").value.trim();
  }
  if (action !== "halt") {
    body.set = document.getElementById("set").value.trim().split(/\s+/).filter((x) => x);
  }
  const r = await fetch("/api/answer", { method: "POST", headers: { "Content-Type": "application/json" },
                                         body: JSON.stringify(body) });
  const j = await r.json();
  out.className = r.ok ? "ok" : "error";
  out.textContent = r.ok ? "answered " + action + ": the run applies it at its next step" : j.error;
  watch.answers = (watch.answers || 0) + 1;
  refresh();
}

for (const a of ["rollback", "continue", "halt"]) {
  document.getElementById(a).addEventListener("click", () => answer(a));
}
refresh();
setInterval(refresh, 2000);

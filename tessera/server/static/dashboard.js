// Tessera dashboard: polls /v1/engine/live and draws the last minutes with uPlot.
"use strict";

(() => {
  const REFRESH_MS = 2000;
  const $ = (id) => document.getElementById(id);
  const els = {
    model: $("dash-model"), span: $("dash-span"), pause: $("dash-pause"), status: $("dash-status"),
    summary: $("summary"), charts: $("charts"), settings: $("settings"),
  };
  const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#d97706"];
  // Each chart: its series in the live snapshot, how to show them, and an optional scale.
  const CHARTS = [
    { id: "throughput", title: "Throughput", unit: "tok/s",
      series: [["generation_tps", "generation"], ["prompt_tps", "prompt"]] },
    { id: "ttft", title: "Time to first token", unit: "ms",
      series: [["ttft_p50_ms", "p50"], ["ttft_p95_ms", "p95"]] },
    { id: "itl", title: "Inter-token latency", unit: "ms",
      series: [["itl_p50_ms", "p50"], ["itl_p95_ms", "p95"]] },
    { id: "requests", title: "Requests", unit: "",
      series: [["running", "running"], ["waiting", "waiting"]] },
    { id: "cache", title: "KV cache use and prefix hits", unit: "%", percent: true,
      series: [["kv_usage", "KV used"], ["prefix_hit_rate", "prefix hit rate"]] },
    { id: "pressure", title: "Preemptions and 429s", unit: "/s",
      series: [["preemptions", "preemptions"], ["rejections", "429s"]] },
  ];
  const plots = {};
  let paused = false;
  let updates = 0;

  function fmt(v, unit) {
    if (v === null || v === undefined) return "–";
    const n = Math.abs(v) >= 100 ? Math.round(v) : Math.round(v * 10) / 10;
    return unit ? `${n} ${unit}` : String(n);
  }

  function makeChart(spec) {
    const fig = document.createElement("figure");
    fig.className = "chart-card";
    const cap = document.createElement("figcaption");
    cap.textContent = spec.unit ? `${spec.title} (${spec.unit})` : spec.title;
    const box = document.createElement("div");
    box.className = "chart";
    box.id = "chart-" + spec.id;
    box.setAttribute("role", "img");
    fig.append(cap, box);
    els.charts.append(fig);
    const opts = {
      width: Math.max(200, box.clientWidth || 400),
      height: 180,
      legend: { live: false },
      cursor: { drag: { x: false, y: false } },
      scales: { x: { time: true }, y: spec.percent ? { range: [0, 100] } : { range: (u, lo, hi) => [0, Math.max(1, hi * 1.1)] } },
      axes: [{ stroke: "currentColor", grid: { stroke: "rgba(128,128,128,0.2)" } },
             { stroke: "currentColor", grid: { stroke: "rgba(128,128,128,0.2)" }, size: 50 }],
      series: [{}].concat(spec.series.map(([, label], i) => ({
        label, stroke: COLORS[i], width: 2, spanGaps: true, points: { show: false },
      }))),
    };
    const data = [[]].concat(spec.series.map(() => []));
    const plot = new uPlot(opts, data, box);
    new ResizeObserver(() => plot.setSize({ width: Math.max(200, box.clientWidth), height: 180 })).observe(box);
    plots[spec.id] = { plot, box, spec };
  }

  function tile(label, value, id) {
    const div = document.createElement("div");
    div.className = "tile";
    div.id = "tile-" + id;
    const v = document.createElement("span");
    v.className = "value";
    v.textContent = value;
    const l = document.createElement("span");
    l.className = "label";
    l.textContent = label;
    div.append(v, l);
    return div;
  }

  // Queue per priority class ("priority: running / waiting"), and the batches with work left.
  function priorityText(cur) {
    const classes = cur.by_priority || [];
    return classes.length ? classes.map((c) => `${c.priority}: ${c.running} / ${c.waiting}`).join(" · ") : "–";
  }

  function batchTile(batches) {
    const text = batches.map((b) => `${b.id.slice(0, 14)}… ${b.completed + b.failed} / ${b.total}` +
      (b.status === "in_progress" ? "" : ` (${b.status})`)).join(" · ");
    return tile("batches (answered / total)", text || "none", "batches");
  }

  function renderSummary(m, batches) {
    const s = m.summary;
    const cur = m.current || {};
    const pct = (x) => (x === null || x === undefined ? "–" : `${Math.round(x * 1000) / 10} %`);
    els.summary.replaceChildren(
      tile("generation tok/s (1 min)", fmt(s.generation_tps), "generation"),
      tile("TTFT p50 / p95", `${fmt(s.ttft_ms.p50)} / ${fmt(s.ttft_ms.p95, "ms")}`, "ttft"),
      tile("ITL p50 / p95", `${fmt(s.itl_ms.p50)} / ${fmt(s.itl_ms.p95, "ms")}`, "itl"),
      tile("running / waiting", `${fmt(cur.running)} / ${fmt(cur.waiting)}`, "requests"),
      tile("by priority: running / waiting", priorityText(cur), "priority"),
      batchTile(batches || []),
      tile("KV cache used", pct(cur.kv_usage), "kv"),
      tile("prefix hit rate (1 min)", pct(s.prefix_hit_rate), "prefix"),
      tile("preemptions / 429s (1 min)", `${s.preemptions} / ${s.rejections}`, "pressure"),
      tile("finished (1 min)", String(s.requests_finished), "finished"),
    );
    if (m.slo) els.summary.append(sloTile(m.slo));
    if (m.adapters && m.adapters.length) els.summary.append(loraTile(m.adapters, cur));
  }

  // The LoRA adapters served on this model, each with its requests running / waiting now.
  function loraTile(adapters, cur) {
    const running = cur.lora_running || {}, waiting = cur.lora_waiting || {};
    const value = adapters.map((a) => `${a} ${running[a] || 0} / ${waiting[a] || 0}`).join(", ");
    return tile("LoRA adapters: running / waiting", value, "lora");
  }

  // Whether the last minute's traffic still meets the SLO the server was tuned for (--slo).
  function sloTile(slo) {
    const missed = slo.objectives.filter((o) => o.ok === false);
    const value = slo.fits === null ? "no data" : slo.fits ? "fits" : "missed";
    const div = tile(`SLO ${slo.slo} (1 min)`, value, "slo");
    div.dataset.fits = String(slo.fits);
    div.title = slo.objectives.map((o) =>
      `${o.metric}: ${o.live_ms === null ? "not measured" : fmt(o.live_ms, "ms")} (limit ${fmt(o.limit_ms, "ms")})`).join("\n");
    if (missed.length) {
      const why = document.createElement("span");
      why.className = "label";
      why.textContent = missed.map((o) => `${o.metric} ${fmt(o.live_ms)} > ${fmt(o.limit_ms, "ms")}`).join(", ");
      div.append(why);
    }
    return div;
  }

  function renderSettings(settings) {
    const rows = [];
    for (const [k, v] of Object.entries(settings)) {
      const dt = document.createElement("dt");
      dt.textContent = k.replace(/_/g, " ");
      const dd = document.createElement("dd");
      dd.textContent = v === null || v === undefined ? "–" : String(v);
      rows.push(dt, dd);
    }
    els.settings.replaceChildren(...rows);
  }

  function renderCharts(m) {
    const series = m.series;
    for (const { plot, box, spec } of Object.values(plots)) {
      const scale = spec.percent ? 100 : 1;
      const data = [series.t].concat(spec.series.map(([key]) =>
        series[key].map((v) => (v === null ? null : v * scale))));
      plot.setData(data);
      const latest = spec.series.map(([key, label]) => {
        const vals = series[key].filter((v) => v !== null);
        const last = vals.length ? vals[vals.length - 1] * scale : null;
        return `${label} ${fmt(last, spec.unit)}`;
      });
      box.setAttribute("aria-label", `${spec.title}, latest: ${latest.join(", ")}`);
    }
  }

  async function refresh() {
    if (paused) return;
    try {
      const r = await tesseraFetch(`/v1/engine/live?seconds=${els.span.value}`);
      if (!r.ok) throw new Error(`HTTP ${r.status}`);
      const body = await r.json();
      const names = body.models.map((m) => m.model);
      if ([...els.model.options].map((o) => o.value).join() !== names.join()) {
        const chosen = els.model.value;
        els.model.replaceChildren(...names.map((n) => new Option(n, n)));
        if (names.includes(chosen)) els.model.value = chosen;
      }
      const m = body.models.find((x) => x.model === els.model.value) || body.models[0];
      if (!m) {
        const waiting = (body.configured || []).map((c) => `${c.id}: ${c.status}`).join(", ");
        els.status.textContent = `No model is loaded yet (${waiting}); models load on their first request.`;
        return;
      }
      renderSummary(m, body.batches);
      renderCharts(m);
      renderSettings(m.settings);
      updates += 1;
      document.body.dataset.updates = String(updates);
      els.status.textContent = `Updated ${new Date(m.now * 1000).toLocaleTimeString()}`;
    } catch (e) {
      els.status.textContent = "Cannot reach the server: " + e.message;
    }
  }

  els.pause.addEventListener("click", () => {
    paused = !paused;
    els.pause.setAttribute("aria-pressed", String(paused));
    els.pause.textContent = paused ? "Resume" : "Pause";
    if (!paused) refresh();
  });
  els.span.addEventListener("change", refresh);
  els.model.addEventListener("change", refresh);

  for (const spec of CHARTS) makeChart(spec);
  refresh();
  setInterval(refresh, REFRESH_MS);
})();

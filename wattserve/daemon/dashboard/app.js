/* wattserve dashboard.
 *
 * Reads one Server-Sent Events stream (GET /v1/events/stream: a backlog of the last five
 * minutes, then a telemetry snapshot a second and events as they happen) and, every few
 * seconds, GET /v1/status for what does not change (model, device) and the fleet grant and
 * its lease (every two seconds while the fleet is on). Draws the charts with
 * uPlot (vendor/). The policy form sends PUT /v1/control/policy with the bearer token the
 * operator pastes; the token lives in one variable of this closure and nowhere else (not
 * the URL, not storage, not cookies), and a 401/403 forgets it.
 */
"use strict";

(() => {
  const WINDOW_S = 300;
  const CHART_HEIGHT_PX = 190;
  const STATUS_REFRESH_MS = 10000;
  const FLEET_STATUS_REFRESH_MS = 2000; // grants change every allocation period
  const RECONNECT_AFTER_END_MS = 5000;
  const EVENTS_SHOWN = 40;
  const MARKER_HOVER_PX = 6;
  // Weight quantization levels, fewest bits lowest on the knobs chart; levels this page
  // does not know are appended as they appear.
  const QUANT_ORDER = ["int4", "int4-g64", "int4-g128", "int8", "fp8", "bf16", "fp32"];
  // Events marked on the knobs chart's time axis, and their colours.
  const MARK_COLORS = {
    decision: "#e8590c",
    policy_changed: "#1971c2",
    policy_rejected: "#c92a2a",
    quantization_switch: "#9c36b5",
    device_fault: "#c92a2a",
    engine_fault: "#c92a2a",
    drain: "#495057",
  };

  // Band colours of the quantization strip, by level index.
  const QUANT_COLORS = ["#f3d9fa", "#eebefa", "#e5dbff", "#d0ebff", "#c5f6fa", "#d3f9d8", "#fff3bf"];

  const C = {
    power: "#d9480f", budget: "#2b8a3e", limit: "#868e96",
    p50: "#1c7ed6", p99: "#5f3dc4", slo: "#e03131",
    tok: "#1c7ed6", jpt: "#e8590c",
    temp: "#d6336c", memTemp: "#f59f00", slowdown: "#e03131",
    clock: "#1c7ed6", lock: "#74c0fc", seqs: "#2b8a3e", quant: "#ae3ec9",
  };

  const $ = (id) => document.getElementById(id);
  const finite = (v) => (typeof v === "number" && Number.isFinite(v) ? v : null);

  const data = {
    telemetry: [], // snapshots within the window, oldest first
    events: [], // newest last
    energyJ: null, // device energy since the daemon started
    lastCounterJ: null, // the device's cumulative counter at the latest snapshot
    status: null, // the latest GET /v1/status
    statusAtS: null, // when it came, by this browser's clock
  };
  let token = null; // the pasted bearer token: in memory only
  let formDirty = false;
  let streamLive = false; // between a backlog and the stream's end or error
  let nowS = Date.now() / 1000; // the latest snapshot's time: the charts' right edge
  const charts = {};
  // For the browser test and the curious: the charts, their data (never the token) and the
  // event kinds the knobs chart marks.
  window.wattserve = { charts, data, markKinds: Object.keys(MARK_COLORS) };

  // ---- formatting ------------------------------------------------------------------------

  function fmt(v, digits = 0) {
    v = finite(v);
    if (v === null) return "—";
    return v.toLocaleString("en-US", {
      minimumFractionDigits: digits,
      maximumFractionDigits: digits,
    });
  }

  function hms(unixS) {
    const d = new Date(unixS * 1000);
    return [d.getHours(), d.getMinutes(), d.getSeconds()]
      .map((n) => String(n).padStart(2, "0"))
      .join(":");
  }

  function energyText(j) {
    if (j === null) return "—";
    if (j < 1000) return `${fmt(j, 0)} J`;
    const wh = j / 3600;
    if (wh < 1000) return `${fmt(j / 1000, 1)} kJ (${fmt(wh, wh < 10 ? 2 : 1)} Wh)`;
    return `${fmt(wh / 1000, 2)} kWh`;
  }

  function policyText(p) {
    if (!p) return "—";
    return (
      `budget ${fmt(p.power_budget_w)} W · TTFT ≤ ${fmt(p.ttft_slo_ms)} ms · ` +
      `TPOT ≤ ${fmt(p.tpot_slo_ms)} ms · mode ${p.mode}`
    );
  }

  // The fleet's part of the budget: the grant in force and its lease, or the safe floor.
  function fleetText(f) {
    const link = f.connected ? "" : " · allocator link down";
    if (f.source !== "grant") {
      const why = f.source === "safe_floor_lease_expired" ? "lease expired" : "no grant yet";
      return `safe floor ${fmt(f.budget_w)} W (${why})${link}`;
    }
    const sinceS = data.statusAtS === null ? 0 : Date.now() / 1000 - data.statusAtS;
    const leftS = Math.max(0, (finite(f.lease_left_s) ?? 0) - sinceS);
    return (
      `${fmt(f.budget_w)} W · epoch ${f.epoch} · lease ${fmt(leftS)} s left ` +
      `(expires ${hms(f.expires_at_unix_s)})${link}`
    );
  }

  function quantIndex(level) {
    if (!level) return null;
    let i = QUANT_ORDER.indexOf(level);
    if (i < 0) i = QUANT_ORDER.push(level) - 1;
    return i;
  }

  // ---- charts ----------------------------------------------------------------------------

  const stepped = uPlot.paths.stepped({ align: 1 });

  // Each chart: its series (a getter from a telemetry snapshot, a unit for the caption)
  // and its y scales and axes.
  const SPECS = [
    {
      id: "power",
      series: [
        { label: "power", unit: "W", get: (t) => t.device.power_w, stroke: C.power, width: 2 },
        { label: "budget", unit: "W", get: (t) => t.policy?.power_budget_w, stroke: C.budget, dash: [8, 4], width: 2 },
        { label: "power limit", unit: "W", get: (t) => t.device.power_limit_w, stroke: C.limit, dash: [3, 3] },
      ],
      scales: { W: { range: (u, min, max) => [0, Math.max(max ?? 0, 1) * 1.08] } },
      axes: [{ scale: "W", label: "W" }],
    },
    {
      id: "throughput",
      series: [
        { label: "output", unit: "tok/s", get: (t) => t.serving.generation_tokens_per_s, stroke: C.tok, width: 2, scale: "tok" },
        { label: "energy", unit: "J/token", digits: 3, get: (t) => t.serving.energy_per_token_j, stroke: C.jpt, scale: "jpt", spanGaps: true },
      ],
      scales: {
        tok: { range: (u, min, max) => [0, Math.max(max ?? 0, 1) * 1.08] },
        jpt: { range: (u, min, max) => [0, Math.max(max ?? 0, 0.001) * 1.08] },
      },
      axes: [
        { scale: "tok", label: "tok/s" },
        { scale: "jpt", label: "J/token", side: 1, grid: { show: false } },
      ],
    },
    {
      id: "ttft",
      series: [
        { label: "p50", unit: "ms", get: (t) => t.latency.ttft_p50_ms, stroke: C.p50, spanGaps: true, points: true },
        { label: "p99", unit: "ms", get: (t) => t.latency.ttft_p99_ms, stroke: C.p99, width: 2, spanGaps: true, points: true },
        { label: "SLO", unit: "ms", get: (t) => t.policy?.ttft_slo_ms, stroke: C.slo, dash: [8, 4], width: 2 },
      ],
      scales: { ms: logScale() },
      axes: [{ scale: "ms", label: "ms (log)" }],
    },
    {
      id: "tpot",
      series: [
        { label: "p50", unit: "ms", digits: 1, get: (t) => t.latency.tpot_p50_ms, stroke: C.p50, spanGaps: true, points: true },
        { label: "p99", unit: "ms", digits: 1, get: (t) => t.latency.tpot_p99_ms, stroke: C.p99, width: 2, spanGaps: true, points: true },
        { label: "SLO", unit: "ms", get: (t) => t.policy?.tpot_slo_ms, stroke: C.slo, dash: [8, 4], width: 2 },
      ],
      scales: { ms: logScale() },
      axes: [{ scale: "ms", label: "ms (log)" }],
    },
    {
      id: "temp",
      series: [
        { label: "GPU", unit: "°C", digits: 1, get: (t) => t.device.gpu_temp_c, stroke: C.temp, width: 2 },
        { label: "memory", unit: "°C", digits: 1, get: (t) => t.device.memory_temp_c, stroke: C.memTemp },
        { label: "slowdown", unit: "°C", get: (t) => t.device.slowdown_temp_c, stroke: C.slowdown, dash: [8, 4], width: 2 },
      ],
      scales: { C: { range: (u, min, max) => [Math.min(min ?? 20, 20), Math.max(max ?? 100, 40) + 5] } },
      axes: [{ scale: "C", label: "°C" }],
    },
    {
      id: "knobs",
      markers: true,
      series: [
        { label: "SM clock", unit: "MHz", get: (t) => t.device.sm_clock_mhz, stroke: C.clock, width: 2, scale: "MHz" },
        { label: "clock lock", unit: "MHz", get: (t) => t.knobs.sm_clock_lock_mhz?.[1], stroke: C.lock, dash: [4, 3], scale: "MHz", paths: stepped },
        { label: "batch cap", unit: "seqs", get: (t) => t.knobs.max_num_seqs, stroke: C.seqs, width: 2, scale: "seqs", paths: stepped },
        // Drawn as a labelled strip along the top (quantStripPlugin), not as a line.
        {
          label: "quantization", get: (t) => quantIndex(t.knobs.quant_level), stroke: C.quant,
          scale: "quant", paths: () => null, text: (v) => (v === null ? "—" : QUANT_ORDER[v]),
        },
      ],
      // Headroom above the lines for the quantization strip.
      scales: {
        MHz: { range: (u, min, max) => [0, Math.max(max ?? 0, 100) * 1.3] },
        seqs: { range: (u, min, max) => [0, Math.max(max ?? 0, 1) * 1.3] },
        quant: { range: () => [0, 1] },
      },
      axes: [
        { scale: "MHz", label: "MHz" },
        { scale: "seqs", label: "batch cap", side: 1, grid: { show: false } },
      ],
    },
  ];

  function logScale() {
    return {
      distr: 3,
      log: 10,
      range: (u, min, max) =>
        min === null || max === null ? [1, 10000] : uPlot.rangeLog(Math.max(min, 0.01), max, 10, true),
    };
  }

  function seriesText(s, v) {
    if (s.text) return s.text(v);
    if (finite(v) === null) return "—";
    return `${fmt(v, s.digits ?? 0)}${s.unit ? " " + s.unit : ""}`;
  }

  function makeChart(spec) {
    const el = $(`chart-${spec.id}`);
    const series = [{ value: (u, v) => (v === null ? "—" : hms(v)) }].concat(
      spec.series.map((s) => ({
        label: s.label,
        scale: s.scale ?? spec.axes[0].scale,
        stroke: s.stroke,
        width: s.width ?? 1.5,
        dash: s.dash,
        spanGaps: s.spanGaps ?? false,
        paths: s.paths,
        points: { show: s.points ? (u, si, i0, i1) => i1 - i0 < 150 : false, size: 4 },
        value: (u, v) => seriesText(s, v),
      })),
    );
    const axes = [
      {
        space: 50,
        values: (u, splits) => splits.map((v) => (v === null ? "" : hms(v))),
      },
    ].concat(
      spec.axes.map((a) => ({
        size: 56,
        labelSize: 16,
        labelFont: "12px sans-serif",
        font: "11px sans-serif",
        ...a,
      })),
    );
    const opts = {
      width: Math.max(el.clientWidth, 300),
      height: CHART_HEIGHT_PX,
      series,
      axes,
      scales: { x: { time: true, range: () => [nowS - WINDOW_S, nowS] }, ...spec.scales },
      cursor: { sync: { key: "wattserve" }, drag: { x: false, y: false } },
      legend: { live: true },
      plugins: spec.markers ? [quantStripPlugin(spec), markersPlugin()] : [],
    };
    const u = new uPlot(opts, emptyData(spec), el);
    new ResizeObserver(() => u.setSize({ width: Math.max(el.clientWidth, 300), height: CHART_HEIGHT_PX })).observe(el);
    return u;
  }

  function emptyData(spec) {
    return [[]].concat(spec.series.map(() => []));
  }

  function chartData(spec) {
    const t = data.telemetry;
    return [t.map((s) => s.time_unix_s)].concat(
      spec.series.map((s) => t.map((snap) => finite(s.get(snap) ?? null))),
    );
  }

  // The quantization level in force, as runs of labelled bands along the top of the plot.
  function quantStripPlugin(spec) {
    const index = spec.series.findIndex((s) => s.scale === "quant") + 1;
    return {
      hooks: {
        draw: [
          (u) => {
            const xs = u.data[0];
            const levels = u.data[index];
            const ctx = u.ctx;
            const dpr = window.devicePixelRatio || 1;
            const { left, top, width } = u.bbox;
            const h = 16 * dpr;
            ctx.save();
            ctx.beginPath();
            ctx.rect(left, top, width, h);
            ctx.clip();
            ctx.font = `${11 * dpr}px sans-serif`;
            ctx.textBaseline = "middle";
            let i = 0;
            while (i < xs.length) {
              let j = i;
              while (j + 1 < xs.length && levels[j + 1] === levels[i]) j++;
              if (levels[i] !== null) {
                const x0 = u.valToPos(xs[i], "x", true);
                const x1 = u.valToPos(j + 1 < xs.length ? xs[j + 1] : xs[j], "x", true);
                ctx.fillStyle = QUANT_COLORS[levels[i] % QUANT_COLORS.length];
                ctx.fillRect(x0, top, Math.max(x1 - x0, dpr), h);
                const label = QUANT_ORDER[levels[i]];
                if (x1 - x0 > ctx.measureText(label).width + 8 * dpr) {
                  ctx.fillStyle = "#1f2328";
                  ctx.fillText(label, x0 + 4 * dpr, top + h / 2);
                }
              }
              i = j + 1;
            }
            ctx.restore();
          },
        ],
      },
    };
  }

  // Vertical marks for decisions and policy changes; hovering one shows its message.
  function markersPlugin() {
    let marks = []; // {x: css px in the plot area, event}
    let hovered = false;
    const tip = $("marker-tip");
    return {
      hooks: {
        init: [
          (u) => {
            u.over.addEventListener("mouseenter", () => (hovered = true));
            u.over.addEventListener("mouseleave", () => {
              hovered = false;
              tip.hidden = true;
            });
          },
        ],
        draw: [
          (u) => {
            const ctx = u.ctx;
            const dpr = window.devicePixelRatio || 1;
            const { top, height } = u.bbox;
            marks = [];
            ctx.save();
            for (const e of data.events) {
              const color = MARK_COLORS[e.kind];
              const t = e.time_unix_s;
              if (!color || t < u.scales.x.min || t > u.scales.x.max) continue;
              const x = Math.round(u.valToPos(t, "x", true));
              ctx.strokeStyle = color;
              ctx.globalAlpha = 0.55;
              ctx.lineWidth = dpr;
              ctx.setLineDash([3 * dpr, 3 * dpr]);
              ctx.beginPath();
              ctx.moveTo(x, top);
              ctx.lineTo(x, top + height);
              ctx.stroke();
              ctx.globalAlpha = 1;
              ctx.fillStyle = color;
              ctx.beginPath();
              ctx.moveTo(x, top + height - 7 * dpr);
              ctx.lineTo(x - 5 * dpr, top + height);
              ctx.lineTo(x + 5 * dpr, top + height);
              ctx.closePath();
              ctx.fill();
              marks.push({ x: u.valToPos(t, "x"), event: e });
            }
            ctx.restore();
          },
        ],
        setCursor: [
          (u) => {
            const left = u.cursor.left;
            if (!hovered || left === null || left < 0) {
              tip.hidden = true;
              return;
            }
            let best = null;
            for (const m of marks) {
              const d = Math.abs(m.x - left);
              if (d <= MARKER_HOVER_PX && (best === null || d < best.d)) best = { d, m };
            }
            if (best === null) {
              tip.hidden = true;
              return;
            }
            const e = best.m.event;
            tip.textContent = `${hms(e.time_unix_s)}  ${e.message}`;
            const box = u.over.getBoundingClientRect();
            tip.hidden = false;
            const x = box.left + best.m.x;
            tip.style.left = `${Math.min(x + 10, window.innerWidth - tip.offsetWidth - 8)}px`;
            tip.style.top = `${box.top + 8}px`;
          },
        ],
      },
    };
  }

  // ---- rendering ---------------------------------------------------------------------------

  let renderQueued = false;
  function scheduleRender() {
    if (renderQueued) return;
    renderQueued = true;
    requestAnimationFrame(() => {
      renderQueued = false;
      render();
    });
  }

  function render() {
    const latest = data.telemetry[data.telemetry.length - 1] ?? null;
    for (const spec of SPECS) {
      const u = charts[spec.id];
      u.setData(chartData(spec));
      const now = $(`now-${spec.id}`);
      if (latest && now) {
        now.textContent = spec.series
          .filter((s) => !spec.markers || s.label !== "clock lock")
          .map((s) => `${s.label} ${seriesText(s, finite(s.get(latest) ?? null))}`)
          .join(" · ");
      }
    }
    renderHeader(latest);
    renderEvents();
  }

  function renderHeader(latest) {
    const st = data.status;
    $("h-model").textContent = st?.model ?? (st ? `— (${st.phase})` : "—");
    const dev = st?.device?.capabilities;
    $("h-device").textContent = dev
      ? `${dev.is_virtual ? "virtual" : "real"} · ${dev.name.replace(/\s*\(virtual\)$/, "")} · ` +
        (dev.mode === "control" ? "controlling" : "observe-only")
      : "not open yet";
    $("h-policy").textContent = policyText(latest?.policy ?? st?.policy);
    const fleet = st?.server?.fleet;
    $("h-fleet-fact").hidden = !fleet?.enabled;
    if (fleet?.enabled) $("h-fleet").textContent = fleetText(fleet);
    let finished = 0;
    let met = 0;
    for (const t of data.telemetry) {
      const n = t.serving.requests_finished ?? 0;
      const ratio = finite(t.latency.slo_attainment_ratio);
      if (n > 0 && ratio !== null) {
        finished += n;
        met += ratio * n;
      }
    }
    $("h-slo").textContent =
      finished > 0 ? `${fmt((100 * met) / finished, 1)} % of ${fmt(finished)} requests` : "no requests finished";
    $("h-energy").textContent = energyText(data.energyJ);
    if (streamLive && latest?.phase && latest.phase !== "ready") setConn("wait", `live · ${latest.phase}`);
    else if (streamLive) setConn("ok", "live");
    if (latest && !formDirty) fillForm(latest.policy);
  }

  function renderEvents() {
    const list = $("events");
    const shown = data.events.slice(-EVENTS_SHOWN).reverse();
    list.replaceChildren(
      ...shown.map((e) => {
        const li = document.createElement("li");
        const time = document.createElement("time");
        time.textContent = hms(e.time_unix_s);
        const kind = document.createElement("span");
        kind.className = `kind kind-${e.kind}`;
        kind.textContent = e.kind.replace("_", " ");
        const msg = document.createElement("span");
        msg.className = "msg";
        // The badge says the kind: "decision: ..." need not say it twice.
        msg.textContent = e.message.startsWith(`${e.kind}: `) ? e.message.slice(e.kind.length + 2) : e.message;
        li.append(time, kind, msg);
        return li;
      }),
    );
  }

  function setConn(kind, text) {
    const el = $("conn");
    el.className = `conn conn-${kind}`;
    el.textContent = text;
  }

  // ---- the stream -------------------------------------------------------------------------

  function trim() {
    const from = nowS - WINDOW_S - 2;
    let i = 0;
    while (i < data.telemetry.length && data.telemetry[i].time_unix_s < from) i++;
    if (i > 0) data.telemetry.splice(0, i);
    let j = 0;
    while (j < data.events.length - EVENTS_SHOWN && data.events[j].time_unix_s < from) j++;
    if (j > 0) data.events.splice(0, j);
  }

  function countEnergy(t) {
    const counter = finite(t.device.energy_j);
    if (counter === null) return;
    if (data.energyJ === null) data.energyJ = 0;
    else if (data.lastCounterJ !== null && counter > data.lastCounterJ) data.energyJ += counter - data.lastCounterJ;
    data.lastCounterJ = counter;
  }

  function onBacklog(b) {
    streamLive = true;
    data.telemetry = b.telemetry;
    data.events = b.events;
    data.energyJ = finite(b.energy_since_start_j);
    const last = b.telemetry[b.telemetry.length - 1];
    data.lastCounterJ = last ? finite(last.device.energy_j) : null;
    if (last) nowS = last.time_unix_s;
    trim();
    scheduleRender();
  }

  function onTelemetry(t) {
    data.telemetry.push(t);
    countEnergy(t);
    nowS = t.time_unix_s;
    trim();
    scheduleRender();
  }

  function onEvent(e) {
    data.events.push(e);
    scheduleRender();
  }

  function connect() {
    const source = new EventSource("/v1/events/stream");
    setConn("wait", "connecting…");
    source.addEventListener("backlog", (m) => onBacklog(JSON.parse(m.data)));
    source.addEventListener("telemetry", (m) => onTelemetry(JSON.parse(m.data)));
    source.addEventListener("event", (m) => onEvent(JSON.parse(m.data)));
    source.addEventListener("end", (m) => {
      streamLive = false;
      source.close();
      const why = JSON.parse(m.data).reason;
      setConn("off", `stream ended (daemon ${why}); retrying`);
      setTimeout(connect, RECONNECT_AFTER_END_MS);
    });
    source.addEventListener("error", () => {
      streamLive = false;
      if (source.readyState === EventSource.CLOSED) {
        setConn("off", "disconnected; retrying");
        setTimeout(connect, RECONNECT_AFTER_END_MS);
      } else {
        setConn("wait", "reconnecting…");
      }
    });
  }

  async function refreshStatus() {
    try {
      const r = await fetch("/v1/status", { cache: "no-store" });
      if (r.ok) {
        data.status = await r.json();
        data.statusAtS = Date.now() / 1000;
        const enabled = data.status.server?.control_enabled;
        if (data.status.server?.policy_over_mqtt) {
          $("f-token-note").textContent =
            "wattserve attach takes policy changes over MQTT (policy/set), not from this page.";
        } else if (enabled === false) {
          $("f-token-note").textContent =
            "The daemon has no API token configured, so its control API is off.";
        }
        scheduleRender();
      }
    } catch (err) {
      // The stream's own state says the daemon is away; nothing to add here.
    }
    const fleetOn = data.status?.server?.fleet?.enabled === true;
    setTimeout(refreshStatus, fleetOn ? FLEET_STATUS_REFRESH_MS : STATUS_REFRESH_MS);
  }

  // ---- the policy form ----------------------------------------------------------------------

  function fillForm(policy) {
    if (!policy) return;
    $("f-budget").value = policy.power_budget_w;
    $("f-ttft").value = policy.ttft_slo_ms;
    $("f-tpot").value = policy.tpot_slo_ms;
    $("f-mode").value = policy.mode;
  }

  function showResult(kind, text) {
    const el = $("f-result");
    el.className = `result result-${kind}`;
    el.textContent = text;
  }

  function setToken(value) {
    token = value;
    $("f-forget").disabled = token === null;
    $("f-token").placeholder = token === null ? "paste the bearer token" : "token held in memory";
  }

  function numberField(id) {
    const text = $(id).value.trim();
    return text === "" ? null : Number(text);
  }

  async function applyPolicy(ev) {
    ev.preventDefault();
    const pasted = $("f-token").value.trim();
    if (pasted) {
      setToken(pasted);
      $("f-token").value = "";
    }
    if (token === null) {
      showResult("error", "Paste the API token first (server.api_token or WATTSERVE_API_TOKEN).");
      return;
    }
    const body = {
      power_budget_w: numberField("f-budget"),
      ttft_slo_ms: numberField("f-ttft"),
      tpot_slo_ms: numberField("f-tpot"),
      mode: $("f-mode").value,
    };
    showResult("wait", "applying…");
    let r;
    try {
      r = await fetch("/v1/control/policy", {
        method: "PUT",
        headers: { Authorization: `Bearer ${token}`, "Content-Type": "application/json" },
        body: JSON.stringify(body),
        cache: "no-store",
        credentials: "omit",
      });
    } catch (err) {
      showResult("error", `request failed: ${err.message}`);
      return;
    }
    let answer = null;
    try {
      answer = await r.json();
    } catch (err) {
      answer = null;
    }
    if (r.ok) {
      formDirty = false;
      fillForm(answer);
      showResult("ok", `Applied: ${policyText(answer)}`);
      return;
    }
    const error = answer?.error;
    const message = error?.message ?? r.statusText;
    showResult("error", `${r.status}: ${message}${error?.code ? ` (${error.code})` : ""}`);
    if (r.status === 401 || r.status === 403) setToken(null);
  }

  function setUpForm() {
    const form = $("policy-form");
    form.addEventListener("submit", applyPolicy);
    for (const id of ["f-budget", "f-ttft", "f-tpot", "f-mode"]) {
      $(id).addEventListener("input", () => (formDirty = true));
    }
    $("f-forget").addEventListener("click", () => {
      setToken(null);
      showResult("ok", "Token forgotten.");
    });
    $("f-reset").addEventListener("click", () => {
      formDirty = false;
      const latest = data.telemetry[data.telemetry.length - 1];
      fillForm(latest?.policy ?? data.status?.policy);
      showResult("ok", "");
    });
  }

  // ---- start ----------------------------------------------------------------------------------

  for (const spec of SPECS) charts[spec.id] = makeChart(spec);
  setUpForm();
  refreshStatus(); // and again after each answer
  connect();
})();

// AdaSpark dashboard: polls /dashboard/data and draws each chart as SVG, with no library and
// nothing fetched from anywhere but this server. A keyed server: the key is asked for once (or
// given as /dashboard#key=KEY, a fragment never sent to the server), kept in sessionStorage and
// sent as "Authorization: Bearer KEY". Each chart's figure gets data-marks = the data points
// drawn, which the browser test reads.
"use strict";
(() => {
  const NS = "http://www.w3.org/2000/svg";
  const KEY = "adaspark-api-key";
  const POLL_MS = 2000;
  const W = 440, H = 240, M = { l: 52, r: 14, t: 12, b: 36 };
  let timer = null;
  const COLORS = ["#2f6fdb", "#e0533d", "#2a9d6f", "#d9a21b", "#8e5cc7", "#1aa3b8", "#c2417f",
                  "#6b7a1f", "#555f6e", "#f08a24"];

  function el(tag, attrs, parent, text) {
    const node = document.createElementNS(NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    if (parent) parent.appendChild(node);
    return node;
  }

  function ticks(lo, hi, count) {
    if (!(hi > lo)) return [lo];
    const raw = (hi - lo) / count;
    const step0 = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 5, 10].map((m) => m * step0).find((s) => s >= raw) || raw;
    const out = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(v);
    return out;
  }

  function fmt(v) {
    if (Math.abs(v) >= 1000) return (v / 1000).toFixed(1) + "k";
    if (Number.isInteger(v)) return String(v);
    return Math.abs(v) < 1 ? v.toFixed(2) : v.toFixed(1);
  }

  // A fresh SVG in the figure, with axes for the domains; returns the scales.
  function frame(fig, xs, ys, opt) {
    const o = Object.assign({ width: W, xfmt: fmt, yfmt: fmt, xticks: 5, right: M.r }, opt || {});
    const R = o.right;
    fig.querySelectorAll("svg").forEach((s) => s.remove());
    const svg = el("svg", { viewBox: `0 0 ${o.width} ${H}`, role: "img" }, fig);
    const [x0, x1] = xs[0] === xs[1] ? [xs[0] - 1, xs[1] + 1] : xs;
    const [y0, y1] = ys[0] === ys[1] ? [ys[0], ys[0] + 1] : ys;
    const x = (v) => M.l + ((v - x0) / (x1 - x0)) * (o.width - M.l - R);
    const y = (v) => H - M.b - ((v - y0) / (y1 - y0)) * (H - M.t - M.b);
    for (const t of ticks(y0, y1, 4)) {
      el("line", { class: "grid", x1: M.l, x2: o.width - R, y1: y(t), y2: y(t) }, svg);
      el("text", { x: M.l - 6, y: y(t) + 4, "text-anchor": "end" }, svg, o.yfmt(t));
    }
    if (!o.noXTicks) {
      for (const t of ticks(x0, x1, o.xticks)) {
        el("text", { x: x(t), y: H - M.b + 15, "text-anchor": "middle" }, svg, o.xfmt(t));
      }
    }
    el("line", { class: "axis", x1: M.l, x2: o.width - R, y1: H - M.b, y2: H - M.b }, svg);
    el("line", { class: "axis", x1: M.l, x2: M.l, y1: M.t, y2: H - M.b }, svg);
    if (o.xlabel) el("text", { x: (M.l + o.width - R) / 2, y: H - 4, "text-anchor": "middle" },
                     svg, o.xlabel);
    if (o.ylabel) el("text", { x: 12, y: (M.t + H - M.b) / 2, "text-anchor": "middle",
                               transform: `rotate(-90 12 ${(M.t + H - M.b) / 2})` }, svg, o.ylabel);
    return { svg, x, y };
  }

  function empty(fig, message) {
    fig.querySelectorAll("svg").forEach((s) => s.remove());
    const svg = el("svg", { viewBox: `0 0 ${W} 80` }, fig);
    el("text", { class: "empty", x: W / 2, y: 44, "text-anchor": "middle" }, svg, message);
    fig.dataset.marks = "0";
  }

  function done(fig, marks) { fig.dataset.marks = String(marks); }

  function extent(values) { return [Math.min(...values), Math.max(...values)]; }

  function decodeRate(fig, history) {
    const pts = history.filter((h) => h.decode_tok_s > 0);
    if (!pts.length) return empty(fig, "no request decoded yet");
    const t0 = pts[0].t;
    const since = new Date(t0 * 1000).toTimeString().slice(0, 8);
    const { svg, x, y } = frame(fig, extent(pts.map((p) => p.t - t0)),
                                [0, Math.max(...pts.map((p) => p.decode_tok_s)) * 1.1],
                                { xlabel: `seconds since ${since}`, ylabel: "tok/s" });
    el("polyline", { class: "trend",
                     points: pts.map((p) => `${x(p.t - t0)},${y(p.decode_tok_s)}`).join(" ") },
       svg);
    for (const p of pts) {
      el("circle", { class: "mark", cx: x(p.t - t0), cy: y(p.decode_tok_s), r: 3.5,
                     fill: COLORS[0] }, svg)
        .appendChild(el("title", {}, null,
                        `${p.decode_tok_s.toFixed(1)} tok/s, ${p.decode_tokens} tokens, ` +
                        `${p.mean_width.toFixed(2)} rows per round`));
    }
    done(fig, pts.length);
  }

  // Vertical bars: items [{label, value, color, note}].
  function bars(fig, items, opt) {
    if (!items.length) return empty(fig, opt.empty);
    const top = Math.max(...items.map((i) => i.value)) * 1.15 || 1;
    const { svg, x, y } = frame(fig, [0, items.length], [0, top],
                                { noXTicks: true, yfmt: opt.yfmt || fmt, ylabel: opt.ylabel,
                                  xlabel: opt.xlabel });
    const slot = x(1) - x(0);
    items.forEach((item, i) => {
      const h = y(0) - y(item.value);
      el("rect", { class: "mark", x: x(i) + slot * 0.15, y: y(item.value), width: slot * 0.7,
                   height: Math.max(h, 1), fill: item.color || COLORS[0] }, svg)
        .appendChild(el("title", {}, null, item.note || String(item.value)));
      el("text", { x: x(i) + slot / 2, y: H - M.b + 15, "text-anchor": "middle" }, svg,
         item.label);
      el("text", { x: x(i) + slot / 2, y: y(item.value) - 4, "text-anchor": "middle" }, svg,
         (opt.vfmt || fmt)(item.value));
    });
    done(fig, items.length);
  }

  function pct(v) { return (100 * v).toFixed(v < 0.1 ? 1 : 0) + "%"; }

  function widthShare(fig, snap) {
    bars(fig, snap.width_share.map((w) => ({
      label: String(w.rows), value: w.share, note: `${w.rounds} rounds of ${w.rows} rows`,
    })), { empty: "no rounds yet", yfmt: pct, vfmt: pct, xlabel: "rows verified" });
  }

  function costCurve(fig, snap) {
    const cost = snap.cost;
    const series = [{ name: "1 row (plain)", law: cost.plain }]
      .concat(cost.classes.map((k) => ({ name: `${k.top} rows`, law: k })))
      .filter((s) => s.law.bands.length);
    if (!series.length) return empty(fig, "no verify measured yet");
    const samples = series.flatMap((s) => s.law.bands.flatMap((b) => b.samples));
    const curves = series.flatMap((s) => s.law.curve);
    const all = samples.concat(curves);
    const { svg, x, y } = frame(fig, extent(all.map((p) => p[0])),
                                [0, Math.max(...all.map((p) => p[1])) * 1.1],
                                { width: 2 * W, right: 150, xlabel: "context (tokens)",
                                  ylabel: "verify ms" });
    let marks = 0;
    series.forEach((s, i) => {
      const color = COLORS[i % COLORS.length];
      for (const b of s.law.bands) {
        for (const [c, ms] of b.samples) {
          el("circle", { class: "mark", cx: x(c), cy: y(ms), r: 2.5, fill: color,
                         "fill-opacity": 0.55 }, svg);
          marks += 1;
        }
      }
      if (s.law.curve.length > 1) {
        el("polyline", { class: "law mark", stroke: color,
                         points: s.law.curve.map(([c, ms]) => `${x(c)},${y(ms)}`).join(" ") }, svg);
        marks += 1;
      }
      el("rect", { x: 2 * W - 140, y: M.t + 14 * i, width: 10, height: 10, fill: color }, svg);
      el("text", { x: 2 * W - 126, y: M.t + 9 + 14 * i }, svg,
         `${s.name}${s.law.fitted ? "" : " (measuring)"}`);
    });
    done(fig, marks);
  }

  function calibration(fig, snap) {
    const bins = snap.acceptance.calibration.filter((b) => b.count > 0);
    if (!bins.length) return empty(fig, "no acceptance labels yet");
    const { svg, x, y } = frame(fig, [0, 1], [0, 1],
                                { xlabel: "predicted q", ylabel: "realised", yfmt: fmt });
    el("line", { class: "ideal", x1: x(0), y1: y(0), x2: x(1), y2: y(1) }, svg);
    const most = Math.max(...bins.map((b) => b.count));
    for (const b of bins) {
      el("circle", { class: "mark", cx: x(b.predicted), cy: y(b.realised),
                     r: 3 + 9 * Math.sqrt(b.count / most), fill: COLORS[1], "fill-opacity": 0.6 },
         svg).appendChild(el("title", {}, null,
                             `q ${b.lo.toFixed(1)}-${b.hi.toFixed(1)}: ${b.count} labels, ` +
                             `predicted ${b.predicted.toFixed(3)}, realised ${b.realised.toFixed(3)}`));
    }
    done(fig, bins.length);
  }

  function acceptedSource(fig, served) {
    const a = served.accepted;
    const total = a.drafter + a.ngram + a.both;
    if (!total) return empty(fig, "no drafted token accepted yet");
    bars(fig, [["drafter", a.drafter, COLORS[0]], ["n-gram", a.ngram, COLORS[2]],
               ["both", a.both, COLORS[3]]].map(([label, n, color]) => ({
      label, value: n / total, color, note: `${n} of ${total} accepted tokens`,
    })), { empty: "", yfmt: pct, vfmt: pct });
  }

  function bandRate(fig, snap) {
    bars(fig, snap.chooser.bands.filter((b) => b.rate_tok_s !== null).map((b) => ({
      label: `${b.contexts[0]}-${b.contexts[1]}`, value: b.rate_tok_s,
      note: `${b.rounds} rounds`,
    })), { empty: "no band has 8 rounds yet", xlabel: "context band (tokens)", ylabel: "tok/s" });
  }

  function gateRate(fig, snap) {
    const items = [];
    for (const b of snap.gate.buckets) {
      for (const [mode, color] of [["drafted", COLORS[0]], ["undrafted", COLORS[2]]]) {
        if (b[mode].rate_tok_s !== null) {
          items.push({ label: `${b.bucket}:${mode === "drafted" ? "d" : "n"}`, color,
                       value: b[mode].rate_tok_s, note: `bucket ${b.bucket}, ${mode}, ` +
                       `${b[mode].rounds} rounds${b.faster === mode ? " (faster)" : ""}` });
        }
      }
    }
    const msg = snap.gate.enabled ? "no bucket has 8 rounds of a mode yet" : "the gate is off";
    bars(fig, items, { empty: msg, xlabel: "bucket: d drafted, n not", ylabel: "tok/s" });
  }

  function summary(doc) {
    const box = document.getElementById("summary");
    const s = doc.served;
    const rate = s.decode_seconds > 0 ? (s.decode_tokens / s.decode_seconds).toFixed(1) : "-";
    const cells = [["requests", s.requests], ["decode tok/s", rate],
                   ["completion tokens", s.completion_tokens]]
      .concat(Object.entries(s.rounds).map(([k, n]) => [`${k} rounds`, n]));
    box.replaceChildren(...cells.map(([name, value]) => {
      const div = document.createElement("div");
      const b = document.createElement("b");
      b.textContent = String(value);
      div.append(b, name);
      return div;
    }));
  }

  function draw(doc) {
    document.getElementById("model").textContent = `${doc.model} · arm ${doc.arm || "…"}`;
    summary(doc);
    const fig = (id) => document.getElementById(id);
    decodeRate(fig("decode-rate"), doc.history);
    acceptedSource(fig("accepted-source"), doc.served);
    const snap = doc.scheduler;
    const ids = ["width-share", "cost-curve", "calibration", "band-rate", "gate-rate"];
    if (!snap) {
      const why = doc.ready ? "this arm has no speculative scheduler" : "the model is loading";
      ids.forEach((id) => empty(fig(id), why));
      return;
    }
    widthShare(fig("width-share"), snap);
    costCurve(fig("cost-curve"), snap);
    calibration(fig("calibration"), snap);
    bandRate(fig("band-rate"), snap);
    gateRate(fig("gate-rate"), snap);
  }

  function status(text, error) {
    const p = document.getElementById("status");
    p.textContent = text;
    p.className = error ? "error" : "";
  }

  async function poll() {
    clearTimeout(timer);
    const key = sessionStorage.getItem(KEY);
    try {
      const res = await fetch("/dashboard/data", {
        cache: "no-store", headers: key ? { Authorization: `Bearer ${key}` } : {},
      });
      if (res.status === 401) {
        if (key) sessionStorage.removeItem(KEY);
        document.getElementById("key-form").hidden = false;
        status(key ? "that key was refused" : "this server needs its API key", true);
        return; // polling resumes when a key is given
      }
      if (!res.ok) throw new Error(`HTTP ${res.status}`);
      document.getElementById("key-form").hidden = true;
      const doc = await res.json();
      draw(doc);
      const at = doc.snapshot_at ? new Date(doc.snapshot_at * 1000).toTimeString().slice(0, 8)
                                 : "-";
      status(`learned state as of ${at}; refreshed every ${POLL_MS / 1000} s`);
    } catch (err) {
      status(`cannot reach the server: ${err.message}`, true);
    }
    clearTimeout(timer);
    timer = setTimeout(poll, POLL_MS);
  }

  function start() {
    const m = /(?:^#|&)key=([^&]+)/.exec(location.hash);
    if (m) {
      sessionStorage.setItem(KEY, decodeURIComponent(m[1]));
      history.replaceState(null, "", location.pathname); // the key leaves the address bar
    }
    document.getElementById("key-form").addEventListener("submit", (event) => {
      event.preventDefault();
      const input = document.getElementById("key-input");
      if (input.value) sessionStorage.setItem(KEY, input.value);
      input.value = "";
      poll();
    });
    poll();
  }

  document.addEventListener("DOMContentLoaded", start);
})();

// The request's phases as an SVG: one mark per recorded phase and prefill chunk, the decode
// steps where other requests' prefill shared the pass, and the KV hand-off when disaggregated.
// Times are seconds since the request arrived (the receipt's timeline summary).

const NS = "http://www.w3.org/2000/svg";
const W = 880, LEFT = 96, RIGHT = 16, LANE = 26, GAP = 10, TOP = 24;

export const ms = (s) => (s == null ? "–" : s >= 1 ? `${s.toFixed(2)} s` : `${(s * 1000).toFixed(1)} ms`);

function el(name, attrs = {}, text) {
  const node = document.createElementNS(NS, name);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text != null) node.textContent = text;
  return node;
}

function niceStep(span) {
  const raw = span / 6;
  const mag = 10 ** Math.floor(Math.log10(raw));
  return [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw);
}

// The marks the timeline draws, as data: tests and the legend read the same list.
export function timelineMarks(t) {
  const marks = [];
  if (t.queue_time != null) marks.push({ kind: "queue", lane: "Queue", start: 0, end: t.queue_time, label: `queued ${ms(t.queue_time)}` });
  for (const c of t.prefill_chunks || []) {
    marks.push({ kind: "prefill-chunk", lane: "Prefill", start: c.start, end: c.end,
      label: `prefill chunk at step ${c.step}: ${c.tokens} tokens, ${ms(c.end - c.start)}` });
  }
  if (t.kv_transfer) {
    marks.push({ kind: "kv-transfer", lane: "KV transfer", start: t.kv_transfer.start, end: t.kv_transfer.end,
      label: `KV transfer ${(t.kv_transfer.bytes / 1024).toFixed(0)} KiB, ${ms(t.kv_transfer.end - t.kv_transfer.start)}` });
  }
  if (t.ttft != null) {
    const end = t.ttft + (t.decode_time || 0);
    marks.push({ kind: "decode", lane: "Decode", start: t.ttft, end,
      label: `decode: ${t.num_output_tokens} tokens, ${ms(t.decode_time)}, TPOT ${ms(t.tpot)}` });
    const times = [t.ttft];
    for (const gap of t.itl || []) times.push(times[times.length - 1] + gap);
    for (const i of t.interfered_steps || []) {
      marks.push({ kind: "interference", lane: "Decode", start: times[i], end: times[i + 1],
        label: `decode step ${i + 1} shared its pass with prefill work: ${ms(times[i + 1] - times[i])}` });
    }
    marks.tokens = times;
  }
  return marks;
}

export function timelineSvg(t) {
  const marks = timelineMarks(t);
  const lanes = ["Queue", "Prefill", ...(t.kv_transfer ? ["KV transfer"] : []), "Decode"];
  const end = Math.max(t.e2e || 0, ...marks.map((m) => m.end || 0), 1e-6);
  const x = (s) => LEFT + (s / end) * (W - LEFT - RIGHT);
  const laneY = (lane) => TOP + lanes.indexOf(lane) * (LANE + GAP);
  const height = TOP + lanes.length * (LANE + GAP) + 30;
  const svg = el("svg", { viewBox: `0 0 ${W} ${height}`, class: "timeline", role: "img",
    "aria-label": `Phase timeline: ${marks.map((m) => m.label).join("; ")}` });

  for (const lane of lanes) {
    const y = laneY(lane);
    svg.append(el("rect", { x: LEFT, y, width: W - LEFT - RIGHT, height: LANE, class: "lane" }));
    svg.append(el("text", { x: LEFT - 10, y: y + LANE / 2 + 4, class: "lane-label", "text-anchor": "end" }, lane));
  }
  const step = niceStep(end);
  const axisY = TOP + lanes.length * (LANE + GAP) + 2;
  for (let s = 0; s <= end + 1e-9; s += step) {
    svg.append(el("line", { x1: x(s), x2: x(s), y1: TOP - 4, y2: axisY, class: "grid" }));
    svg.append(el("text", { x: x(s), y: axisY + 14, class: "axis", "text-anchor": "middle" }, s ? ms(s) : "0"));
  }
  for (const m of marks) {
    const y = laneY(m.lane);
    const inset = m.kind === "interference" ? 3 : 5;
    const rect = el("rect", { x: x(m.start), y: y + inset, width: Math.max(2, x(m.end) - x(m.start)),
      height: LANE - 2 * inset, rx: 3, class: `mark ${m.kind}`, "data-mark": m.kind });
    rect.append(el("title", {}, m.label));
    svg.append(rect);
  }
  // Token arrivals: ticks, not marks (a long answer has hundreds).
  for (const at of marks.tokens || []) {
    const y = laneY("Decode");
    svg.append(el("line", { x1: x(at), x2: x(at), y1: y + 2, y2: y + LANE - 2, class: "tick" }));
  }
  if (t.ttft != null) {
    svg.append(el("line", { x1: x(t.ttft), x2: x(t.ttft), y1: TOP - 4, y2: axisY, class: "ttft" }));
    // The label sits on the side of the line with room for it.
    const late = x(t.ttft) > W * 0.7;
    svg.append(el("text", { x: x(t.ttft) + (late ? -4 : 4), y: TOP - 8, class: "ttft-label",
      "text-anchor": late ? "end" : "start" }, `first token ${ms(t.ttft)}`));
  }
  return svg;
}

// The review console: sign in, find answers, open one, check it, replay it, export it.

import { api, ApiError, session } from "./api.js";
import { sideBySide } from "./diff.js";
import { badge, h, pairs, section, short } from "./dom.js";
import { ms, timelineMarks, timelineSvg } from "./timeline.js";
import { checkInclusion } from "./verify.js";

const $ = (id) => document.getElementById(id);
let nextCursor = null;
let lastQuery = null;
// Each new search outdates the pages still in flight: a slow answer to an earlier query (the
// unfiltered one the console runs on sign-in) must not land in a later query's results.
let searchGeneration = 0;

function notice(message) {
  const box = $("notice");
  box.textContent = message || "";
  box.hidden = !message;
}

function failure(error) {
  if (error instanceof ApiError && error.status === 401) { signOut(error.message); return; }
  notice(error.message || String(error));
}

// ---- sign-in -------------------------------------------------------------------------------

async function signIn(key) {
  const err = $("signin-error");
  err.hidden = true;
  try {
    const root = await api.root(key);
    session.key = key;
    showConsole(root);
  } catch (error) {
    err.textContent = error.message;
    err.hidden = false;
    $("key").focus();
  }
}

function showConsole(root) {
  notice("");
  $("signin").hidden = true;
  $("console").hidden = false;
  $("session").hidden = false;
  $("session-label").textContent = `Signed in · audit log of ${root.tree_size} leaves`;
  search();
  const wanted = receiptInHash();
  if (wanted) openReceipt(wanted);
  else $("f-source").focus();
}

// #receipt=<id> links to one answer (the console keeps it current as answers are opened).
const receiptInHash = () => new URLSearchParams(location.hash.slice(1)).get("receipt");

function signOut(message) {
  session.key = null;
  $("console").hidden = true;
  $("session").hidden = true;
  $("signin").hidden = false;
  $("detail").replaceChildren(h("div", { class: "empty muted" }, "Search, then choose an answer to review it."));
  $("results").replaceChildren();
  const err = $("signin-error");
  err.textContent = message || "";
  err.hidden = !message;
  $("key").value = "";
  $("key").focus();
}

// ---- search --------------------------------------------------------------------------------

function queryFromForm() {
  const form = new FormData($("search-form"));
  const params = new URLSearchParams({ order: "desc", limit: "25" });
  for (const [name, value] of form) {
    const v = String(value).trim();
    if (!v) continue;
    // datetime-local is the reviewer's local time; the API wants an absolute instant.
    params.set(name, name === "since" || name === "until" ? new Date(v).toISOString() : v);
  }
  return params;
}

async function search(more = false) {
  if (!more) { lastQuery = queryFromForm(); nextCursor = null; $("results").replaceChildren(); }
  const generation = more ? searchGeneration : ++searchGeneration;
  const params = new URLSearchParams(lastQuery);
  if (more && nextCursor) params.set("cursor", nextCursor);
  $("results-summary").textContent = "Searching…";
  try {
    const page = await api.receipts(params);
    if (generation !== searchGeneration) return;
    notice("");
    nextCursor = page.next_cursor;
    for (const r of page.data) $("results").append(resultItem(r));
    const count = $("results").children.length;
    $("results-summary").textContent = count
      ? `${count} answer${count === 1 ? "" : "s"}${nextCursor ? ", more available" : ""}`
      : "No answers match.";
    $("more").hidden = !nextCursor;
  } catch (error) {
    if (generation !== searchGeneration) return;
    $("results-summary").textContent = "";
    failure(error);
  }
}

function resultItem(r) {
  return h("li", {},
    h("button", { type: "button", class: "result", "data-receipt": r.id, onclick: () => openReceipt(r.id) },
      h("span", { class: "result-head" }, badge(r.status), h("time", { datetime: r.created_at }, localTime(r.created_at))),
      h("span", { class: "result-question" }, r.question || "(no question)"),
      h("span", { class: "result-meta muted" }, r.sources.length ? r.sources.join(", ") : "no sources cited"),
      h("code", { class: "result-id" }, r.id)));
}

const localTime = (iso) => new Date(iso).toLocaleString(undefined, { dateStyle: "medium", timeStyle: "medium" });

// ---- one receipt ---------------------------------------------------------------------------

async function openReceipt(id) {
  const detail = $("detail");
  detail.replaceChildren(h("p", { class: "muted" }, `Loading ${id}…`));
  for (const b of document.querySelectorAll(".result[aria-current]")) b.removeAttribute("aria-current");
  document.querySelector(`.result[data-receipt="${CSS.escape(id)}"]`)?.setAttribute("aria-current", "true");
  let receipt;
  try {
    receipt = await api.receipt(id);
  } catch (error) {
    detail.replaceChildren(h("div", { class: "error-box", role: "alert" }, error.message));
    if (error.status === 401) failure(error);
    return;
  }
  notice("");
  history.replaceState(null, "", `#receipt=${encodeURIComponent(id)}`);
  detail.replaceChildren(...renderReceipt(receipt));
  detail.focus();
  loadContext(receipt);
}

function renderReceipt(r) {
  const b = r.body;
  const chunks = b["inherent.retrieval.chunks"] || [];
  const question = (b["inherent.request.messages"] || []).filter((m) => m.role === "user").at(-1)?.content;
  const header = h("header", { class: "detail-head" },
    h("div", {},
      h("h2", {}, "Answer ", h("code", {}, r.id)),
      h("p", { class: "muted" }, badge(r.status), " ", localTime(r.created_at),
        b["inherent.retrieval.snapshot_epoch"] != null ? ` · snapshot epoch ${b["inherent.retrieval.snapshot_epoch"]}` : "")),
    h("div", { class: "actions" },
      h("button", { type: "button", class: "primary", id: "check", onclick: () => runCheck(r) }, "Check inclusion proof"),
      h("button", { type: "button", id: "replay", onclick: () => runReplay(r) }, "Run replay"),
      h("button", { type: "button", id: "export", disabled: true }, "Download incident bundle")));

  const qa = section("qa", "Question and answer",
    h("p", { class: "label" }, "Question"), h("blockquote", { class: "question" }, question || "–"),
    h("p", { class: "label" }, "Answer"), h("div", { class: "answer" }, b["inherent.output.text"] || "(empty)"),
    b["error.type"] ? h("p", { class: "error" }, `${b["error.type"]}: ${b["error.message"]}`) : null,
    h("p", { class: "label" }, "Citations"),
    chunks.length
      ? h("div", { class: "table-wrap" }, h("table", { class: "citations" },
        h("thead", {}, h("tr", {}, ["#", "Source", "Version", "Chunk hash", "Score"].map((c) => h("th", { scope: "col" }, c)))),
        h("tbody", {}, chunks.map((c) => h("tr", {},
          h("td", {}, `[${c.rank}]`), h("td", {}, c.title ? [c.title, h("br"), h("code", {}, c.source_id)] : h("code", {}, c.source_id)),
          h("td", {}, `v${c.version}`), h("td", {}, short(c.chunk_hash, 16)), h("td", {}, c.score.toFixed(3)))))))
      : h("p", { class: "muted" }, b["inherent.retrieval.enabled"] ? "Retrieval found nothing to cite." : "Retrieval was off for this request."));

  const sampling = b["inherent.request.sampling"] || {};
  const engine = b["inherent.engine"] || {};
  const model = section("model", "Model and settings",
    h("div", { class: "columns" },
      h("div", {}, h("p", { class: "label" }, "Model"), pairs([
        ["model", b["gen_ai.request.model"]], ["weights BLAKE3", short(b["inherent.model.weights_hash"], 24)],
        ["prompt template", b["inherent.prompt.template"]], ["prompt tokens", b["gen_ai.usage.input_tokens"]],
        ["output tokens", b["gen_ai.usage.output_tokens"]], ["finish", (b["gen_ai.response.finish_reasons"] || []).join(", ") || "–"]])),
      h("div", {}, h("p", { class: "label" }, "Sampling"), pairs(Object.entries(sampling).map(([k, v]) => [k, setting(v)]))),
      h("div", {}, h("p", { class: "label" }, "Engine numerics"), pairs(Object.entries(engine).map(([k, v]) => [k, setting(v)])))));

  const prompt = section("prompt", "The exact prompt", h("p", { class: "muted", id: "prompt-status" }, "Rebuilding the prompt from the pinned chunk versions…"),
    h("pre", { class: "prompt", id: "prompt-text", tabindex: "0", "aria-label": "The prompt the model saw" }));

  return [header, qa, renderTimeline(b["inherent.timeline"] || {}, r.diagnosis), prompt, model,
    section("integrity", "Inclusion proof", h("div", { id: "check-result", "aria-live": "polite" },
      h("p", { class: "muted" }, "Recompute the receipt's audit leaf and walk its Merkle path to the current root, in this browser (BLAKE3)."))),
    section("replay-panel", "Replay and drift", h("div", { id: "replay-result", "aria-live": "polite" },
      h("p", { class: "muted" }, "Run the receipt again with its pinned context, model and sampling; see what changed in its sources since.")))];
}

const setting = (v) => (typeof v === "string" ? v : JSON.stringify(v));

function renderTimeline(t, diagnosis) {
  if (t.ttft == null) return section("timeline", "Phase timeline", h("p", { class: "muted" }, "No token was produced: nothing to draw."));
  const marks = timelineMarks(t);
  const phases = diagnosis?.totals || {};
  const whole = Object.values(phases).reduce((a, v) => a + v, 0);
  const share = (p) => (whole ? `${Math.round((phases[p] / whole) * 100)}%` : "–");
  const ttftCause = diagnosis?.ttft?.cause, tpotCause = diagnosis?.tpot?.cause;
  return section("timeline", "Phase timeline",
    h("div", { class: "stats" },
      stat("TTFT", ms(t.ttft)), stat("TPOT", ms(t.tpot)), stat("End to end", ms(t.e2e)),
      stat("Prefill chunks", (t.prefill_chunks || []).length), stat("Interfered steps", `${t.interference_steps ?? 0} of ${t.decode_steps ?? 0}`),
      t.kv_transfer ? stat("KV transfer", ms(t.kv_transfer_time)) : null),
    h("figure", { class: "figure" }, timelineSvg(t),
      h("figcaption", { class: "legend" },
        ["queue", "prefill-chunk", "kv-transfer", "decode", "interference"].filter((k) => marks.some((m) => m.kind === k))
          .map((k) => h("span", { class: `key ${k}` }, k.replace("-", " "))))),
    diagnosis ? h("p", { class: "diagnosis", id: "diagnosis" },
      h("strong", {}, `Latency owned by ${diagnosis.dominant}`), ` (${share(diagnosis.dominant)} of the request's time). `,
      `Time to first token: ${ttftCause === "queue" ? "mostly waiting in the queue" : "mostly prompt compute (prefill)"}`,
      tpotCause ? `; per-token time: ${tpotCause === "interference" ? "slowed by other requests' prefill sharing the step" : "decode speed"}.` : ".")
      : null);
}

const stat = (label, value) => h("div", { class: "stat" }, h("span", { class: "stat-label" }, label), h("span", { class: "stat-value" }, value));

async function loadContext(r) {
  try {
    const ctx = await api.context(r.id);
    const pre = $("prompt-text");
    if (!pre) return;
    const parts = [];
    let at = 0;
    for (const c of ctx.chunks.filter((c) => c.prompt_span).sort((a, b) => a.prompt_span[0] - b.prompt_span[0])) {
      parts.push(ctx.prompt_text.slice(at, c.prompt_span[0]));
      parts.push(h("mark", { class: "chunk", "data-chunk": c.chunk_id,
        title: `${c.source_id} v${c.version} · chunk ${c.chunk_hash.slice(0, 12)}…` },
      h("span", { class: "chunk-tag" }, `${c.source_id} v${c.version}`), ctx.prompt_text.slice(...c.prompt_span)));
      at = c.prompt_span[1];
    }
    parts.push(ctx.prompt_text.slice(at));
    pre.replaceChildren(...parts);
    $("prompt-status").replaceChildren(ctx.prompt_verified
      ? h("span", {}, badge("verified", "ok"), ` Rebuilt from ${ctx.chunks.length} pinned chunk${ctx.chunks.length === 1 ? "" : "s"}; it hashes to the receipt's prompt hash. Retrieved chunks are highlighted.`)
      : h("span", {}, badge("not verified", "failed"), " ", ctx.problems.join("; ")));
  } catch (error) {
    $("prompt-status")?.replaceChildren(h("span", { class: "error" }, error.message));
  }
}

// ---- inclusion check -----------------------------------------------------------------------

async function runCheck(r) {
  const out = $("check-result");
  out.replaceChildren(h("p", { class: "muted" }, "Checking…"));
  try {
    // The log grows while we look: fetch the root and the proof until both describe one tree.
    let receipt, root;
    for (let attempt = 0; attempt < 4; attempt++) {
      root = await api.root();
      receipt = await api.receipt(r.id);
      if (!receipt.inclusion_proof || receipt.inclusion_proof.tree_size === root.tree_size) break;
    }
    const result = checkInclusion(receipt, root);
    out.replaceChildren(
      h("p", { class: `verdict ${result.ok ? "ok" : "failed"}`, id: "check-verdict" },
        result.ok ? "✓ Included: this receipt is in the audit log, unchanged." : "✗ Check failed: this receipt does not match the audit log."),
      h("ol", { class: "steps" }, result.steps.map((s) => h("li", { class: s.ok ? "ok" : "failed" },
        h("span", { class: "step-mark", "aria-hidden": "true" }, s.ok ? "✓" : "✗"),
        h("span", {}, h("strong", {}, s.label), h("span", { class: "sr-only" }, s.ok ? " (passed)" : " (failed)"), h("br"), h("span", { class: "muted" }, s.detail))))),
      h("p", { class: "muted" }, `Computed in this browser with BLAKE3 (vendored @noble/hashes). Compare the root with one published earlier (inherent audit root).`));
  } catch (error) {
    out.replaceChildren(h("p", { class: "error", role: "alert" }, error.message));
  }
}

// ---- replay, drift and export --------------------------------------------------------------

async function runReplay(r) {
  const out = $("replay-result");
  const button = $("replay");
  button.disabled = true;
  out.replaceChildren(h("p", { class: "muted" }, "Replaying… (the model runs the request again)"));
  try {
    const bundleText = await api.incident(r.id);
    const bundle = JSON.parse(bundleText);
    out.replaceChildren(...renderReplay(bundle.replay, r.body).filter(Boolean));
    const exportButton = $("export");
    exportButton.disabled = false;
    exportButton.onclick = () => download(`incident-${r.id}.json`, bundleText);
  } catch (error) {
    out.replaceChildren(h("p", { class: "error", role: "alert" }, error.message));
  } finally {
    button.disabled = false;
  }
}

function download(name, text) {
  const url = URL.createObjectURL(new Blob([text], { type: "application/json" }));
  const a = h("a", { href: url, download: name, hidden: true });
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 1000);
}

const VERDICTS = {
  identical: ["ok", "bit for bit: a batch-invariant receipt replayed with the same numerics"],
  tokens_match: ["ok", "the same tokens; no claim that the logits' bits agree"],
  diverged: ["failed", "the replay produced different tokens"],
};

function firstDifference(a, b) {
  let i = 0;
  while (i < a.length && i < b.length && a[i] === b[i]) i++;
  return i;
}

function markedText(text, from) {
  return h("div", { class: "answer" }, text.slice(0, from), from < text.length ? h("mark", { class: "divergent" }, text.slice(from)) : null);
}

function renderReplay(rep, body) {
  const [tone, meaning] = VERDICTS[rep.verdict] || ["failed", "the context could not be verified, so nothing was replayed"];
  const original = body["inherent.output.text"] || "";
  const replayed = rep.replayed_output ?? "";
  const from = firstDifference(original, replayed);
  const nodes = [
    h("p", { class: `verdict ${tone}`, id: "replay-verdict" }, h("span", { class: "verdict-word" }, rep.verdict ?? "not replayed"), ` — ${meaning}`),
    pairs([["context verified", rep.context_verified ? "yes" : "no"], ["bitwise claim", rep.bitwise_claim ? "yes" : "no"],
      ["token agreement", rep.token_agreement == null ? "–" : `${(rep.token_agreement * 100).toFixed(1)}%`],
      ["first divergent token", rep.first_divergent_token ?? "none"]]),
    rep.problems.length ? h("ul", { class: "problems" }, rep.problems.map((p) => h("li", {}, p))) : null,
  ];
  if (rep.replayed_output != null) {
    nodes.push(h("div", { class: "side-by-side", id: "replay-texts" },
      h("div", {}, h("p", { class: "label" }, "Original answer"), markedText(original, rep.verdict === "diverged" ? from : original.length)),
      h("div", {}, h("p", { class: "label" }, "Replayed answer"), markedText(replayed, rep.verdict === "diverged" ? from : replayed.length))));
  }
  nodes.push(renderDrift(rep.drift || {}));
  return nodes;
}

function renderDrift(d) {
  if (!d.retrieval_enabled) return h("p", { class: "muted" }, "Retrieval was off: no sources to drift.");
  return h("div", { class: "drift", id: "drift" },
    h("h4", {}, "Drift since the answer"),
    h("p", {}, `Snapshot epoch ${d.snapshot_epoch} → current epoch ${d.current_epoch}: `,
      d.retrieval_unchanged ? badge("retrieval unchanged", "ok") : badge("retrieval differs now", "warn")),
    h("ul", { class: "sources" }, d.sources.map((s) => h("li", { "data-source": s.source_id, "data-status": s.status },
      h("div", {}, h("code", {}, `${s.source_id} v${s.cited_version}`), " ", badge(s.status, driftTone(s.status)),
        s.latest_version && s.latest_version !== s.cited_version ? h("span", { class: "muted" }, ` latest v${s.latest_version}`) : null),
      (s.chunk_diffs || []).map((c) => diffTable(c))))),
    h("p", { class: "label" }, "What retrieval returns now"),
    d.retrieved_now.length
      ? h("ol", { class: "now" }, d.retrieved_now.map((c) => h("li", {}, `${c.title || c.source_id} `, h("code", {}, `${c.source_id} v${c.version}`), h("span", { class: "muted" }, ` score ${c.score.toFixed(3)}`))))
      : h("p", { class: "muted" }, "Nothing above the score threshold."));
}

const driftTone = (status) => ({ unchanged: "ok", changed: "warn" })[status] || "failed";

function diffTable(c) {
  return h("div", { class: "table-wrap" }, h("table", { class: "diff", "data-chunk": c.chunk_id },
    h("thead", {}, h("tr", {}, h("th", { scope: "col" }, "Cited version"), h("th", { scope: "col" }, "Current version"))),
    h("tbody", {}, sideBySide(c.diff).map((row) => h("tr", { class: row.kind },
      h("td", { class: row.left == null ? "blank" : row.kind === "same" || row.kind === "hunk" ? "" : "removed" }, row.left ?? ""),
      h("td", { class: row.right == null ? "blank" : row.kind === "same" || row.kind === "hunk" ? "" : "added" }, row.right ?? ""))))));
}

// ---- wiring --------------------------------------------------------------------------------

$("signin-form").addEventListener("submit", (e) => { e.preventDefault(); signIn($("key").value.trim()); });
$("sign-out").addEventListener("click", () => signOut());
$("search-form").addEventListener("submit", (e) => { e.preventDefault(); search(); });
$("search-form").addEventListener("reset", () => setTimeout(() => search(), 0));
$("more").addEventListener("click", () => search(true));
window.addEventListener("hashchange", () => {
  const wanted = receiptInHash();
  if (wanted && !$("console").hidden) openReceipt(wanted);
});

if (session.key) {
  // A reload keeps the tab's key; a key the server now refuses is dropped, a server that is down
  // is only reported (the key still works once it is back).
  const key = session.key;
  api.root(key).then(showConsole, (error) => {
    signOut(error.message);
    if (error.status === 0) session.key = key;
  });
} else {
  $("key").focus();
}

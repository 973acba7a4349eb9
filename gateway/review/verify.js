// The receipt's inclusion proof, checked here with BLAKE3 rather than taken from the server:
// RFC 6962 leaf hash H(0x00 || leaf data), node hash H(0x01 || left || right), and the audit path
// walked as RFC 9162 section 2.1.3.2 says. The hashed bytes are the ones the API returns.

import { blake3 } from "./vendor/noble-hashes/blake3.js";

const utf8 = new TextEncoder();

export const hex = (bytes) => Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");

function unhex(text) {
  if (!/^([0-9a-f]{2})*$/i.test(text)) throw new Error(`not hex: ${text.slice(0, 16)}…`);
  return Uint8Array.from(text.match(/../g) || [], (pair) => parseInt(pair, 16));
}

function prefixed(prefix, ...parts) {
  const out = new Uint8Array(1 + parts.reduce((n, p) => n + p.length, 0));
  out[0] = prefix;
  let at = 1;
  for (const part of parts) { out.set(part, at); at += part.length; }
  return blake3(out);
}

export const leafHash = (data, prefix = 0x00) => prefixed(prefix, data);
export const nodeHash = (left, right, prefix = 0x01) => prefixed(prefix, left, right);

// The root an audit path leads to from a leaf hash, or null when the path does not fit the tree.
export function rootFromPath(index, size, leaf, path, nodePrefix = 0x01) {
  if (!(index >= 0 && index < size)) return null;
  let fn = index, sn = size - 1, r = leaf;
  for (const p of path) {
    if (sn === 0) return null;
    if (fn & 1 || fn === sn) {
      r = nodeHash(p, r, nodePrefix);
      if (!(fn & 1)) while (fn && !(fn & 1)) { fn >>= 1; sn >>= 1; }
    } else {
      r = nodeHash(r, p, nodePrefix);
    }
    fn >>= 1; sn >>= 1;
  }
  return sn === 0 ? r : null;
}

function sameJson(a, b) {
  if (a === b) return true;
  if (typeof a !== "object" || typeof b !== "object" || a === null || b === null) return false;
  if (Array.isArray(a) !== Array.isArray(b)) return false;
  const ka = Object.keys(a), kb = Object.keys(b);
  return ka.length === kb.length && ka.every((k) => Object.hasOwn(b, k) && sameJson(a[k], b[k]));
}

// Each step: {label, ok, detail}. `receipt` is GET /v1/receipts/{id}, `root` GET /v1/audit/root
// for the same tree size.
export function checkInclusion(receipt, root) {
  const steps = [];
  const step = (label, ok, detail) => { steps.push({ label, ok, detail }); return ok; };
  const proof = receipt.inclusion_proof;
  if (!step("The receipt is in the audit log", !!proof, proof ? `leaf ${proof.leaf_index} of ${proof.tree_size}` : "the log holds no leaf for it")) {
    return { ok: false, steps };
  }
  const leafPrefix = parseInt(root.leaf_prefix ?? "00", 16);
  const nodePrefix = parseInt(root.node_prefix ?? "01", 16);
  let body, leaf;
  try {
    body = JSON.parse(receipt.body_canonical);
    leaf = JSON.parse(receipt.leaf_data);
  } catch (error) {
    step("The hashed bytes parse", false, String(error));
    return { ok: false, steps };
  }
  step("The body shown is the body hashed", sameJson(body, receipt.body),
    "the canonical body the hash covers equals the receipt displayed");
  const bodyHash = hex(blake3(utf8.encode(receipt.body_canonical)));
  step("The audit leaf commits to this body", leaf.payload?.body_hash === bodyHash,
    `BLAKE3(body) = ${bodyHash.slice(0, 16)}…, leaf says ${(leaf.payload?.body_hash || "nothing").slice(0, 16)}…`);
  step("The leaf names this receipt", leaf.kind === "receipt" && leaf.ref === receipt.id
    && leaf.payload?.status === receipt.status, `${leaf.kind} ${leaf.ref}, status ${leaf.payload?.status}`);
  const computedLeaf = leafHash(utf8.encode(receipt.leaf_data), leafPrefix);
  const logged = proof.leaf_hash;
  step("The leaf hash is the one logged", hex(computedLeaf) === logged,
    hex(computedLeaf) === logged
      ? `${logged.slice(0, 16)}…`
      : `recomputed ${hex(computedLeaf).slice(0, 16)}…, logged ${String(logged).slice(0, 16)}…: the receipt row was edited after it was logged`);
  let computedRoot = null;
  try {
    computedRoot = rootFromPath(proof.leaf_index, proof.tree_size, computedLeaf,
      proof.audit_path.map(unhex), nodePrefix);
  } catch (error) {
    step("The audit path is well formed", false, String(error));
  }
  const rootOk = computedRoot !== null && root.tree_size === proof.tree_size && hex(computedRoot) === root.root;
  step("The audit path leads to the current root", rootOk,
    `${proof.audit_path.length} hashes → ${computedRoot ? hex(computedRoot).slice(0, 16) + "…" : "no root"}; `
    + `published root of ${root.tree_size} leaves ${root.root.slice(0, 16)}…`);
  return { ok: steps.every((s) => s.ok), steps, root: root.root, size: root.tree_size };
}

// Calls to this server's API with the audit key; every failure becomes one readable message.

const KEY = "inherent.review.key";

export const session = {
  get key() { return sessionStorage.getItem(KEY); },
  set key(value) {
    if (value) sessionStorage.setItem(KEY, value);
    else sessionStorage.removeItem(KEY);
  },
};

export class ApiError extends Error {
  constructor(message, status, code) {
    super(message);
    this.status = status; // 0: the server could not be reached
    this.code = code;
  }
}

function explain(status, error, path) {
  const message = error?.message || `HTTP ${status}`;
  if (status === 401) return "This key was not accepted: it is mistyped, revoked or unknown to this server.";
  if (status === 403) return "This key lacks the audit scope. Create one with: inherent keys create --tenant T --scope audit";
  if (status === 404 && path.startsWith("/v1/receipts/")) {
    return "No such receipt for this tenant. Check the id (receipts of other tenants are not shown).";
  }
  return message;
}

async function request(method, path, { key = session.key, raw = false } = {}) {
  let response;
  try {
    response = await fetch(path, {
      method,
      headers: { Authorization: `Bearer ${key}`, Accept: "application/json" },
      cache: "no-store",
    });
  } catch {
    throw new ApiError("The Inherent server cannot be reached. Is it running (inherent serve)? Retry once it is back.", 0);
  }
  const text = await response.text();
  if (!response.ok) {
    let error = null;
    try { error = JSON.parse(text).error; } catch { /* not our error body: a proxy or a crash */ }
    if (response.status >= 500 && !error) {
      throw new ApiError(`The server failed (HTTP ${response.status}). Retry, or check its log.`, response.status);
    }
    throw new ApiError(explain(response.status, error, path), response.status, error?.code);
  }
  return raw ? text : JSON.parse(text);
}

export const api = {
  root: (key) => request("GET", "/v1/audit/root", { key }),
  receipts: (params) => request("GET", `/v1/receipts?${params}`),
  receipt: (id) => request("GET", `/v1/receipts/${encodeURIComponent(id)}`),
  context: (id) => request("GET", `/v1/receipts/${encodeURIComponent(id)}/context`),
  // The bundle's exact bytes: it is saved as returned, so its checksum still holds.
  incident: (id) => request("POST", `/v1/receipts/${encodeURIComponent(id)}/incident`, { raw: true }),
};

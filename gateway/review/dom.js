// Building DOM from data without innerHTML: receipts hold user and model text.

export function h(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v == null || v === false) continue;
    if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else if (k === "class") node.className = v;
    else node.setAttribute(k, v === true ? "" : v);
  }
  for (const child of children.flat(Infinity)) {
    if (child == null || child === false) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

export const badge = (text, tone = text) => h("span", { class: `badge ${tone}` }, text);

export function section(id, title, ...children) {
  return h("section", { class: "panel", id, "aria-labelledby": `${id}-title` },
    h("h3", { id: `${id}-title` }, title), ...children);
}

export function pairs(entries) {
  return h("dl", { class: "pairs" },
    entries.filter(([, v]) => v !== undefined).map(([k, v]) => [h("dt", {}, k), h("dd", {}, v ?? "–")]));
}

export const short = (hash, n = 12) => (hash ? h("code", { title: hash, class: "hash" }, `${hash.slice(0, n)}…`) : "–");

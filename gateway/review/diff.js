// A unified diff (the drift report's) as side-by-side rows: [{left, right, kind}], where kind is
// "same", "changed", "removed" or "added". Removed and added runs of a hunk pair up line by line.

export function sideBySide(unified) {
  const rows = [];
  let removed = [], added = [];
  const flush = () => {
    for (let i = 0; i < Math.max(removed.length, added.length); i++) {
      const left = removed[i] ?? null, right = added[i] ?? null;
      rows.push({ left, right, kind: left == null ? "added" : right == null ? "removed" : "changed" });
    }
    removed = []; added = [];
  };
  for (const line of unified.split("\n")) {
    if (line.startsWith("---") || line.startsWith("+++")) continue;
    if (line.startsWith("@@")) { flush(); rows.push({ left: line, right: line, kind: "hunk" }); continue; }
    if (line.startsWith("-")) removed.push(line.slice(1));
    else if (line.startsWith("+")) added.push(line.slice(1));
    else if (line.startsWith(" ")) { flush(); rows.push({ left: line.slice(1), right: line.slice(1), kind: "same" }); }
  }
  flush();
  return rows;
}

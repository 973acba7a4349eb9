"""Jupyter notebooks (.ipynb, nbformat 4 JSON): markdown cells as they are, code cells as fenced
blocks in the notebook's language; outputs are dropped (they are results, often huge, and
rarely what a question is about)."""

from __future__ import annotations

import json

from ingest.loaders.base import Extracted, Rejected
from ingest.loaders.text import decode, markdown_title


def load_ipynb(data: bytes) -> Extracted:
    text, _ = decode(data)
    try:
        notebook = json.loads(text)
    except json.JSONDecodeError as error:
        raise Rejected(f"corrupt notebook: invalid JSON ({error.msg})") from error
    if not isinstance(notebook, dict) or not isinstance(notebook.get("cells"), list):
        raise Rejected("corrupt notebook: no list of cells (nbformat 4 expected)")
    metadata = notebook.get("metadata") if isinstance(notebook.get("metadata"), dict) else {}
    language = (metadata.get("language_info") or {}).get("name") or (
        metadata.get("kernelspec") or {}
    ).get("language", "")
    blocks: list[str] = []
    for cell in notebook["cells"]:
        if not isinstance(cell, dict):
            continue
        source = cell.get("source", "")
        source = "".join(source) if isinstance(source, list) else str(source)
        if not source.strip():
            continue
        if cell.get("cell_type") == "markdown":
            blocks.append(source)
        elif cell.get("cell_type") == "code":
            blocks.append(f"```{language}\n{source.strip(chr(10))}\n```")
    body = "\n\n".join(blocks)
    title = str(metadata.get("title") or "") or markdown_title(body)
    return Extracted(body, title)

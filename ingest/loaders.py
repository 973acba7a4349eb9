"""Loaders: files and folders in, ``Document``s out, one ``LoadFailure`` per bad source.

Supported: plain text (.txt), Markdown (.md), HTML (.html, .htm; boilerplate dropped), JSON
lines (.jsonl: one ``{"id", "text", "metadata"}`` source per line) and PDF (.pdf). A folder is
walked recursively in sorted order, skipping hidden entries. A source's id is given (JSON
lines) or derived from its path: relative to the folder for a folder, the file name for a
single file, with an optional prefix. Bad input (unreadable, corrupt, unsupported type, too
large, not UTF-8, empty) becomes a ``LoadFailure`` with a reason; nothing here raises for it.
"""

from __future__ import annotations

import io
import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ingest.chunking import normalize_text
from provenance.settings import Settings

DEFAULT_MAX_FILE_BYTES: int = Settings.model_fields["max_file_bytes"].default

KINDS = {
    ".txt": "text",
    ".text": "text",
    ".md": "markdown",
    ".markdown": "markdown",
    ".html": "html",
    ".htm": "html",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".pdf": "pdf",
}

BOILERPLATE_TAGS = "script,style,noscript,template,nav,header,footer,aside,form,iframe,svg"
BLOCK_TAGS = (
    "p,div,section,article,main,h1,h2,h3,h4,h5,h6,li,ul,ol,dl,dt,dd,table,tr,blockquote,"
    "pre,figure,figcaption,hr,address,details,summary"
)
# Private-use characters mark breaks while HTML whitespace is collapsed.
_PARAGRAPH_MARK = "\ue000"
_LINE_MARK = "\ue001"


@dataclass(frozen=True, slots=True)
class Document:
    """One source's extracted text (normalized later, by the pipeline) and where it came from."""

    source_id: str
    text: str
    uri: str
    kind: str
    title: str = ""
    metadata: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class LoadFailure:
    source_id: str
    uri: str
    reason: str


@dataclass(slots=True)
class LoadResult:
    documents: list[Document] = field(default_factory=list)
    failures: list[LoadFailure] = field(default_factory=list)

    def extend(self, other: LoadResult) -> None:
        self.documents.extend(other.documents)
        self.failures.extend(other.failures)


class _Rejected(Exception):
    """A source-level problem; becomes a LoadFailure with this message as the reason."""


def load_paths(
    paths: Sequence[str | Path], *, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES, prefix: str = ""
) -> LoadResult:
    """Load every file and folder given, in the order given."""
    result = LoadResult()
    for path in paths:
        result.extend(load_path(path, max_file_bytes=max_file_bytes, prefix=prefix))
    return result


def load_path(
    path: str | Path,
    *,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    prefix: str = "",
    source_id: str | None = None,
) -> LoadResult:
    """A folder (walked recursively, sorted) or a single file. ``source_id`` names a single
    file's source explicitly; otherwise ids derive from paths, after ``prefix``."""
    path = Path(path)
    if path.is_dir():
        result = LoadResult()
        for file, relative in _walk(path):
            result.extend(
                load_file(file, prefix + relative, max_file_bytes=max_file_bytes, id_prefix=prefix)
            )
        return result
    return load_file(
        path, source_id or prefix + path.name, max_file_bytes=max_file_bytes, id_prefix=prefix
    )


def _walk(root: Path) -> list[tuple[Path, str]]:
    """(file, path relative to root) for every non-hidden file, sorted by the relative path."""
    found = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if not d.startswith(".")]
        base = Path(directory)
        found += [
            (base / f, (base / f).relative_to(root).as_posix())
            for f in files
            if not f.startswith(".")
        ]
    return sorted(found, key=lambda pair: pair[1])


def load_file(
    path: Path,
    source_id: str,
    *,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    id_prefix: str = "",
) -> LoadResult:
    """One file: one document, or for JSON lines one per line (their own ids, after
    ``id_prefix``); failures instead of exceptions."""
    uri = path.resolve().as_uri()
    kind = KINDS.get(path.suffix.lower())
    try:
        if kind is None:
            raise _Rejected(f"unsupported file type {path.suffix or '(no extension)'!r}")
        data = _read(path, max_file_bytes)
        if kind == "jsonl":
            return _load_jsonl(data, source_id, uri, id_prefix)
        title, text = _extract(kind, data)
        return _checked(Document(source_id, text, uri, kind, title))
    except _Rejected as problem:
        return LoadResult(failures=[LoadFailure(source_id, uri, str(problem))])


def _read(path: Path, max_file_bytes: int) -> bytes:
    try:
        size = path.stat().st_size
        if size > max_file_bytes:
            raise _Rejected(f"file is {size} bytes, over the {max_file_bytes}-byte limit")
        return path.read_bytes()
    except OSError as error:
        raise _Rejected(f"cannot read file: {error.strerror or error}") from error


def _extract(kind: str, data: bytes) -> tuple[str, str]:
    """(title, text) of one file's bytes."""
    if kind == "pdf":
        return pdf_to_text(data)
    text = decode_text(data)
    if kind == "html":
        return html_to_text(text)
    if kind == "markdown":
        return markdown_title(text), text
    return "", text


def _checked(document: Document) -> LoadResult:
    if not normalize_text(document.text):
        return LoadResult(
            failures=[LoadFailure(document.source_id, document.uri, "empty document")]
        )
    return LoadResult(documents=[document])


def decode_text(data: bytes) -> str:
    """UTF-8 (a BOM is dropped), or UTF-16 when a BOM says so; anything else is rejected."""
    encoding = "utf-16" if data.startswith((b"\xff\xfe", b"\xfe\xff")) else "utf-8-sig"
    try:
        text = data.decode(encoding)
    except UnicodeDecodeError as error:
        raise _Rejected(
            f"not valid {encoding.removesuffix('-sig').upper()} text (byte {error.start})"
        ) from error
    if "\x00" in text:
        raise _Rejected("contains NUL characters: binary data, not text")
    return text


def markdown_title(text: str) -> str:
    for line in text.splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return ""


def html_to_text(html: str) -> tuple[str, str]:
    """Visible text of an HTML page: boilerplate elements dropped, one paragraph per block
    element, ``<br>`` and ``<pre>`` line breaks kept, other whitespace collapsed as a browser
    would."""
    from selectolax.lexbor import LexborHTMLParser

    tree = LexborHTMLParser(html.replace(_PARAGRAPH_MARK, " ").replace(_LINE_MARK, " "))
    title_node = tree.css_first("title")
    title = " ".join(title_node.text().split()) if title_node is not None else ""
    root = tree.body or tree.root
    if root is None:
        return title, ""
    for node in root.css(BOILERPLATE_TAGS):
        node.decompose()
    for node in root.css("pre"):
        node.replace_with(node.text().replace("\n", _LINE_MARK))
    for node in root.css("br"):
        node.replace_with(_LINE_MARK)
    for node in root.css(BLOCK_TAGS):
        node.insert_before(_PARAGRAPH_MARK)
        node.insert_after(_PARAGRAPH_MARK)
    text = " ".join(root.text(separator="").split())
    text = text.replace(_LINE_MARK, "\n").replace(_PARAGRAPH_MARK, "\n\n")
    return title, text


def pdf_to_text(data: bytes) -> tuple[str, str]:
    """(title, text) of a PDF, pages separated by blank lines; corrupt or locked PDFs are rejected."""
    from pypdf import PdfReader
    from pypdf.errors import PdfReadError

    # pypdf logs every recoverable oddity; the result (or rejection) is what matters here.
    logging.getLogger("pypdf").setLevel(logging.ERROR)
    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted and not reader.decrypt(""):
            raise _Rejected("PDF is encrypted")
        pages = [page.extract_text() or "" for page in reader.pages]
        title = str((reader.metadata or {}).get("/Title") or "")
    except _Rejected:
        raise
    except (
        PdfReadError,
        ValueError,
        KeyError,
        TypeError,
        AttributeError,
        IndexError,
        OSError,
    ) as error:
        raise _Rejected(f"corrupt PDF: {error}") from error
    return title.strip(), "\n\n".join(pages)


def _load_jsonl(data: bytes, file_source_id: str, uri: str, id_prefix: str) -> LoadResult:
    """One source per line: ``{"id": str, "text": str, "metadata": {...}}``. A line without an
    id is named ``<file id>#<line number>``."""
    result = LoadResult()
    try:
        text = decode_text(data)
    except _Rejected as problem:
        return LoadResult(failures=[LoadFailure(file_source_id, uri, str(problem))])
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        fallback_id = f"{file_source_id}#{number}"
        line_uri = f"{uri}#L{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            result.failures.append(
                LoadFailure(fallback_id, line_uri, f"line {number}: invalid JSON ({error.msg})")
            )
            continue
        if not isinstance(record, dict):
            result.failures.append(
                LoadFailure(fallback_id, line_uri, f"line {number}: not a JSON object")
            )
            continue
        raw_id = record.get("id", fallback_id)
        id_ok = isinstance(raw_id, str | int) and not isinstance(raw_id, bool) and str(raw_id) != ""
        # A line with a usable id fails under that id, so a full cleanup keeps its source.
        source_id = (
            (id_prefix + str(raw_id) if "id" in record else raw_id) if id_ok else fallback_id
        )
        metadata = record.get("metadata") or {}
        body = record.get("text")
        if not id_ok:
            problem = "'id' must be a non-empty string"
        elif not isinstance(body, str):
            problem = "'text' must be a string"
        elif not isinstance(metadata, dict):
            problem = "'metadata' must be an object"
        else:
            problem = ""
        if problem:
            result.failures.append(LoadFailure(source_id, line_uri, f"line {number}: {problem}"))
            continue
        title = str(metadata.get("title", ""))
        result.extend(_checked(Document(source_id, body, line_uri, "jsonl", title, metadata)))
    if not result.documents and not result.failures:
        result.failures.append(LoadFailure(file_source_id, uri, "no records in JSON lines file"))
    return result

"""What every document must be before it leaves the loaders: something the truth store can
hold on any backend. A lone surrogate (from a JSON ``\\ud800`` escape, or a file name that is
not UTF-8) cannot be encoded, hashed or stored; PostgreSQL refuses NUL in text columns. Both
fail the one source here, instead of its whole batch at commit."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ingest.chunking import has_content, normalize_text
from ingest.loaders.base import Document, LoadFailure


def storable_problem(value: str) -> str:
    """Why ``value`` cannot be a key or a text column, or ``""``."""
    if "\x00" in value:
        return "contains a NUL character"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        return f"is not valid Unicode (a lone surrogate at character {error.start})"
    return ""


def clean_title(title: str) -> str:
    """A title on one line, control characters gone and unencodable ones replaced: a title is
    a label, not worth failing a document over."""
    title = " ".join(normalize_text(title).split())
    return title.encode("utf-8", "replace").decode("utf-8")


def check(document: Document) -> Document | LoadFailure:
    """The document with a clean title, or the reason it cannot be stored."""
    if problem := _problem(document):
        return LoadFailure(document.source_id, document.uri, problem)
    title = clean_title(document.title)
    if title == document.title:
        return document
    return Document(
        document.source_id, document.text, document.uri, document.kind, title, document.metadata
    )


def _problem(document: Document) -> str:
    if problem := storable_problem(document.source_id):
        return f"source id {problem}"
    if problem := storable_problem(document.text.replace("\x00", "")):
        return f"text {problem}"  # NUL in text is dropped by normalization
    if problem := _metadata_problem(document.metadata):
        return f"metadata {problem}"
    if not has_content(document.text):
        return "empty document"
    return ""


def _metadata_problem(value: Any) -> str:
    if isinstance(value, str):
        return storable_problem(value.replace("\x00", "")) and "is not valid Unicode"
    if isinstance(value, Mapping):
        return next(
            (p for k, v in value.items() if (p := _metadata_problem(str(k)) or _metadata_problem(v))),
            "",
        )
    if isinstance(value, list | tuple):
        return next((p for v in value if (p := _metadata_problem(v))), "")
    return ""

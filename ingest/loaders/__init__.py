"""Loaders: files and folders in, ``Document``s out; one ``LoadFailure`` per bad source and one
skip per file of a type no loader handles.

Formats (one small module per family, chosen by suffix in ``registry``): plain text, Markdown,
HTML, reStructuredText (``text``); JSON lines (``jsonl``: one source per line); PDF (``pdf``);
Word, PowerPoint, Excel and CSV (``office``); Jupyter notebooks (``notebook``); EPUB
(``ebook``); e-mail and mailboxes (``mail``); compressed files and archives (``archive``: each
member its own source, ``<archive id>/<member>``). Text in any charset (``text.decode``).

A folder is walked recursively in sorted order, skipping hidden entries. A source's id is given
(JSON lines) or derived from its path: relative to the folder for a folder, the file name for a
single file, with an optional prefix. Bad input (unreadable, corrupt, hostile, too large, empty)
becomes a ``LoadFailure`` with a reason; nothing here raises for it.
"""

from ingest.loaders.base import (
    DEFAULT_MAX_FILE_BYTES,
    Document,
    Limits,
    LoadFailure,
    LoadResult,
)
from ingest.loaders.pdf import pdf_to_text
from ingest.loaders.registry import (
    KINDS,
    load_bytes,
    load_file,
    load_path,
    load_paths,
    loader_for,
)
from ingest.loaders.text import decode, html_to_text, markdown_title

__all__ = [
    "DEFAULT_MAX_FILE_BYTES",
    "KINDS",
    "Document",
    "Limits",
    "LoadFailure",
    "LoadResult",
    "decode",
    "html_to_text",
    "load_bytes",
    "load_file",
    "load_path",
    "load_paths",
    "loader_for",
    "markdown_title",
    "pdf_to_text",
]

"""Which loader reads a file (by its name's suffix), and the walk over files and folders.

Every load is isolated: whatever a loader raises (a ``Rejected`` with its reason, or anything
a library throws on hostile input) fails that one file or member, never the job. A file no
loader handles is skipped, not failed. Files without an extension, and the usual names of
project documents (README, changelog.Debian, copyright, ...), are read as text when they are
text and skipped when they are not.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from ingest.loaders import archive, ebook, jsonl, mail, notebook, office, pdf, text
from ingest.loaders.base import (
    Blob,
    Budget,
    Document,
    Extracted,
    Limits,
    LoadFailure,
    LoadResult,
    Rejected,
    Unsupported,
)
from ingest.loaders.validate import check

Loader = Callable[[Blob], LoadResult]


def single(kind: str, extract: Callable[[bytes], Extracted], *, zipped: bool = False) -> Loader:
    """A loader of formats whose file is one document. ``zipped``: the format is a zip (Office,
    EPUB), checked for bombs like any archive before its library inflates it."""

    def load(blob: Blob) -> LoadResult:
        if zipped:
            archive.check_zip(blob)
        found = extract(blob.data)
        return LoadResult(documents=[blob.document(kind, found.text, found.title, found.metadata)])

    return load


LOADERS: dict[str, Loader] = {
    **dict.fromkeys([".txt", ".text"], single("text", text.load_text)),
    **dict.fromkeys([".md", ".markdown"], single("markdown", text.load_markdown)),
    **dict.fromkeys([".html", ".htm", ".xhtml"], single("html", text.load_html)),
    **dict.fromkeys([".rst", ".rest"], single("rst", text.load_rst)),
    **dict.fromkeys([".jsonl", ".ndjson"], jsonl.load_jsonl),
    ".pdf": single("pdf", pdf.load_pdf),
    ".docx": single("docx", office.load_docx, zipped=True),
    ".pptx": single("pptx", office.load_pptx, zipped=True),
    ".xlsx": single("xlsx", office.load_xlsx, zipped=True),
    **dict.fromkeys([".csv", ".tsv"], single("csv", office.load_csv)),
    ".ipynb": single("notebook", notebook.load_ipynb),
    ".epub": single("epub", ebook.load_epub, zipped=True),
    ".eml": single("email", mail.load_eml),
    ".mbox": mail.load_mbox,
    ".zip": lambda blob: archive.load_zip(blob, load_blob),
    **{
        suffix: (lambda s: lambda blob: archive.load_tar(blob, s, load_blob))(suffix)
        for suffix in archive.TARS
    },
    **{
        suffix: (lambda s: lambda blob: archive.load_compressed(blob, s, load_blob))(suffix)
        for suffix in archive.OPENERS
    },
}
# The suffixes a loader handles, for callers that only ask whether a file type is supported.
KINDS = frozenset(LOADERS)

# Project documents named by convention rather than by extension ("README.Debian",
# "changelog", "copyright"): the name up to its first dot, lower-cased.
DOCUMENT_NAMES = frozenset(
    {
        "readme", "changelog", "changes", "news", "copyright", "copying", "license", "licence",
        "authors", "todo", "install", "thanks", "history", "bugs", "credits", "notice",
        "contributing", "contributors", "maintainers", "hacking",
    }
)  # fmt: skip
_read_as_text = single("text", text.load_text)


def loader_for(name: str) -> Loader | None:
    lower = name.lower()
    stem, _, rest = lower.partition(".")
    suffixes = Path(lower).suffixes
    # The two-part suffixes (".tar.gz") first.
    for suffix in ("".join(suffixes[-2:]), *suffixes[-1:]):
        if suffix in LOADERS:
            return LOADERS[suffix]
    if not rest or stem in DOCUMENT_NAMES:
        return _sniffed_text
    return None


def _sniffed_text(blob: Blob) -> LoadResult:
    try:
        return _read_as_text(blob)
    except Rejected as problem:
        raise Unsupported(f"unsupported file type {_suffix(blob.name)!r} ({problem})") from None


def _suffix(name: str) -> str:
    return Path(name).suffix or "(no extension)"


def load_blob(blob: Blob) -> LoadResult:
    """One file's or member's documents, failures and skips; never raises for its content."""
    loader = loader_for(blob.name)
    try:
        if loader is None:
            raise Unsupported(f"unsupported file type {_suffix(blob.name)!r}")
        loaded = loader(blob)
    except archive.Bomb as problem:
        if blob.depth:
            raise  # the top-level file fails, not only the member
        return LoadResult(failures=[LoadFailure(blob.source_id, blob.uri, str(problem))])
    except Unsupported as problem:
        return LoadResult(skipped=[LoadFailure(blob.source_id, blob.uri, str(problem))])
    except Rejected as problem:
        return LoadResult(failures=[LoadFailure(blob.source_id, blob.uri, str(problem))])
    except Exception as error:  # a library choking on hostile input
        reason = f"cannot read {_suffix(blob.name)} file: {type(error).__name__}: {error}"
        return LoadResult(failures=[LoadFailure(blob.source_id, blob.uri, reason[:1000])])
    result = LoadResult(failures=loaded.failures, skipped=loaded.skipped)
    for document in loaded.documents:
        checked = check(document)
        if isinstance(checked, Document):
            result.documents.append(checked)
        else:
            result.failures.append(checked)
    return result


def load_file(
    path: Path,
    source_id: str,
    *,
    limits: Limits = Limits(),
    max_file_bytes: int | None = None,
    id_prefix: str = "",
) -> LoadResult:
    """One file: one document, or one per line, message or archive member; failures and skips
    instead of exceptions. ``max_file_bytes`` overrides the limit of that name."""
    if max_file_bytes is not None:
        limits = replace(limits, max_file_bytes=max_file_bytes)
    uri = path.resolve().as_uri()
    try:
        size = path.stat().st_size
        if size > limits.max_file_bytes:
            return too_big(size, source_id, uri, limits)
        data = path.read_bytes()
    except OSError as error:
        reason = f"cannot read file: {error.strerror or error}"
        return LoadResult(failures=[LoadFailure(source_id, uri, reason)])
    return load_bytes(path.name, data, source_id, uri, limits=limits, id_prefix=id_prefix)


def load_bytes(
    name: str,
    data: bytes,
    source_id: str,
    uri: str,
    *,
    limits: Limits = Limits(),
    id_prefix: str = "",
) -> LoadResult:
    """``load_file`` for bytes already in hand (an upload); ``name``'s suffix picks the loader."""
    if len(data) > limits.max_file_bytes:
        return too_big(len(data), source_id, uri, limits)
    return load_blob(Blob(data, name, source_id, uri, id_prefix, Budget(limits, len(data))))


def too_big(size: int, source_id: str, uri: str, limits: Limits) -> LoadResult:
    reason = f"file is {size} bytes, over the {limits.max_file_bytes}-byte limit"
    return LoadResult(failures=[LoadFailure(source_id, uri, reason)])


def load_paths(
    paths: Sequence[str | Path],
    *,
    limits: Limits = Limits(),
    max_file_bytes: int | None = None,
    prefix: str = "",
) -> LoadResult:
    """Load every file and folder given, in the order given."""
    result = LoadResult()
    for path in paths:
        result.extend(load_path(path, limits=limits, max_file_bytes=max_file_bytes, prefix=prefix))
    return result


def load_path(
    path: str | Path,
    *,
    limits: Limits = Limits(),
    max_file_bytes: int | None = None,
    prefix: str = "",
    source_id: str | None = None,
) -> LoadResult:
    """A folder (walked recursively, sorted) or a single file. ``source_id`` names a single
    file's source explicitly; otherwise ids derive from paths, after ``prefix``."""
    path = Path(path)
    if max_file_bytes is not None:
        limits = replace(limits, max_file_bytes=max_file_bytes)
    if path.is_dir():
        result = LoadResult()
        for file, relative in _walk(path):
            result.extend(load_file(file, prefix + relative, limits=limits, id_prefix=prefix))
        return result
    name = source_id or prefix + _printable(path.name)
    return load_file(path, name, limits=limits, id_prefix=prefix)


def _walk(root: Path) -> list[tuple[Path, str]]:
    """(file, path relative to root) for every non-hidden file, sorted by the relative path."""
    found = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if not d.startswith(".")]
        base = Path(directory)
        found += [
            (base / f, _printable((base / f).relative_to(root).as_posix()))
            for f in files
            if not f.startswith(".")
        ]
    return sorted(found, key=lambda pair: pair[1])


def _printable(name: str) -> str:
    """A path as a source id: a name that is not UTF-8 (its bytes came in as surrogates) gets
    its odd bytes as ``\\xNN`` escapes, stable and storable."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return os.fsencode(name).decode("utf-8", "backslashreplace")
    return name

"""PDF: text per page (pypdf), pages kept apart and numbered for citations."""

from __future__ import annotations

import io
import logging

from ingest.loaders.base import Extracted, Rejected
from ingest.loaders.structure import sections


def load_pdf(data: bytes) -> Extracted:
    title, pages = pdf_pages(data)
    text, starts = sections(pages)
    return Extracted(text, title, {"page_starts": starts} if starts else {})


def pdf_to_text(data: bytes) -> tuple[str, str]:
    """(title, text) of a PDF, pages separated by blank lines; corrupt or locked PDFs are rejected."""
    title, pages = pdf_pages(data)
    return title, "\n\n".join(pages)


def pdf_pages(data: bytes) -> tuple[str, list[str]]:
    from pypdf import PdfReader
    from pypdf.errors import LimitReachedError, PdfReadError

    # pypdf logs every recoverable oddity; the result (or rejection) is what matters here.
    logging.getLogger("pypdf").setLevel(logging.ERROR)
    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted and not reader.decrypt(""):
            raise Rejected("PDF is encrypted")
        pages = [page.extract_text() or "" for page in reader.pages]
        for page, text in zip(reader.pages, pages, strict=True):
            # extract_text swallows a stream that fails to decode (a bomb stopped at pypdf's
            # limit reads as an empty page); an empty page is decoded once more to say why.
            if not text.strip():
                page.get_contents()
        title = str((reader.metadata or {}).get("/Title") or "")
    except Rejected:
        raise
    except LimitReachedError as error:
        # pypdf caps every stream's decompressed size (75 MB by default): a bomb stops there.
        raise Rejected(f"PDF decompression bomb: {error}") from error
    except (
        PdfReadError,
        ValueError,
        KeyError,
        TypeError,
        AttributeError,
        IndexError,
        OSError,
    ) as error:
        raise Rejected(f"corrupt PDF: {error}") from error
    return title.strip(), pages

"""EPUB through ebooklib: the spine's documents in reading order, each through the HTML loader;
``chapter_starts`` on the version."""

from __future__ import annotations

import io
import warnings

from ingest.loaders.base import Extracted
from ingest.loaders.structure import sections
from ingest.loaders.text import declared_charset, decode, html_to_text


def load_epub(data: bytes) -> Extracted:
    import ebooklib
    from ebooklib import epub

    with warnings.catch_warnings():  # ebooklib warns about options whose defaults change
        warnings.simplefilter("ignore")
        book = epub.read_epub(io.BytesIO(data), options={"ignore_ncx": True})
    titles = book.get_metadata("DC", "title")
    title = str(titles[0][0]).strip() if titles else ""
    chapters: list[str] = []
    for item_id, _ in book.spine:
        item = book.get_item_with_id(item_id)
        if item is None or item.get_type() != ebooklib.ITEM_DOCUMENT:
            continue
        content = item.get_content()
        chapters.append(html_to_text(decode(content, declared_charset(content))[0])[1])
    text, starts = sections(chapters)
    return Extracted(text, title, {"chapter_starts": starts} if starts else {})

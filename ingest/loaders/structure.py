"""How a loader hands structure to the chunker: through the text itself.

The chunker cuts normalized text at paragraphs (blank lines), so headings written as their own
Markdown-style paragraphs (``## Heading``) stay at the top of the chunk they open. Positions
(pages, slides, sheets) are where each part starts in the NORMALIZED text, the coordinates of a
chunk's ``char_start``: the part a cited chunk came from is the last start at or before it.
"""

from __future__ import annotations

from collections.abc import Sequence

from ingest.chunking import normalize_text


def sections(parts: Sequence[str]) -> tuple[str, list[int]]:
    """The parts joined as paragraphs, and where each part starts in the normalized text (an
    empty part starts where the next one does). The starts are left out (``[]``) in the rare case
    where normalizing the whole moves them (a combining mark at the start of a part)."""
    pieces: list[str] = []
    starts: list[int] = []
    offset = 0
    for part in parts:
        starts.append(offset)
        piece = normalize_text(part)
        if piece:
            pieces.append(piece)
            offset += len(piece) + 2
    text = "\n\n".join(pieces)
    return text, starts if normalize_text(text) == text else []


def heading(level: int, text: str) -> str:
    """A heading paragraph; its text on one line so it stays one paragraph."""
    return f"{'#' * min(max(level, 1), 6)} {' '.join(text.split())}"

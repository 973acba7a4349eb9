"""Normalization and token-aware chunking.

``normalize_text`` fixes the exact bytes a version is hashed from. ``Chunker`` cuts normalized
text into chunks that fit the embedding model's window, measured in its own tokens.

Chunk boundaries stay put when unrelated text changes. Paragraphs (and, inside a paragraph too
long for one chunk, sentences) are the units; a unit whose BLAKE3 falls in the lowest quarter
is an *anchor*, and a chunk always ends after an anchor. Between anchors, units are packed
greedily up to the token budget. A boundary therefore depends only on the text since the
previous anchor: editing one paragraph can move boundaries up to the next anchor (about four
units on average) and no further, so the chunks after it keep their text, hash and vector.
Each chunk except a document's first also repeats the last ``overlap`` tokens of the chunk
before it, so a sentence cut at a boundary is still whole in one of them.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

from blake3 import blake3
from tokenizers import Tokenizer

from provenance.truth import ChunkDraft, content_hash

# Anchors: units whose BLAKE3 first byte is below this (64/256 = one unit in four).
ANCHOR_BELOW = 64

_HORIZONTAL_SPACE = re.compile(r"[^\S\n]+")
_BLANK_LINES = re.compile(r"\n{3,}")
# Unicode category Cc except newline and tab.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")
# Zero-width characters and soft hyphens, dropped (a regex: several times faster than
# str.translate on long texts, same result).
_INVISIBLE = re.compile("[\u200b\u200c\u200d\u2060\ufeff\u00ad]+")
# A character that survives normalization: not whitespace, control or invisible.
_VISIBLE = re.compile("[^\\s\x00-\x1f\x7f-\x9f\u200b\u200c\u200d\u2060\ufeff\u00ad]")
_SENTENCE_END = re.compile(r"(?<=[.!?…])\s+|\n")


def normalize_text(text: str) -> str:
    """Unicode NFC; newlines as ``\\n``; control and zero-width characters dropped; runs of
    spaces and tabs become one space; lines trimmed; at most one blank line between paragraphs;
    no leading or trailing whitespace. Idempotent: normalizing twice changes nothing."""
    text = unicodedata.normalize("NFC", text)
    text = (
        text.replace("\r\n", "\n")
        .replace("\r", "\n")
        .replace("\u2028", "\n")
        .replace("\u2029", "\n\n")
    )
    text = _CONTROL.sub(" ", _INVISIBLE.sub("", text))
    text = _HORIZONTAL_SPACE.sub(" ", text)
    text = "\n".join(line.strip() for line in text.split("\n"))
    text = _BLANK_LINES.sub("\n\n", text)
    return text.strip()


def has_content(text: str) -> bool:
    """Whether ``normalize_text(text)`` is non-empty, without normalizing all of it."""
    return _VISIBLE.search(text) is not None


def is_anchor(text: str) -> bool:
    return blake3(text.encode()).digest()[0] < ANCHOR_BELOW


@dataclass(frozen=True, slots=True)
class _Unit:
    start: int
    end: int
    tokens: int
    anchor: bool


class Chunker:
    """Cuts normalized text into ``ChunkDraft``s of at most ``max_tokens`` tokens each.

    ``max_tokens`` counts the chunk's own tokens (no [CLS]/[SEP]); give the model's window minus
    its special tokens. ``overlap_tokens`` of it are reserved for the repeat of the previous
    chunk's tail, so every chunk fits whether or not it carries an overlap.
    """

    def __init__(self, tokenizer: Tokenizer, max_tokens: int, overlap_tokens: int) -> None:
        if max_tokens < 8:
            raise ValueError(f"max_tokens must be at least 8, got {max_tokens}")
        if not 0 <= overlap_tokens <= max_tokens // 2:
            raise ValueError(
                f"overlap_tokens must be between 0 and half of max_tokens ({max_tokens // 2}), got {overlap_tokens}"
            )
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self.overlap_tokens = overlap_tokens
        self.core_tokens = max_tokens - overlap_tokens

    def count_tokens(self, texts: list[str]) -> list[int]:
        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        return [len(e.ids) for e in encodings]

    def chunk(self, text: str) -> list[ChunkDraft]:
        """Chunks of already normalized ``text`` with their char spans, hashes and token counts."""
        cores = self._pack(self._units(text))
        spans: list[tuple[int, int]] = []
        for i, (start, end) in enumerate(cores):
            spans.append((self._overlap_start(text, *cores[i - 1]) if i else start, end))
        texts = [text[s:e] for s, e in spans]
        counts = self.count_tokens(texts) if texts else []
        return [
            ChunkDraft(
                ordinal=i,
                text=t,
                chunk_hash=content_hash(t),
                token_count=n,
                char_start=s,
                char_end=e,
            )
            for i, ((s, e), t, n) in enumerate(zip(spans, texts, counts, strict=True))
        ]

    def _units(self, text: str) -> list[_Unit]:
        paragraphs = _spans(text, "\n\n")
        counts = self.count_tokens([text[s:e] for s, e in paragraphs])
        units: list[_Unit] = []
        for (start, end), tokens in zip(paragraphs, counts, strict=True):
            if tokens <= self.core_tokens:
                units.append(_Unit(start, end, tokens, is_anchor(text[start:end])))
            else:
                units.extend(self._split_paragraph(text, start, end))
        return units

    def _split_paragraph(self, text: str, start: int, end: int) -> list[_Unit]:
        """A paragraph too long for one chunk, as sentence units; a sentence still too long is
        cut into token windows."""
        sentences = [(start + s, start + e) for s, e in _sentence_spans(text[start:end])]
        counts = self.count_tokens([text[s:e] for s, e in sentences])
        units: list[_Unit] = []
        for (s, e), tokens in zip(sentences, counts, strict=True):
            if tokens <= self.core_tokens:
                units.append(_Unit(s, e, tokens, is_anchor(text[s:e])))
                continue
            offsets = self.tokenizer.encode(text[s:e], add_special_tokens=False).offsets
            for w in range(0, len(offsets), self.core_tokens):
                window = offsets[w : w + self.core_tokens]
                w_end = s + window[-1][1] if w + self.core_tokens < len(offsets) else e
                units.append(_Unit(s + window[0][0], w_end, len(window), False))
        return units

    def _pack(self, units: list[_Unit]) -> list[tuple[int, int]]:
        """Greedy packing up to ``core_tokens``; always cut after an anchor."""
        cores: list[tuple[int, int]] = []
        first: _Unit | None = None
        last: _Unit | None = None
        used = 0
        for unit in units:
            if first is not None and used + unit.tokens > self.core_tokens:
                cores.append((first.start, last.end))
                first, used = None, 0
            if first is None:
                first = unit
            last = unit
            used += unit.tokens
            if unit.anchor:
                cores.append((first.start, last.end))
                first, used = None, 0
        if first is not None:
            cores.append((first.start, last.end))
        return cores

    def _overlap_start(self, text: str, prev_start: int, prev_end: int) -> int:
        """Where the repeat of the previous chunk's last ``overlap_tokens`` tokens begins,
        moved forward to a word start so no chunk begins inside a word."""
        if self.overlap_tokens == 0:
            return prev_end
        offsets = self.tokenizer.encode(text[prev_start:prev_end], add_special_tokens=False).offsets
        if len(offsets) <= self.overlap_tokens:
            return prev_start
        start = prev_start + offsets[-self.overlap_tokens][0]
        while start < prev_end and not text[start - 1].isspace():
            start += 1
        while start < prev_end and text[start].isspace():
            start += 1
        return start


def _spans(text: str, separator: str) -> list[tuple[int, int]]:
    spans, start = [], 0
    while start <= len(text):
        end = text.find(separator, start)
        end = len(text) if end < 0 else end
        if end > start:
            spans.append((start, end))
        start = end + len(separator)
    return spans


def _sentence_spans(text: str) -> list[tuple[int, int]]:
    spans, start = [], 0
    for match in _SENTENCE_END.finditer(text):
        if match.start() > start:
            spans.append((start, match.start()))
        start = match.end()
    if start < len(text):
        spans.append((start, len(text)))
    return spans

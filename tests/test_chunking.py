"""Normalization and token-aware chunking with the embedding model's own tokenizer."""

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ingest.chunking import Chunker, has_content, is_anchor, normalize_text
from ingest.embedding import bundled_model_dir, load_tokenizer
from provenance.truth import content_hash

WORDS = [
    "llama",
    "alpaca",
    "vicuna",
    "guanaco",
    "camel",
    "herd",
    "wool",
    "fibre",
    "andes",
    "valley",
    "river",
    "meadow",
    "shearing",
    "breeding",
    "pasture",
    "altitude",
    "shelter",
    "fence",
    "water",
    "hay",
    "grain",
    "vet",
    "tooth",
    "hoof",
    "coat",
    "colour",
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(bundled_model_dir())


@pytest.fixture
def chunker(tokenizer):
    return Chunker(tokenizer, max_tokens=64, overlap_tokens=8)


def paragraph(rng: random.Random, sentences: int) -> str:
    return " ".join(
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 12))).capitalize() + "."
        for _ in range(sentences)
    )


def document(seed: int, paragraphs: int = 40) -> list[str]:
    rng = random.Random(seed)
    return [paragraph(rng, rng.randint(1, 3)) for _ in range(paragraphs)]


def test_normalize_applies_every_rule():
    raw = "\ufeffCafe\u0301\r\nline two\t\t with   spaces  \r\n\r\n\r\n\n  next\u200b paragraph\x07 \u00a0end  "
    assert normalize_text(raw) == "Café\nline two with spaces\n\nnext paragraph end"


def test_normalize_keeps_single_newlines_and_one_blank_line():
    assert normalize_text("a\nb\n\n\n\nc") == "a\nb\n\nc"
    assert normalize_text(" \n\t\n ") == ""


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=200))
def test_normalize_is_idempotent(text):
    once = normalize_text(text)
    assert normalize_text(once) == once


def check_chunks(text, chunks, chunker, tokenizer):
    assert [c.ordinal for c in chunks] == list(range(len(chunks)))
    for c in chunks:
        assert text[c.char_start : c.char_end] == c.text
        assert c.chunk_hash == content_hash(c.text)
        assert c.token_count == len(tokenizer.encode(c.text, add_special_tokens=False).ids)
        assert c.token_count <= chunker.max_tokens
    # Every word of the text is in some chunk, in order, and chunks move forward.
    assert chunks[0].char_start == 0 and chunks[-1].char_end == len(text)
    for before, after in itertools.pairwise(chunks):
        assert before.char_start < after.char_start <= before.char_end + 2
        assert after.char_end > before.char_end


def test_chunks_fit_the_budget_and_cover_the_text(chunker, tokenizer):
    text = normalize_text("\n\n".join(document(1)))
    chunks = chunker.chunk(text)
    assert len(chunks) > 5
    check_chunks(text, chunks, chunker, tokenizer)
    assert chunker.chunk(text) == chunks  # deterministic


def test_neighbouring_chunks_overlap_by_the_overlap_budget(chunker, tokenizer):
    text = normalize_text("\n\n".join(document(2)))
    chunks = chunker.chunk(text)
    overlaps = [before.char_end - after.char_start for before, after in itertools.pairwise(chunks)]
    assert all(o > 0 for o in overlaps)
    for before, after in itertools.pairwise(chunks):
        shared = text[after.char_start : before.char_end]
        assert (
            0
            < len(tokenizer.encode(shared, add_special_tokens=False).ids)
            <= chunker.overlap_tokens
        )
        assert not text[after.char_start - 1].isalnum()  # starts at a word


def test_without_overlap_chunks_tile_the_text(tokenizer):
    chunker = Chunker(tokenizer, max_tokens=64, overlap_tokens=0)
    text = normalize_text("\n\n".join(document(3)))
    chunks = chunker.chunk(text)
    for before, after in itertools.pairwise(chunks):
        assert before.char_end <= after.char_start
        assert text[before.char_end : after.char_start].strip() == ""


def changed_chunks(before: list, after: list) -> int:
    old = {c.chunk_hash for c in before}
    return sum(c.chunk_hash not in old for c in after)


def uniform_document(seed: int, tokenizer, paragraphs: int = 60, tokens: int = 24) -> list[str]:
    """Paragraphs of exactly ``tokens`` tokens: two fit a 64-token chunk, three do not. Greedy
    packing alone would shift every later pair after an insertion or a longer paragraph."""
    rng = random.Random(seed)
    out = []
    while len(out) < paragraphs:
        words = [rng.choice(WORDS) for _ in range(tokens)]
        text = " ".join(words).capitalize() + "."
        n = len(tokenizer.encode(text, add_special_tokens=False).ids)
        out.append(" ".join(words[: tokens - (n - tokens)]).capitalize() + ".")
    return out


def test_editing_one_paragraph_keeps_the_other_chunks(chunker, tokenizer):
    paragraphs = uniform_document(4, tokenizer)
    before = chunker.chunk(normalize_text("\n\n".join(paragraphs)))
    edited = list(paragraphs)
    edited[20] = edited[20] + " An added sentence about shearing the herd before the summer heat."
    after = chunker.chunk(normalize_text("\n\n".join(edited)))
    assert len(before) >= 25
    # Only chunks near the edit change: the rest keep text, hash and therefore their vectors.
    assert changed_chunks(before, after) <= 6
    assert before[:5] == after[:5]
    assert [c.chunk_hash for c in before[-10:]] == [c.chunk_hash for c in after[-10:]]


def test_inserting_a_paragraph_at_the_top_does_not_shift_every_chunk(chunker, tokenizer):
    paragraphs = uniform_document(5, tokenizer)
    before = chunker.chunk(normalize_text("\n\n".join(paragraphs)))
    opening = uniform_document(50, tokenizer, paragraphs=1)
    after = chunker.chunk(normalize_text("\n\n".join([*opening, *paragraphs])))
    assert changed_chunks(before, after) <= 6
    assert [c.chunk_hash for c in before[-10:]] == [c.chunk_hash for c in after[-10:]]


def test_every_anchor_paragraph_ends_a_chunk(tokenizer):
    chunker = Chunker(tokenizer, max_tokens=200, overlap_tokens=0)
    paragraphs = document(6, paragraphs=50)
    text = "\n\n".join(paragraphs)
    ends = {c.char_end for c in chunker.chunk(text)}
    position = 0
    for p in paragraphs:
        position += len(p)
        if is_anchor(p):
            assert position in ends
        position += 2


def test_a_long_paragraph_splits_at_sentences_and_a_long_sentence_at_tokens(chunker, tokenizer):
    rng = random.Random(7)
    long_paragraph = paragraph(rng, 30)
    run_on = " ".join(rng.choice(WORDS) for _ in range(400))  # no sentence end at all
    text = normalize_text(f"Short opening.\n\n{long_paragraph}\n\n{run_on}")
    chunks = chunker.chunk(text)
    check_chunks(text, chunks, chunker, tokenizer)
    ends = {c.char_end for c in chunks}
    assert any(text[e - 1] == "." for e in ends if e < len(text))


def test_chunker_rejects_budgets_it_cannot_honour(tokenizer):
    with pytest.raises(ValueError):
        Chunker(tokenizer, max_tokens=4, overlap_tokens=0)
    with pytest.raises(ValueError):
        Chunker(tokenizer, max_tokens=64, overlap_tokens=40)


def test_empty_text_has_no_chunks(chunker):
    assert chunker.chunk("") == []


@given(st.text(alphabet=st.sampled_from(" \n\t\x00\x1f\x7f\x85\u200b\ufeff\u00ad\u2028\u3000\xa0a\u0301")))
def test_has_content_says_whether_normalizing_leaves_anything(text):
    assert has_content(text) == bool(normalize_text(text))

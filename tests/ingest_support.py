"""Helpers shared by the ingestion, truth-layer and vector-index tests."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from qdrant_client import QdrantClient

from provenance.db import get_sessionmaker
from provenance.migrate import upgrade
from provenance.truth import ChunkDraft, SessionFactory, SourceDraft, content_hash
from provenance.vector_index import EdgeIndex, QdrantClientIndex, VectorIndex

DIM = 16
BACKENDS = ["edge", "qdrant-client"]


def make_index(backend: str, tmp_path, dim: int = DIM) -> VectorIndex:
    if backend == "edge":
        return EdgeIndex(tmp_path / "edge", dim)
    return QdrantClientIndex(QdrantClient(location=":memory:"), "chunks", dim)


def migrated_sessions(url: str) -> SessionFactory:
    upgrade(url)
    return get_sessionmaker(url)


def vector_for(text_hash: str, dim: int = DIM) -> np.ndarray:
    """A fixed unit vector per chunk hash: test data, the same on every run."""
    rng = np.random.default_rng(int(text_hash[:16], 16))
    v = rng.standard_normal(dim).astype(np.float32)
    return v / np.linalg.norm(v)


def draft(source_id: str, paragraphs: Sequence[str], title: str = "") -> SourceDraft:
    """A source whose chunks are its paragraphs (the chunker has its own tests)."""
    text = "\n\n".join(paragraphs)
    chunks, start = [], 0
    for ordinal, paragraph in enumerate(paragraphs):
        chunks.append(
            ChunkDraft(
                ordinal,
                paragraph,
                content_hash(paragraph),
                len(paragraph.split()),
                start,
                start + len(paragraph),
            )
        )
        start += len(paragraph) + 2
    return SourceDraft(
        source_id, f"file:///{source_id}", "text", content_hash(text), tuple(chunks), title
    )


def vectors_of(*drafts: SourceDraft, dim: int = DIM) -> dict[str, np.ndarray]:
    return {c.chunk_hash: vector_for(c.chunk_hash, dim) for d in drafts for c in d.chunks}

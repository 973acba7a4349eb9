"""The embedding cache: one vector per (chunk hash, embedding model), shared by every tenant's
ingestion, the projection and the sweep; a vector is a pure function of its text and model, so
a chunk text is embedded at most once per model (``ingest.embedding.embed_with_cache``)."""

from collections.abc import Mapping, Sequence

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session

from provenance.db import in_batches, insert_missing
from provenance.models import Chunk, Embedding


def cached_vectors(
    session: Session, model_id: str, hashes: Sequence[str], tenant_id: str | None = None
) -> dict[str, np.ndarray]:
    """Cached embeddings of ``model_id`` for the given chunk hashes (absent ones left out);
    with ``tenant_id``, only hashes of chunks that tenant already has."""
    found: dict[str, np.ndarray] = {}
    for part in in_batches(sorted(set(hashes))):
        query = select(Embedding.chunk_hash, Embedding.vector).where(
            Embedding.model_id == model_id, Embedding.chunk_hash.in_(part)
        )
        if tenant_id is not None:
            owned = select(Chunk.id).where(
                Chunk.tenant_id == tenant_id, Chunk.chunk_hash == Embedding.chunk_hash
            )
            query = query.where(owned.exists())
        rows = session.execute(query)
        found.update({h: np.frombuffer(v, dtype=np.float32) for h, v in rows})
    return found


def store_vectors(session: Session, model_id: str, vectors: Mapping[str, np.ndarray]) -> None:
    """Cache ``vectors`` (chunk hash -> vector) as ``model_id``'s; a hash already cached keeps
    its vector."""
    insert_missing(
        session,
        Embedding,
        [
            {"chunk_hash": h, "model_id": model_id, "vector": np.asarray(v, np.float32).tobytes()}
            for h, v in vectors.items()
        ],
    )

"""Make the vector index agree with SQL after a crash cut a commit short (see
``provenance/truth.py`` for why the two can disagree, and in which ways)."""

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy.orm import Session

from provenance.embedding_cache import cached_vectors
from provenance.models import Chunk
from provenance.snapshots import chunk_points
from provenance.vector_index import IndexPoint, VectorIndex
from provenance.versions import SessionFactory
from provenance.writers_lock import writers_lock


@dataclass(slots=True)
class SweepReport:
    orphans_deleted: int = 0
    payloads_repaired: int = 0
    points_restored: int = 0
    points_missing: int = 0  # committed chunks with no point and no cached vector to restore


def expected_points(session: Session, tenant_id: str | None = None) -> dict[str, IndexPoint]:
    """The point every committed chunk should have, by chunk id (payload only)."""
    query = chunk_points()
    if tenant_id is not None:
        query = query.where(Chunk.tenant_id == tenant_id)
    return {row[0]: IndexPoint(*row) for row in session.execute(query)}


def sweep(
    sessions: SessionFactory,
    index: VectorIndex,
    tenant_id: str,
    *,
    model_id: str | None = None,
) -> SweepReport:
    """Make the index mirror SQL for one tenant: delete points no committed chunk names (left by
    a crash before a commit), rewrite payloads that disagree with SQL (a close cut short), and,
    given the embedding ``model_id``, restore missing or mismatched points from the embeddings
    cache.

    Holds the tenant's writers' lock throughout, so none of its commits is between its vector
    and SQL writes.
    """
    report = SweepReport()
    with writers_lock(sessions, tenant_id):
        with sessions() as session:
            expected = expected_points(session, tenant_id)
        # The scan runs with no transaction open: receipt writes go on meanwhile.
        orphans: list[str] = []
        repairs: list[IndexPoint] = []
        rewrite: list[IndexPoint] = []
        seen: set[str] = set()
        for point in index.scan(tenant_id):
            seen.add(point.chunk_id)
            want = expected.get(point.chunk_id)
            if want is None:
                orphans.append(point.chunk_id)
            elif want.chunk_hash != point.chunk_hash:
                rewrite.append(want)  # the vector belongs to other text: rewrite the point
            elif not want.same_payload(point):
                repairs.append(want)
        mismatched = {p.chunk_id for p in rewrite}
        rewrite += [p for cid, p in expected.items() if cid not in seen]
        restored: list[IndexPoint] = []
        if model_id:
            with sessions() as session:
                restored = _with_cached_vectors(session, rewrite, model_id)
        unrestorable = mismatched - {p.chunk_id for p in restored}
        # A point whose vector belongs to other text is worse than none: drop it if not rewritten.
        index.delete(orphans + sorted(unrestorable))
        index.set_payloads(repairs)
        index.upsert(restored)
        index.flush()
    report.orphans_deleted = len(orphans)
    report.payloads_repaired = len(repairs)
    report.points_restored = len(restored)
    report.points_missing = len(rewrite) - len(restored)
    return report


def _with_cached_vectors(
    session: Session, points: Sequence[IndexPoint], model_id: str
) -> list[IndexPoint]:
    cached = cached_vectors(session, model_id, [p.chunk_hash for p in points])
    return [
        dataclasses.replace(p, vector=cached[p.chunk_hash])
        for p in points
        if p.chunk_hash in cached
    ]

"""Reading the truth store: epochs, what a tenant saw at one, its sources and their history.

A version is visible at epoch E iff ``valid_from_epoch <= E < valid_to_epoch``; a chunk is
visible when its version is.
"""

from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, Connection, Select, func, select
from sqlalchemy.orm import Session

from provenance.db import in_batches
from provenance.models import OPEN_EPOCH, Chunk, Epoch, Source, SourceVersion, as_utc
from provenance.versions import ChunkRecord, Snapshot, SourceInfo, VersionInfo

# Joins a chunk to the version it belongs to.
CHUNK_VERSION: ColumnElement[bool] = (
    (SourceVersion.tenant_id == Chunk.tenant_id)
    & (SourceVersion.source_id == Chunk.source_id)
    & (SourceVersion.version == Chunk.version)
)


def visible_at(epoch: int) -> ColumnElement[bool]:
    """The versions visible at ``epoch``."""
    return (SourceVersion.valid_from_epoch <= epoch) & (SourceVersion.valid_to_epoch > epoch)


def chunk_points() -> Select[Any]:
    """Each chunk with its version's validity: the columns of an index point
    (``provenance.vector_index.IndexPoint``), in its field order."""
    return select(
        Chunk.id,
        Chunk.tenant_id,
        Chunk.source_id,
        Chunk.version,
        Chunk.chunk_hash,
        SourceVersion.valid_from_epoch,
        SourceVersion.valid_to_epoch,
    ).join(SourceVersion, CHUNK_VERSION)


def current_epoch(session: Session | Connection, tenant_id: str) -> int:
    """The tenant's last committed epoch (0: before its first commit)."""
    query = select(func.coalesce(func.max(Epoch.epoch), 0)).where(Epoch.tenant_id == tenant_id)
    return session.scalar(query) or 0


def epoch_at(session: Session, tenant_id: str, when: datetime) -> int:
    """The tenant's last epoch committed at or before ``when`` (0: before its first commit)."""
    query = select(func.coalesce(func.max(Epoch.epoch), 0)).where(
        Epoch.tenant_id == tenant_id, Epoch.committed_at <= as_utc(when)
    )
    return session.scalar(query) or 0


def as_of(
    session: Session, tenant_id: str, *, epoch: int | None = None, at: datetime | None = None
) -> Snapshot:
    """The versions a tenant could see at an epoch, or at a point in time (default: now)."""
    if epoch is not None and at is not None:
        raise ValueError("give an epoch or a time, not both")
    if epoch is None:
        if at is not None:
            epoch = epoch_at(session, tenant_id, at)
        else:
            epoch = current_epoch(session, tenant_id)
    rows = session.scalars(
        select(SourceVersion)
        .where(SourceVersion.tenant_id == tenant_id, visible_at(epoch))
        .order_by(SourceVersion.source_id)
    )
    return Snapshot(tenant_id, epoch, tuple(VersionInfo.of(r) for r in rows))


def chunks_as_of(session: Session, tenant_id: str, epoch: int) -> list[ChunkRecord]:
    """Every chunk visible at ``epoch``, by source id then ordinal."""
    rows = session.scalars(
        select(Chunk)
        .join(SourceVersion, CHUNK_VERSION)
        .where(Chunk.tenant_id == tenant_id, visible_at(epoch))
        .order_by(Chunk.source_id, Chunk.ordinal)
    )
    return [ChunkRecord.of(r) for r in rows]


def get_chunks(session: Session, tenant_id: str, chunk_ids: Sequence[str]) -> list[ChunkRecord]:
    """Chunks by id, in the order asked, with their stored hashes (unknown ids are left out)."""
    found: dict[str, ChunkRecord] = {}
    ids = list(dict.fromkeys(chunk_ids))
    for part in in_batches(ids):
        rows = session.scalars(
            select(Chunk).where(Chunk.tenant_id == tenant_id, Chunk.id.in_(part))
        )
        found.update({r.id: ChunkRecord.of(r) for r in rows})
    return [found[i] for i in ids if i in found]


def latest_versions(
    session: Session, tenant_id: str, source_ids: Iterable[str]
) -> dict[str, SourceVersion]:
    """The newest version row of each given source, open or closed (unknown ones left out)."""
    latest: dict[str, SourceVersion] = {}
    for part in in_batches(sorted(set(source_ids))):
        newest = (
            select(SourceVersion.source_id, func.max(SourceVersion.version).label("version"))
            .where(SourceVersion.tenant_id == tenant_id, SourceVersion.source_id.in_(part))
            .group_by(SourceVersion.source_id)
            .subquery()
        )
        rows = session.scalars(
            select(SourceVersion)
            .join(
                newest,
                (SourceVersion.source_id == newest.c.source_id)
                & (SourceVersion.version == newest.c.version),
            )
            .where(SourceVersion.tenant_id == tenant_id)
        )
        latest.update({row.source_id: row for row in rows})
    return latest


def open_content_hashes(
    session: Session, tenant_id: str, source_ids: Iterable[str]
) -> dict[str, str]:
    """Content hash of each given source's open version (sources with none are left out)."""
    hashes: dict[str, str] = {}
    for part in in_batches(sorted(set(source_ids))):
        rows = session.execute(
            select(SourceVersion.source_id, SourceVersion.content_hash).where(
                SourceVersion.tenant_id == tenant_id,
                SourceVersion.source_id.in_(part),
                SourceVersion.valid_to_epoch == OPEN_EPOCH,
            )
        )
        hashes.update({source_id: digest for source_id, digest in rows})
    return hashes


def open_source_ids(session: Session, tenant_id: str, prefix: str = "") -> set[str]:
    """Ids of the tenant's sources with an open version, optionally under an id prefix."""
    query = select(SourceVersion.source_id).where(
        SourceVersion.tenant_id == tenant_id, SourceVersion.valid_to_epoch == OPEN_EPOCH
    )
    if prefix:
        query = query.where(SourceVersion.source_id.startswith(prefix, autoescape=True))
    return set(session.scalars(query))


def list_sources(session: Session, tenant_id: str) -> list[SourceInfo]:
    """Every source of the tenant (deleted ones included), with its newest version."""
    latest = latest_versions(
        session, tenant_id, session.scalars(select(Source.id).where(Source.tenant_id == tenant_id))
    )
    sources = session.scalars(
        select(Source).where(Source.tenant_id == tenant_id).order_by(Source.id)
    )
    return [
        SourceInfo(s.tenant_id, s.id, s.uri, s.kind, s.created_at, VersionInfo.of(latest[s.id]))
        for s in sources
        if s.id in latest
    ]


def list_versions(session: Session, tenant_id: str, source_id: str) -> list[VersionInfo]:
    """A source's whole history, oldest first (empty when the source is unknown)."""
    rows = session.scalars(
        select(SourceVersion)
        .where(SourceVersion.tenant_id == tenant_id, SourceVersion.source_id == source_id)
        .order_by(SourceVersion.version)
    )
    return [VersionInfo.of(r) for r in rows]

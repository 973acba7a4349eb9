"""The truth layer: source versions as MVCC over epochs.

An epoch is one commit of the truth store. A version is visible at epoch E iff
``valid_from_epoch <= E < valid_to_epoch``. ``commit`` is the only writer: in ONE transaction
and ONE new epoch it opens a version for every source whose content changed (closing the one
it supersedes) and closes versions that are deprecated or deleted (tombstones: history stays).
Identical content (same BLAKE3) is a no-op that takes no epoch.

Epochs count per tenant: each tenant has its own counter row, so one tenant's commits neither
move another's epoch nor wait for another's writers.

Write order (vectors first, SQL last), under the tenant's writers' lock (``writers_lock``: a
PostgreSQL advisory lock, or a file lock beside the SQLite file), which admits one commit or
sweep of the tenant at a time across threads and processes and is held until the SQL commit:
1. a short read transaction plans the change and reads the tenant's epoch counter (next epoch =
   counter + 1; only a lock holder moves the counter, so the plan stays true);
2. with NO transaction open, the new versions' points are written with ``valid_from`` = that
   epoch (on SQLite a transaction held here would hold the database write lock, and receipt
   writes would wait behind the vector upsert);
3. one short write transaction takes the epoch (counter + 1, checked against step 1), writes the
   versions, chunks and audit leaves, and commits.
Only after the commit does it mark the closed versions' points (``valid_to``). A crash before
the commit leaves points no SQL row names (invisible: retrieval checks hits against SQL, and
``sweep`` deletes them); a crash after it leaves closed points still marked open (retrieval
drops them on the SQL check, ``sweep`` repairs the payload). Chunk ids are deterministic, so a
re-run writes the same points. ``sweep`` takes the same lock, reads SQL in a short transaction
and scans the index with none open, so it never mistakes an in-flight commit's points for
orphans and never blocks receipt writes while it scans.
"""

from __future__ import annotations

import fcntl
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy import func, select, text, update
from sqlalchemy.orm import Session

from provenance.audit_log import append_version_event
from provenance.db import insert_missing
from provenance.hashing import blake3_hex
from provenance.models import (
    OPEN_EPOCH,
    Chunk,
    Embedding,
    Epoch,
    EpochCounter,
    Source,
    SourceVersion,
    Tenant,
    as_utc,
)
from provenance.vector_index import IndexPoint, VectorIndex

# Fixed namespace of chunk ids: uuid5(namespace, "tenant␟source␟version␟ordinal").
CHUNK_ID_NAMESPACE = uuid.UUID("6f1c2d0e-8a4b-5e7f-9c3d-2b1a0e9f8d7c")

SessionFactory = Callable[[], Session]


def content_hash(text: str) -> str:
    """BLAKE3 (hex) of normalized text: the identity of a version's content and of a chunk."""
    return blake3_hex(text)


def chunk_id(tenant_id: str, source_id: str, version: int, ordinal: int) -> str:
    return str(
        uuid.uuid5(CHUNK_ID_NAMESPACE, f"{tenant_id}\x1f{source_id}\x1f{version}\x1f{ordinal}")
    )


# ---------------------------------------------------------------------------------------------
# Values in and out
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ChunkDraft:
    """One chunk of a version about to be written; ``text`` is the slice
    ``normalized_text[char_start:char_end]``."""

    ordinal: int
    text: str
    chunk_hash: str
    token_count: int
    char_start: int
    char_end: int


@dataclass(frozen=True, slots=True)
class SourceDraft:
    """A source's normalized content, chunked, ready for ``commit``."""

    source_id: str
    uri: str
    kind: str
    content_hash: str
    chunks: tuple[ChunkDraft, ...]
    title: str = ""
    metadata: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class VersionInfo:
    tenant_id: str
    source_id: str
    version: int
    content_hash: str
    valid_from: int
    valid_to: int  # OPEN_EPOCH while the version is current
    status: str  # active | superseded | deprecated | deleted
    ingested_at: datetime
    title: str
    metadata: dict[str, Any]

    @property
    def is_open(self) -> bool:
        return self.valid_to == OPEN_EPOCH

    def visible_at(self, epoch: int) -> bool:
        return self.valid_from <= epoch < self.valid_to

    @classmethod
    def of(cls, row: SourceVersion) -> VersionInfo:
        return cls(
            tenant_id=row.tenant_id,
            source_id=row.source_id,
            version=row.version,
            content_hash=row.content_hash,
            valid_from=row.valid_from_epoch,
            valid_to=row.valid_to_epoch,
            status=row.status,
            ingested_at=row.ingested_at,
            title=row.title,
            metadata=dict(row.meta or {}),
        )


@dataclass(frozen=True, slots=True)
class SourceInfo:
    tenant_id: str
    source_id: str
    uri: str
    kind: str
    created_at: datetime
    latest: VersionInfo  # the newest version, open or closed

    @property
    def status(self) -> str:
        return self.latest.status


@dataclass(frozen=True, slots=True)
class ChunkRecord:
    id: str
    tenant_id: str
    source_id: str
    version: int
    ordinal: int
    text: str
    chunk_hash: str
    token_count: int
    char_start: int
    char_end: int

    @classmethod
    def of(cls, row: Chunk) -> ChunkRecord:
        return cls(
            id=row.id,
            tenant_id=row.tenant_id,
            source_id=row.source_id,
            version=row.version,
            ordinal=row.ordinal,
            text=row.text,
            chunk_hash=row.chunk_hash,
            token_count=row.token_count,
            char_start=row.char_start,
            char_end=row.char_end,
        )


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What a tenant's store showed at one epoch."""

    tenant_id: str
    epoch: int
    versions: tuple[VersionInfo, ...]


@dataclass(slots=True)
class CommitResult:
    """What one ``commit`` did; ``epoch`` is None when nothing changed (no epoch is taken)."""

    epoch: int | None = None
    added: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    deprecated: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    points_written: int = 0

    def summary(self) -> dict[str, int]:
        return {
            "added": len(self.added),
            "updated": len(self.updated),
            "unchanged": len(self.unchanged),
            "deprecated": len(self.deprecated),
            "deleted": len(self.deleted),
        }


@dataclass(slots=True)
class SweepReport:
    orphans_deleted: int = 0
    payloads_repaired: int = 0
    points_restored: int = 0
    points_missing: int = 0  # committed chunks with no point and no cached vector to restore


CLOSE_STATUSES = ("deprecated", "deleted")


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


# First key of the writers' advisory locks ("trut" in ASCII); the second is the tenant's hash.
WRITERS_LOCK_CLASS = 0x74727574
_local_writer_locks: dict[str, threading.Lock] = {}
_local_writer_locks_guard = threading.Lock()


@contextmanager
def writers_lock(sessions: SessionFactory, tenant_id: str) -> Iterator[None]:
    """Admit one truth-store writer (``commit``) or ``sweep`` of a tenant at a time, across
    threads and processes, without holding a database transaction: on PostgreSQL a
    session-level advisory lock on a connection of its own, on SQLite an exclusive ``flock`` on
    a file of the tenant's beside the database (the embedded store lives on one host). Both are
    released if the process dies."""
    with sessions() as probe:
        engine = probe.get_bind()
    if engine.dialect.name == "postgresql":
        key = {"cls": WRITERS_LOCK_CLASS, "tenant": tenant_id}
        connection = engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        try:
            connection.execute(text("SELECT pg_advisory_lock(:cls, hashtext(:tenant))"), key)
            yield
        finally:
            try:
                connection.execute(text("SELECT pg_advisory_unlock(:cls, hashtext(:tenant))"), key)
            except Exception:
                # A connection that might still hold the lock must not go back to the pool.
                connection.invalidate()
            connection.close()
        return
    database = engine.url.database
    if not database or database == ":memory:":  # one process by construction
        with _local_writer_lock(f"{engine.url}\x1f{tenant_id}"):
            yield
        return
    folder = Path(f"{database}.writers")
    folder.mkdir(exist_ok=True)
    with (folder / blake3_hex(tenant_id)[:32]).open("a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # one open file per holder: threads exclude too
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _local_writer_lock(key: str) -> threading.Lock:
    with _local_writer_locks_guard:
        return _local_writer_locks.setdefault(key, threading.Lock())


def _counter(session: Session, tenant_id: str) -> int:
    """The tenant's last epoch handed out (0 before its first commit)."""
    value = session.scalar(select(EpochCounter.value).where(EpochCounter.tenant_id == tenant_id))
    return value or 0


def _take_epoch(session: Session, tenant_id: str, planned: int) -> None:
    """Advance the tenant's counter to ``planned`` in this transaction (its first write: on
    SQLite it takes the database write lock here, for the length of one short transaction)."""
    advance = (
        update(EpochCounter)
        .where(EpochCounter.tenant_id == tenant_id)
        .values(value=EpochCounter.value + 1)
        .returning(EpochCounter.value)
        .execution_options(synchronize_session=False)
    )
    counter = session.execute(advance).scalar_one_or_none()
    if counter is None:  # the tenant's first commit
        insert_missing(session, EpochCounter, [{"tenant_id": tenant_id, "value": 0}])
        counter = session.execute(advance).scalar_one()
    if counter != planned:
        # Someone moved the counter without the writers' lock; the points written for
        # ``planned`` are orphans the sweep removes.
        raise RuntimeError(f"epoch counter moved outside the writers' lock ({counter} != {planned})")


def ensure_tenant(session: Session, tenant_id: str) -> None:
    """Create the tenant row if it does not exist (safe against a concurrent creator)."""
    insert_missing(session, Tenant, [{"id": tenant_id, "name": tenant_id}])


def _latest_rows(
    session: Session, tenant_id: str, source_ids: Iterable[str]
) -> dict[str, SourceVersion]:
    ids = sorted(set(source_ids))
    latest: dict[str, SourceVersion] = {}
    for start in range(0, len(ids), 500):
        part = ids[start : start + 500]
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


def commit(
    sessions: SessionFactory,
    index: VectorIndex,
    tenant_id: str,
    *,
    upserts: Sequence[SourceDraft] = (),
    closes: Sequence[tuple[str, str]] = (),
    vectors: Mapping[str, np.ndarray] | None = None,
    job_id: str | None = None,
) -> CommitResult:
    """Apply one set of changes as ONE epoch; see the module docstring for the write order.

    ``upserts``: sources as they are now; identical content is unchanged, new content opens a
    version (closing the open one as superseded). ``closes``: ``(source_id, status)`` with status
    ``deprecated`` or ``deleted``; a source without an open version is left alone. ``vectors``
    maps every chunk hash of ``upserts`` to its embedding.
    """
    vectors = vectors or {}
    for _, status in closes:
        if status not in CLOSE_STATUSES:
            raise ValueError(f"a source is closed as one of {CLOSE_STATUSES}, not {status!r}")
    named = [d.source_id for d in upserts] + [source_id for source_id, _ in closes]
    if len(set(named)) != len(named):
        raise ValueError("a commit names each source at most once")
    result = CommitResult()
    closing: list[tuple[SourceVersion, str]] = []
    session = sessions()
    try:
        with writers_lock(sessions, tenant_id):
            # 1. Plan in a read transaction; nothing is written yet.
            epoch = _counter(session, tenant_id) + 1
            latest = _latest_rows(
                session, tenant_id, [d.source_id for d in upserts] + [s for s, _ in closes]
            )
            opening: list[tuple[SourceDraft, int]] = []
            for draft in upserts:
                previous = latest.get(draft.source_id)
                is_open = previous is not None and previous.valid_to_epoch == OPEN_EPOCH
                if is_open and previous.content_hash == draft.content_hash:
                    result.unchanged.append(draft.source_id)
                    continue
                if is_open:
                    closing.append((previous, "superseded"))
                    result.updated.append(draft.source_id)
                else:
                    result.added.append(draft.source_id)
                opening.append((draft, previous.version + 1 if previous is not None else 1))
            for source_id, status in closes:
                previous = latest.get(source_id)
                if previous is None or previous.valid_to_epoch != OPEN_EPOCH:
                    continue
                closing.append((previous, status))
                (result.deprecated if status == "deprecated" else result.deleted).append(source_id)
            session.commit()  # ends the read transaction (nothing to write; rows stay loaded)
            if not opening and not closing:
                return result

            # 2. Vectors first, with no transaction open: invisible until step 3 commits.
            points = [
                IndexPoint(
                    chunk_id=chunk_id(tenant_id, draft.source_id, version, c.ordinal),
                    tenant_id=tenant_id,
                    source_id=draft.source_id,
                    version=version,
                    chunk_hash=c.chunk_hash,
                    valid_from=epoch,
                    vector=vectors[c.chunk_hash],
                )
                for draft, version in opening
                for c in draft.chunks
            ]
            index.upsert(points)
            index.flush()
            result.points_written = len(points)

            # 3. One short write transaction: the epoch, the rows, the audit leaves.
            session.connection(execution_options={"sqlite_write": True})
            _take_epoch(session, tenant_id, epoch)
            ensure_tenant(session, tenant_id)
            session.add(
                Epoch(epoch=epoch, tenant_id=tenant_id, job_id=job_id, summary=result.summary())
            )
            for row, status in closing:
                row.status, row.valid_to_epoch = status, epoch
            _upsert_sources(session, tenant_id, [d for d, _ in opening])
            opened: list[SourceVersion] = []
            for draft, version in opening:
                row = SourceVersion(
                    tenant_id=tenant_id,
                    source_id=draft.source_id,
                    version=version,
                    content_hash=draft.content_hash,
                    valid_from_epoch=epoch,
                    valid_to_epoch=OPEN_EPOCH,
                    status="active",
                    title=draft.title,
                    meta=dict(draft.metadata),
                )
                session.add(row)
                opened.append(row)
            session.flush()
            session.add_all(
                Chunk(
                    id=chunk_id(tenant_id, draft.source_id, version, c.ordinal),
                    tenant_id=tenant_id,
                    source_id=draft.source_id,
                    version=version,
                    ordinal=c.ordinal,
                    text=c.text,
                    chunk_hash=c.chunk_hash,
                    token_count=c.token_count,
                    char_start=c.char_start,
                    char_end=c.char_end,
                )
                for draft, version in opening
                for c in draft.chunks
            )
            for row, _ in closing:
                append_version_event(session, row, "version_closed")
            for row in opened:
                append_version_event(session, row, "version_opened")
            session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()

    result.epoch = epoch
    # SQL is the truth from here on; the index catches up (and sweep finishes it after a crash).
    for row, _ in closing:
        index.close_version(tenant_id, row.source_id, row.version, epoch)
    return result


def _upsert_sources(session: Session, tenant_id: str, drafts: Sequence[SourceDraft]) -> None:
    if not drafts:
        return
    existing = {
        s.id: s
        for s in session.scalars(
            select(Source).where(
                Source.tenant_id == tenant_id, Source.id.in_([d.source_id for d in drafts])
            )
        )
    }
    for draft in drafts:
        source = existing.get(draft.source_id)
        if source is None:
            session.add(
                Source(tenant_id=tenant_id, id=draft.source_id, uri=draft.uri, kind=draft.kind)
            )
        else:
            source.uri, source.kind = draft.uri, draft.kind


def close_source(
    sessions: SessionFactory, index: VectorIndex, tenant_id: str, source_id: str, status: str
) -> CommitResult:
    """Deprecate or delete a source: close its open version at a new epoch (a tombstone)."""
    return commit(sessions, index, tenant_id, closes=[(source_id, status)])


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


def current_epoch(session: Session, tenant_id: str) -> int:
    """The tenant's last committed epoch (0: before its first commit)."""
    query = select(func.coalesce(func.max(Epoch.epoch), 0)).where(Epoch.tenant_id == tenant_id)
    return session.scalar(query) or 0


def epoch_at(session: Session, tenant_id: str, when: datetime) -> int:
    """The tenant's last epoch committed at or before ``when`` (0: before its first commit)."""
    query = select(func.coalesce(func.max(Epoch.epoch), 0)).where(
        Epoch.tenant_id == tenant_id, Epoch.committed_at <= as_utc(when)
    )
    return session.scalar(query) or 0


def _visible_at(epoch: int) -> Any:
    return (SourceVersion.valid_from_epoch <= epoch) & (SourceVersion.valid_to_epoch > epoch)


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
        .where(SourceVersion.tenant_id == tenant_id, _visible_at(epoch))
        .order_by(SourceVersion.source_id)
    )
    return Snapshot(tenant_id, epoch, tuple(VersionInfo.of(r) for r in rows))


def chunks_as_of(session: Session, tenant_id: str, epoch: int) -> list[ChunkRecord]:
    """Every chunk visible at ``epoch``, by source id then ordinal."""
    rows = session.scalars(
        select(Chunk)
        .join(
            SourceVersion,
            (SourceVersion.tenant_id == Chunk.tenant_id)
            & (SourceVersion.source_id == Chunk.source_id)
            & (SourceVersion.version == Chunk.version),
        )
        .where(Chunk.tenant_id == tenant_id, _visible_at(epoch))
        .order_by(Chunk.source_id, Chunk.ordinal)
    )
    return [ChunkRecord.of(r) for r in rows]


def get_chunks(session: Session, tenant_id: str, chunk_ids: Sequence[str]) -> list[ChunkRecord]:
    """Chunks by id, in the order asked, with their stored hashes (unknown ids are left out)."""
    found: dict[str, ChunkRecord] = {}
    ids = list(dict.fromkeys(chunk_ids))
    for start in range(0, len(ids), 500):
        rows = session.scalars(
            select(Chunk).where(
                Chunk.tenant_id == tenant_id, Chunk.id.in_(ids[start : start + 500])
            )
        )
        found.update({r.id: ChunkRecord.of(r) for r in rows})
    return [found[i] for i in ids if i in found]


def open_content_hashes(
    session: Session, tenant_id: str, source_ids: Iterable[str]
) -> dict[str, str]:
    """Content hash of each given source's open version (sources with none are left out)."""
    ids = sorted(set(source_ids))
    hashes: dict[str, str] = {}
    for start in range(0, len(ids), 500):
        rows = session.execute(
            select(SourceVersion.source_id, SourceVersion.content_hash).where(
                SourceVersion.tenant_id == tenant_id,
                SourceVersion.source_id.in_(ids[start : start + 500]),
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
    latest = _latest_rows(
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


# ---------------------------------------------------------------------------------------------
# Sweep: make the index agree with SQL
# ---------------------------------------------------------------------------------------------


def expected_points(session: Session, tenant_id: str | None = None) -> dict[str, IndexPoint]:
    """The point every committed chunk should have, by chunk id (payload only)."""
    query = select(
        Chunk.id,
        Chunk.tenant_id,
        Chunk.source_id,
        Chunk.version,
        Chunk.chunk_hash,
        SourceVersion.valid_from_epoch,
        SourceVersion.valid_to_epoch,
    ).join(
        SourceVersion,
        (SourceVersion.tenant_id == Chunk.tenant_id)
        & (SourceVersion.source_id == Chunk.source_id)
        & (SourceVersion.version == Chunk.version),
    )
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


def cached_vectors(
    session: Session, model_id: str, hashes: Sequence[str], tenant_id: str | None = None
) -> dict[str, np.ndarray]:
    """Cached embeddings of ``model_id`` for the given chunk hashes (absent ones left out);
    with ``tenant_id``, only hashes of chunks that tenant already has."""
    hashes = sorted(set(hashes))
    found: dict[str, np.ndarray] = {}
    for start in range(0, len(hashes), 500):
        query = select(Embedding.chunk_hash, Embedding.vector).where(
            Embedding.model_id == model_id,
            Embedding.chunk_hash.in_(hashes[start : start + 500]),
        )
        if tenant_id is not None:
            owned = select(Chunk.id).where(
                Chunk.tenant_id == tenant_id, Chunk.chunk_hash == Embedding.chunk_hash
            )
            query = query.where(owned.exists())
        rows = session.execute(query)
        found.update({h: np.frombuffer(v, dtype=np.float32) for h, v in rows})
    return found


def _with_cached_vectors(
    session: Session, points: Sequence[IndexPoint], model_id: str
) -> list[IndexPoint]:
    cached = cached_vectors(session, model_id, [p.chunk_hash for p in points])
    return [
        IndexPoint(
            p.chunk_id,
            p.tenant_id,
            p.source_id,
            p.version,
            p.chunk_hash,
            p.valid_from,
            p.valid_to,
            vector=cached[p.chunk_hash],
        )
        for p in points
        if p.chunk_hash in cached
    ]

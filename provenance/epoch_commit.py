"""The truth store's only writer: ``commit`` applies one set of source changes as one epoch of
the tenant's, in the write order ``provenance/truth.py`` describes (plan, vectors, rows)."""

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from provenance.audit_log import append_version_events
from provenance.db import insert_missing
from provenance.models import (
    OPEN_EPOCH,
    Chunk,
    Epoch,
    EpochCounter,
    Source,
    SourceVersion,
    Tenant,
)
from provenance.snapshots import latest_versions
from provenance.vector_index import IndexPoint, VectorIndex
from provenance.versions import SessionFactory, SourceDraft, chunk_id
from provenance.writers_lock import writers_lock

CLOSE_STATUSES = ("deprecated", "deleted")


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
class _Plan:
    """The versions one commit opens (draft, version number) and closes (row, status)."""

    epoch: int
    opening: list[tuple[SourceDraft, int]] = field(default_factory=list)
    closing: list[tuple[SourceVersion, str]] = field(default_factory=list)

    def chunks(self, tenant_id: str) -> list[Chunk]:
        """The rows of the opened versions' chunks (not in any session yet)."""
        return [
            Chunk(
                id=chunk_id(tenant_id, draft.source_id, version, c.ordinal),
                tenant_id=tenant_id,
                source_id=draft.source_id,
                version=version,
                **asdict(c),
            )
            for draft, version in self.opening
            for c in draft.chunks
        ]


def ensure_tenant(session: Session, tenant_id: str) -> None:
    """Create the tenant row if it does not exist (safe against a concurrent creator)."""
    insert_missing(session, Tenant, [{"id": tenant_id, "name": tenant_id}])


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
    """Apply one set of changes as ONE epoch; see ``provenance/truth.py`` for the write order.

    ``upserts``: sources as they are now; identical content is unchanged, new content opens a
    version (closing the open one as superseded). ``closes``: ``(source_id, status)`` with status
    ``deprecated`` or ``deleted``; a source without an open version is left alone. ``vectors``
    maps every chunk hash of ``upserts`` to its embedding.
    """
    for _, status in closes:
        if status not in CLOSE_STATUSES:
            raise ValueError(f"a source is closed as one of {CLOSE_STATUSES}, not {status!r}")
    named = [d.source_id for d in upserts] + [source_id for source_id, _ in closes]
    if len(set(named)) != len(named):
        raise ValueError("a commit names each source at most once")
    result = CommitResult()
    # Leaving the session rolls back whatever was not committed, on any error.
    with writers_lock(sessions, tenant_id), sessions() as session:
        # 1. Plan in a read transaction; nothing is written yet.
        plan = _plan(session, tenant_id, upserts, closes, result)
        session.commit()  # ends the read transaction (nothing to write; rows stay loaded)
        if not plan.opening and not plan.closing:
            return result
        chunks = plan.chunks(tenant_id)
        # 2. Vectors first, with no transaction open: invisible until step 3 commits.
        vectors = vectors or {}
        index.upsert([
            IndexPoint(c.id, tenant_id, c.source_id, c.version, c.chunk_hash, plan.epoch,
                       vector=vectors[c.chunk_hash])
            for c in chunks
        ])
        index.flush()
        result.points_written = len(chunks)
        # 3. One short write transaction: the epoch, the rows, the audit leaves.
        _write_rows(session, tenant_id, plan, chunks, result.summary(), job_id)
        session.commit()
    result.epoch = plan.epoch
    # SQL is the truth from here on; the index catches up (and sweep finishes it after a crash).
    for row, _ in plan.closing:
        index.close_version(tenant_id, row.source_id, row.version, plan.epoch)
    return result


def close_source(
    sessions: SessionFactory, index: VectorIndex, tenant_id: str, source_id: str, status: str
) -> CommitResult:
    """Deprecate or delete a source: close its open version at a new epoch (a tombstone)."""
    return commit(sessions, index, tenant_id, closes=[(source_id, status)])


def _plan(
    session: Session,
    tenant_id: str,
    upserts: Sequence[SourceDraft],
    closes: Sequence[tuple[str, str]],
    result: CommitResult,
) -> _Plan:
    """What the commit changes, from the tenant's newest versions; sorts every named source
    into ``result``. The next epoch is the counter + 1: only a lock holder moves it."""
    plan = _Plan(epoch=_counter(session, tenant_id) + 1)
    latest = latest_versions(
        session, tenant_id, [d.source_id for d in upserts] + [s for s, _ in closes]
    )
    for draft in upserts:
        previous = latest.get(draft.source_id)
        is_open = previous is not None and previous.valid_to_epoch == OPEN_EPOCH
        if is_open and previous.content_hash == draft.content_hash:
            result.unchanged.append(draft.source_id)
            continue
        if is_open:
            plan.closing.append((previous, "superseded"))
            result.updated.append(draft.source_id)
        else:
            result.added.append(draft.source_id)
        plan.opening.append((draft, previous.version + 1 if previous is not None else 1))
    for source_id, status in closes:
        previous = latest.get(source_id)
        if previous is None or previous.valid_to_epoch != OPEN_EPOCH:
            continue
        plan.closing.append((previous, status))
        (result.deprecated if status == "deprecated" else result.deleted).append(source_id)
    return plan


def _write_rows(
    session: Session,
    tenant_id: str,
    plan: _Plan,
    chunks: list[Chunk],
    summary: dict[str, int],
    job_id: str | None,
) -> None:
    """Take the epoch and write the plan's versions, chunks and audit leaves (not committed)."""
    epoch = plan.epoch
    session.connection(execution_options={"sqlite_write": True})
    _take_epoch(session, tenant_id, epoch)
    ensure_tenant(session, tenant_id)
    session.add(Epoch(epoch=epoch, tenant_id=tenant_id, job_id=job_id, summary=summary))
    for row, status in plan.closing:
        row.status, row.valid_to_epoch = status, epoch
    _upsert_sources(session, tenant_id, [d for d, _ in plan.opening])
    opened = [
        SourceVersion(
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
        for draft, version in plan.opening
    ]
    session.add_all(opened)
    session.flush()
    session.add_all(chunks)
    append_version_events(
        session,
        tenant_id,
        [(row, "version_closed") for row, _ in plan.closing]
        + [(row, "version_opened") for row in opened],
    )


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


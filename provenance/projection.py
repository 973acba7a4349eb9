"""A process's embedded vector index as a projection of the truth layer, caught up by epoch.

The embedded index (Qdrant Edge) lives in one process's data directory and cannot be shared.
With several API replicas and Celery workers, the workers commit new versions to SQL and to
their own index; every API replica then brings its own index up to date from SQL alone:

* the epochs a tenant committed after the last one applied here name every change to what is
  visible, because versions are never rewritten, only opened (``valid_from``) and closed
  (``valid_to``) at an epoch;
* the vectors come from the embeddings cache, which ingestion fills before it commits, so
  catching up embeds nothing;
* writing a point or closing a version is idempotent, so applying an epoch twice (after a
  crash, or one this process also wrote itself) is harmless.

Epochs are counted per tenant here: what is applied is kept per tenant, and a tenant is caught
up to the newest epoch its ``epochs`` rows name (commits take epochs in order under the writers'
lock, so no older epoch can still be in flight). ``catch_up`` runs before every search, so a
question always sees every committed version; a background loop keeps the projections warm so
that the search rarely has work to do. What is applied survives a restart in a small file beside
the index (a lost file only costs re-applying every epoch once).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from provenance.embedding_cache import cached_vectors
from provenance.models import Chunk, Epoch, SourceVersion
from provenance.snapshots import chunk_points
from provenance.vector_index import IndexHit, IndexPoint, VectorIndex
from provenance.versions import SessionFactory

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CatchUp:
    """What one catch-up of one tenant applied."""

    tenant_id: str
    from_epoch: int
    to_epoch: int
    points_written: int
    versions_closed: int
    points_missing: int  # chunks whose vector is not in the embeddings cache for this model
    seconds: float


def latest_epochs(session: Session, tenant_id: str | None = None) -> dict[str, int]:
    """The newest committed epoch of each tenant (of one tenant when given)."""
    query = select(Epoch.tenant_id, func.max(Epoch.epoch)).where(Epoch.tenant_id.is_not(None))
    if tenant_id is not None:
        query = query.where(Epoch.tenant_id == tenant_id)
    return {tenant: int(epoch) for tenant, epoch in session.execute(query.group_by(Epoch.tenant_id))}


class IndexProjection:
    """Keeps ``index`` equal to what SQL committed, per tenant, for one embedding model."""

    def __init__(
        self,
        sessions: SessionFactory,
        index: VectorIndex,
        model_id: str,
        state_path: Path | None = None,
    ) -> None:
        self.sessions = sessions
        self.index = index
        self.model_id = model_id
        self.state_path = state_path
        self._applied: dict[str, int] = self._load()
        # One catch-up at a time: a request and the background loop must not apply the same
        # epochs twice over each other, and the watermark only ever moves forward.
        self._lock = threading.Lock()

    def _load(self) -> dict[str, int]:
        if self.state_path is None or not self.state_path.exists():
            return {}
        return {t: int(e) for t, e in json.loads(self.state_path.read_text()).items()}

    def _save(self) -> None:
        if self.state_path is None:
            return
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.state_path.with_suffix(".tmp")
        partial.write_text(json.dumps(self._applied, sort_keys=True))
        os.replace(partial, self.state_path)

    def applied(self, tenant_id: str) -> int:
        """The newest epoch of the tenant this index reflects."""
        return self._applied.get(tenant_id, 0)

    def catch_up(self, tenant_id: str, needed: int | None = None) -> CatchUp | None:
        """Apply the tenant's epochs committed since the last catch-up; None when there were none.
        Given the epoch a search ``needed``, nothing is asked of SQL once the index reflects it
        (later epochs only hide or add versions a search at that snapshot filters out)."""
        if needed is not None and needed <= self.applied(tenant_id):
            return None
        with self._lock, self.sessions() as session:
            target = latest_epochs(session, tenant_id).get(tenant_id, 0)
            applied = self.applied(tenant_id)
            if target <= applied:
                return None
            return self._apply(session, tenant_id, applied, target)

    def catch_up_all(self) -> list[CatchUp]:
        """Catch up every tenant that committed since its last catch-up."""
        with self.sessions() as session:
            behind = [t for t, e in sorted(latest_epochs(session).items()) if e > self.applied(t)]
        return [done for t in behind if (done := self.catch_up(t)) is not None]

    def _apply(self, session: Session, tenant_id: str, applied: int, target: int) -> CatchUp:
        start = time.perf_counter()
        # Payloads as SQL has them now: a version closed after ``target`` is already closed
        # here, which is what SQL says and what the next catch-up would write anyway.
        opened = session.execute(
            chunk_points().where(
                Chunk.tenant_id == tenant_id,
                SourceVersion.valid_from_epoch > applied,
                SourceVersion.valid_from_epoch <= target,
            )
        ).all()
        closed = session.execute(
            select(SourceVersion.source_id, SourceVersion.version, SourceVersion.valid_to_epoch).where(
                SourceVersion.tenant_id == tenant_id,
                SourceVersion.valid_to_epoch > applied,
                SourceVersion.valid_to_epoch <= target,
            )
        ).all()
        vectors = cached_vectors(session, self.model_id, [row[4] for row in opened])
        points = [
            IndexPoint(*row, vector=vectors[row[4]]) for row in opened if row[4] in vectors
        ]
        self.index.upsert(points)
        for source_id, number, valid_to in closed:
            self.index.close_version(tenant_id, source_id, number, valid_to)
        self.index.flush()
        missing = len(opened) - len(points)
        if missing:
            log.warning(
                "catch-up of tenant %s to epoch %d: %d chunks have no cached %s vector and stay "
                "out of this replica's index (re-ingest to embed them)",
                tenant_id, target, missing, self.model_id,
            )
        self._applied[tenant_id] = target
        self._save()
        return CatchUp(
            tenant_id, applied, target, len(points), len(closed), missing,
            time.perf_counter() - start,
        )


class CaughtUpSearch:
    """The search the API runs: the tenant's projection is brought up to date first, so a
    question sees every version committed before it was asked, on every replica. A search at
    a snapshot the index already reflects (the API resolved it from SQL a moment before) skips
    the query: the common case, and a session, a transaction and a statement per question."""

    def __init__(self, projection: IndexProjection) -> None:
        self.projection = projection

    def search(
        self, tenant_id: str, vector: np.ndarray, snapshot_epoch: int, limit: int
    ) -> Sequence[IndexHit]:
        self.projection.catch_up(tenant_id, needed=snapshot_epoch)
        return self.projection.index.search(tenant_id, vector, snapshot_epoch, limit)


class CatchUpLoop:
    """A daemon thread that catches every tenant up every ``interval_s`` seconds."""

    def __init__(self, projection: IndexProjection, interval_s: float) -> None:
        self.projection = projection
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="index-catch-up", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.projection.catch_up_all()
            except Exception:  # the database may be away for a moment: try again next tick
                log.exception("index catch-up failed; retrying in %.1f s", self.interval_s)

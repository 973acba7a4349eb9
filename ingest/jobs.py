"""Admin ingestion jobs and source administration: what the gateway's admin routes and the CLI call.

A job is a row in ``ingestion_jobs`` (state, progress, errors, summary) plus one run of
``run_ingestion_job``: as a Celery task on Redis when ``Settings.redis_url`` is set (see
``ingest.celery_app``), otherwise in this process (a bounded pool of ``Settings.ingest_workers``
threads, or inline with ``wait=True``). The run is idempotent: sources whose content is already the open version are
skipped, chunk ids and vector points are deterministic, and a job that already succeeded is not
run again, so a redelivered or re-run job converges to the same state.

Route map: ``POST /admin/ingest`` → ``submit_ingestion``; ``GET /admin/jobs/{id}`` → ``get_job``;
``GET /admin/sources`` → ``list_sources``; ``GET /admin/sources/{id}/versions`` →
``list_versions``; ``POST /admin/sources/{id}/deprecate`` → ``deprecate_source``;
``DELETE /admin/sources/{id}`` → ``delete_source``.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import datetime
from enum import StrEnum
from functools import cached_property, lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from ingest.chunking import Chunker
from ingest.embedding import Embedder, load_embedder
from ingest.loaders import Limits, LoadResult, load_bytes, load_paths
from ingest.pipeline import Cleanup, IndexProgress, chunker_for, index_sources
from provenance import truth, uploads
from provenance.db import get_sessionmaker, session_scope
from provenance.hashing import blake3_hex
from provenance.migrate import migrates_on_start, prepare_schema
from provenance.models import IngestionJob
from provenance.settings import Settings
from provenance.truth import SessionFactory, SourceInfo, VersionInfo
from provenance.vector_index import VectorIndex, open_vector_index

if TYPE_CHECKING:
    from celery import Celery

DEFAULT_BATCH_SIZE = 64


class JobState(StrEnum):
    # Member names are the stored values, so no adapter can store one for the other.
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"


TERMINAL_STATES = (JobState.succeeded, JobState.failed)


class JobNotFound(LookupError):
    pass


class SourceNotFound(LookupError):
    pass


@dataclass(frozen=True, slots=True)
class JobStatus:
    id: str
    tenant_id: str
    state: JobState
    created_at: datetime
    updated_at: datetime
    request: dict[str, Any]  # {"paths": [...], "cleanup": None | "full", "prefix": str, ...}
    total_sources: int
    done_sources: int
    chunks_embedded: int
    chunks_skipped: int
    errors: dict[str, str]  # source id -> reason
    # When done: added/updated/unchanged/deprecated/deleted/failed/skipped counts, the skipped
    # sources with their reasons, epochs, sweep report;
    # when failed: "error"; while queued in process or running: "runner" (host, boot, pid).
    summary: dict[str, Any]
    celery_task_id: str | None

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL_STATES

    @classmethod
    def of(cls, row: IngestionJob) -> JobStatus:
        return cls(
            id=row.id,
            tenant_id=row.tenant_id,
            state=JobState(row.state),
            created_at=row.created_at,
            updated_at=row.updated_at,
            request=dict(row.request or {}),
            total_sources=row.total_sources,
            done_sources=row.done_sources,
            chunks_embedded=row.chunks_embedded,
            chunks_skipped=row.chunks_skipped,
            errors=dict(row.errors or {}),
            summary=dict(row.summary or {}),
            celery_task_id=row.celery_task_id,
        )


@dataclass(frozen=True, slots=True)
class SourceChange:
    """The outcome of deprecating or deleting a source."""

    tenant_id: str
    source_id: str
    status: str  # the newest version's status afterwards
    changed: bool  # False when the source had no open version to close
    epoch: int | None  # the epoch that closed it (None when nothing changed)


class Runtime:
    """What ingestion runs on: the settings, the database sessions, the embedder, the vector
    index it writes, the chunker that fits the embedder and the broker's producer. One per
    process, passed to every job: the API hands its own (the embedder and index it answers
    with); a worker or the CLI builds one from its settings, each part loaded on first use."""

    def __init__(
        self, settings: Settings, embedder: Embedder | None = None, index: VectorIndex | None = None
    ) -> None:
        self.settings = settings
        if embedder is not None:
            self.embedder = embedder
        if index is not None:
            self.index = index

    @cached_property
    def sessions(self) -> SessionFactory:
        return get_sessionmaker(_url(self.settings))

    @cached_property
    def embedder(self) -> Embedder:
        return load_embedder(self.settings)

    @cached_property
    def index(self) -> VectorIndex:
        return open_vector_index(self.settings, self.embedder.dim)

    @cached_property
    def chunker(self) -> Chunker:
        return chunker_for(self.embedder, self.settings)

    @cached_property
    def producer(self) -> Celery:
        """Sends jobs to the Celery workers (with ``Settings.redis_url``); Celery is imported
        only by a process that sends."""
        from ingest.broker import configured_celery

        return configured_celery(self.settings)


@lru_cache(maxsize=8)
def _schema_ready(url: str, migrate: bool) -> bool:
    prepare_schema(url, migrate)
    return True


# ---------------------------------------------------------------------------------------------
# Jobs
# ---------------------------------------------------------------------------------------------


def submit_ingestion(
    runtime: Runtime,
    tenant_id: str,
    paths: Sequence[str | Path],
    cleanup: Cleanup = None,
    *,
    prefix: str = "",
    batch_size: int = DEFAULT_BATCH_SIZE,
    wait: bool = False,
) -> str:
    """Queue an ingestion of files and folders for a tenant; return the job id.

    ``cleanup="full"`` also deletes (tombstones) the tenant's sources under ``prefix`` that the
    paths no longer contain. Paths are resolved here and must be readable where the job runs.
    With Redis configured the job goes to the Celery workers; otherwise it runs in this process,
    in a background thread, or before returning when ``wait`` is true. With Celery, ``wait``
    polls the job row until the job finishes.
    """
    request = {"paths": [str(Path(p).resolve()) for p in paths]}
    return _submit(runtime, tenant_id, request, [], cleanup, prefix, batch_size, wait)


def submit_upload_ingestion(
    runtime: Runtime,
    tenant_id: str,
    files: Sequence[tuple[str, bytes]],
    cleanup: Cleanup = None,
    *,
    prefix: str = "",
    batch_size: int = DEFAULT_BATCH_SIZE,
    wait: bool = False,
) -> str:
    """Queue an ingestion of uploaded files, each ``(name, bytes)``; the source id is
    ``prefix + name``. The bytes are stored with the job, in one transaction, in the database:
    any worker can run it, and no file on this machine is involved."""
    uploads = [{"name": name, "blake3": blake3_hex(data), "size": len(data)} for name, data in files]
    request = {"uploads": uploads}
    return _submit(
        runtime, tenant_id, request, [data for _, data in files], cleanup, prefix, batch_size, wait
    )


def _submit(
    runtime: Runtime,
    tenant_id: str,
    request: dict[str, Any],
    blobs: Sequence[bytes],
    cleanup: Cleanup,
    prefix: str,
    batch_size: int,
    wait: bool,
) -> str:
    if cleanup not in (None, "full"):
        raise ValueError(f"cleanup must be None or 'full', not {cleanup!r}")
    job_id = uuid.uuid4().hex
    request = {**request, "cleanup": cleanup, "prefix": prefix, "batch_size": batch_size}
    with session_scope(_url(runtime.settings)) as session:
        truth.ensure_tenant(session, tenant_id)
        for data in blobs:
            uploads.store(session, tenant_id, data)
        session.add(IngestionJob(id=job_id, tenant_id=tenant_id, state=JobState.queued, request=request))
    _dispatch(runtime, job_id, wait)
    return job_id


def rerun_job(runtime: Runtime, job_id: str, *, wait: bool = False) -> None:
    """Run a job again (after a worker died under it, say); it converges to the same state."""
    if get_job(runtime.settings, job_id) is None:
        raise JobNotFound(job_id)
    _update_job(runtime.settings, job_id, state=JobState.queued)
    _dispatch(runtime, job_id, wait)


def _dispatch(runtime: Runtime, job_id: str, wait: bool) -> None:
    settings = runtime.settings
    if settings.redis_url:
        from ingest.broker import INGEST_TASK

        task = runtime.producer.send_task(INGEST_TASK, args=[job_id])
        _update_job(settings, job_id, celery_task_id=task.id)
        if wait:
            wait_for_job(settings, job_id)
    elif wait:
        run_ingestion_job(runtime, job_id)
    else:
        # Claimed by this process while queued in its pool, so a restart can tell it was lost.
        _update_job(settings, job_id, summary={"runner": runner()})
        _pool(settings.ingest_workers).submit(_run_quietly, runtime, job_id)


@lru_cache(maxsize=4)
def _pool(workers: int) -> ThreadPoolExecutor:
    """The bounded pool in-process jobs run on (``Settings.ingest_workers`` threads); jobs
    beyond it wait, queued."""
    return ThreadPoolExecutor(workers, thread_name_prefix="inherent-ingest")


def _run_quietly(runtime: Runtime, job_id: str) -> None:
    # The job row records the failure; a pool thread has no one to raise to.
    try:
        run_ingestion_job(runtime, job_id)
    except Exception:
        return


def _process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (None: no such process)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22, counted after the command name


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def runner() -> dict[str, Any]:
    """This process, as a job row records who holds it (queued in process, or running), so a
    later start can tell a job whose process died under it (same host: the pid is gone or
    reused, or the machine rebooted) from one another live process holds."""
    pid = os.getpid()
    return {
        "host": socket.gethostname(),
        "boot": _boot_id(),
        "pid": pid,
        "start": _process_start(pid),
    }


def _runner_is_dead(holder: dict[str, Any]) -> bool:
    if holder.get("host") != socket.gethostname():
        return False  # another machine's process: not ours to judge
    if holder.get("boot") != _boot_id():
        return True
    return _process_start(int(holder.get("pid", 0))) != holder.get("start")


def fail_orphaned_jobs(settings: Settings) -> list[str]:
    """Mark failed, with the reason, every queued or running job whose runner on this host has
    died (the gateway calls this at start, the Celery worker when it is ready); return their
    ids. ``rerun_job`` runs one again; Celery also redelivers an unacknowledged job by itself."""
    orphaned = []
    with session_scope(_url(settings), write=True) as session:
        rows = session.scalars(
            select(IngestionJob).where(IngestionJob.state.in_((JobState.queued, JobState.running)))
        )
        for row in rows:
            holder = (row.summary or {}).get("runner")
            if not holder or not _runner_is_dead(holder):
                continue
            row.summary = {
                "error": (
                    f"the process that held this job (pid {holder.get('pid')} on "
                    f"{holder.get('host')}) exited while it was {row.state}; run it again"
                ),
                "runner": holder,
            }
            row.state = JobState.failed
            orphaned.append(row.id)
    return orphaned


def get_job(settings: Settings, job_id: str) -> JobStatus | None:
    with session_scope(_url(settings)) as session:
        row = session.get(IngestionJob, job_id)
        return JobStatus.of(row) if row is not None else None


def list_jobs(settings: Settings, tenant_id: str | None = None, limit: int = 50) -> list[JobStatus]:
    """The newest jobs first."""
    query = select(IngestionJob).order_by(IngestionJob.created_at.desc()).limit(limit)
    if tenant_id is not None:
        query = query.where(IngestionJob.tenant_id == tenant_id)
    with session_scope(_url(settings)) as session:
        return [JobStatus.of(row) for row in session.scalars(query)]


def wait_for_job(
    settings: Settings, job_id: str, timeout_s: float = 3600, poll_s: float = 0.2
) -> JobStatus:
    """Poll until the job succeeds or fails; TimeoutError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = get_job(settings, job_id)
        if status is None:
            raise JobNotFound(job_id)
        if status.finished:
            return status
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} still {status.state} after {timeout_s:.0f}s")
        time.sleep(poll_s)


def run_ingestion_job(runtime: Runtime, job_id: str) -> JobStatus:
    """The task body, the same under Celery and in process: load the paths, index them, sweep
    the tenant's vectors, record the outcome. A job that already succeeded returns at once."""
    settings = runtime.settings
    with session_scope(_url(settings)) as session:
        row = session.get(IngestionJob, job_id)
        if row is None:
            raise JobNotFound(job_id)
        if row.state == JobState.succeeded:
            return JobStatus.of(row)
        tenant_id, request = row.tenant_id, dict(row.request)
    # A fresh attempt recounts from zero: what an earlier attempt committed shows up as unchanged.
    _update_job(
        settings,
        job_id,
        state=JobState.running,
        done_sources=0,
        total_sources=0,
        chunks_embedded=0,
        chunks_skipped=0,
        errors={},
        summary={"runner": runner()},
    )
    try:
        loaded = _load(settings, tenant_id, request)

        def progress(p: IndexProgress) -> None:
            _update_job(
                settings,
                job_id,
                total_sources=p.total,
                done_sources=p.done,
                chunks_embedded=p.chunks_embedded,
                chunks_skipped=p.chunks_skipped,
                errors=p.errors,
            )

        result = index_sources(
            loaded.documents,
            failures=loaded.failures,
            skipped=loaded.skipped,
            tenant_id=tenant_id,
            sessions=runtime.sessions,
            embedder=runtime.embedder,
            index=runtime.index,
            chunker=runtime.chunker,
            cleanup=request.get("cleanup"),
            cleanup_prefix=request.get("prefix", ""),
            progress=progress,
            batch_size=int(request.get("batch_size", DEFAULT_BATCH_SIZE)),
            job_id=job_id,
        )
        swept = truth.sweep(runtime.sessions, runtime.index, tenant_id, model_id=runtime.embedder.model_id)
        runtime.index.optimize()
    except Exception as error:
        _update_job(
            settings, job_id, state=JobState.failed, summary={"error": f"{type(error).__name__}: {error}"}
        )
        raise
    summary = {
        **result.counts(),
        "skipped_sources": result.skips,
        "epochs": result.epochs,
        "sweep": asdict(swept),
    }
    # Success and the release of the uploaded bytes commit together: a client that sees
    # "succeeded" never finds the bytes still stored, and a crash before it keeps them for a retry.
    with session_scope(_url(settings), write=True) as session:
        status = _set_job(session, job_id, state=JobState.succeeded, errors=result.errors,
                          summary=summary)
        if "uploads" in request:
            uploads.release(
                session, tenant_id, [u["blake3"] for u in request["uploads"]], job_id
            )
    return status


def _load(settings: Settings, tenant_id: str, request: dict[str, Any]) -> LoadResult:
    prefix, limits = request.get("prefix", ""), Limits.of(settings)
    if "uploads" not in request:
        return load_paths(request["paths"], limits=limits, prefix=prefix)
    loaded = LoadResult()
    with session_scope(_url(settings)) as session:
        for upload in request["uploads"]:
            data = uploads.read(session, tenant_id, upload["blake3"])
            loaded.extend(
                load_bytes(
                    upload["name"],
                    data,
                    prefix + upload["name"],
                    f"upload:{upload['name']}",
                    limits=limits,
                    id_prefix=prefix,
                )
            )
    return loaded


def note_retry(
    settings: Settings, job_id: str, error: BaseException, attempt: int, delay_s: float
) -> None:
    """Record that a run failed for a transient reason and is queued again."""
    _update_job(
        settings,
        job_id,
        state=JobState.queued,
        summary={
            "error": f"{type(error).__name__}: {error}",
            "retry": attempt,
            "retry_in_s": round(delay_s, 1),
        },
    )


def _update_job(settings: Settings, job_id: str, **values: Any) -> JobStatus:
    # A write transaction from its BEGIN: on SQLite a read that upgrades to a write fails at
    # once (no busy wait) when another job committed meanwhile.
    with session_scope(_url(settings), write=True) as session:
        return _set_job(session, job_id, **values)


def _set_job(session: Session, job_id: str, **values: Any) -> JobStatus:
    row = session.get(IngestionJob, job_id)
    if row is None:
        raise JobNotFound(job_id)
    for name, value in values.items():
        setattr(row, name, value)
    session.flush()
    return JobStatus.of(row)


def _url(settings: Settings) -> str:
    """The database URL, its schema checked (or brought to head where this process may
    migrate: ``provenance.migrate.ready_schema``), the embedded data dir created."""
    if not settings.database_url:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
    _schema_ready(settings.sqlalchemy_url, migrates_on_start(settings))
    return settings.sqlalchemy_url


# ---------------------------------------------------------------------------------------------
# Sources
# ---------------------------------------------------------------------------------------------


def list_sources(settings: Settings, tenant_id: str) -> list[SourceInfo]:
    """Every source of the tenant, deleted ones included, with its newest version."""
    with session_scope(_url(settings)) as session:
        return truth.list_sources(session, tenant_id)


def list_versions(settings: Settings, tenant_id: str, source_id: str) -> list[VersionInfo]:
    """A source's versions, oldest first; SourceNotFound when the tenant has no such source."""
    with session_scope(_url(settings)) as session:
        versions = truth.list_versions(session, tenant_id, source_id)
    if not versions:
        raise SourceNotFound(source_id)
    return versions


def deprecate_source(runtime: Runtime, tenant_id: str, source_id: str) -> SourceChange:
    """Close the source's open version as deprecated at a new epoch; history stays replayable."""
    return _close(runtime, tenant_id, source_id, "deprecated")


def delete_source(runtime: Runtime, tenant_id: str, source_id: str) -> SourceChange:
    """Close the source's open version as deleted (a tombstone); history stays replayable."""
    return _close(runtime, tenant_id, source_id, "deleted")


def _close(runtime: Runtime, tenant_id: str, source_id: str, status: str) -> SourceChange:
    result = truth.close_source(runtime.sessions, runtime.index, tenant_id, source_id, status)
    with runtime.sessions() as session:
        versions = truth.list_versions(session, tenant_id, source_id)
    if not versions:
        raise SourceNotFound(source_id)
    return SourceChange(
        tenant_id, source_id, versions[-1].status, result.epoch is not None, result.epoch
    )

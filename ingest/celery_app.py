"""The ingestion worker: ``celery -A ingest.celery_app worker --pool=solo``.

The worker reads the same Settings (``INHERENT_*`` environment) as the API and runs
``ingest.jobs.run_ingestion_job``, the function the embedded default runs in process, on one
runtime (its model, index and sessions, loaded at its first job). The queue's delivery rules are
``ingest.broker``'s. Running a job twice is safe because the job is idempotent. Database and
broker hiccups are retried with exponential backoff.

A worker refuses to start on a database whose schema is not its release's (unless told to
migrate: ``INHERENT_MIGRATE_ON_START``). Each worker and API process has its own data directory:
a worker writes its own embedded index, and the API replicas catch theirs up from the truth
layer (``provenance.projection``), or all of them share a Qdrant server (``INHERENT_QDRANT_URL``).
"""

from __future__ import annotations

import contextlib
import random
import threading

from celery import Celery
from celery.signals import worker_init, worker_ready, worker_shutdown
from sqlalchemy.exc import DBAPIError, OperationalError

from ingest import jobs
from ingest.broker import INGEST_TASK, configured_celery
from provenance.migrate import SchemaMismatch, ready_schema
from provenance.settings import Settings, get_settings
from provenance.vector_index import close_vector_indexes

MAX_RETRIES = 5
BACKOFF_BASE_S = 5.0
BACKOFF_MAX_S = 300.0
# After the visibility timeout, the broker restores unacknowledged messages within a few
# seconds (ingest/broker.py): the orphan sweep waits that long too.
ORPHAN_SWEEP_MARGIN_S = 15.0
# Failures worth another attempt: the database or the broker went away for a moment.
TRANSIENT_ERRORS = (OperationalError, DBAPIError, ConnectionError, TimeoutError)


def backoff_s(retries: int) -> float:
    """Exponential backoff with full jitter: up to 5 s, 10 s, 20 s, ... capped at 300 s."""
    return random.uniform(0, min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2**retries))


def make_celery(settings: Settings) -> Celery:
    """The worker's app: the broker's configuration and the ingestion task, which runs every job
    on this worker's runtime."""
    app = configured_celery(settings)
    runtime = jobs.Runtime(settings)

    @app.task(name=INGEST_TASK, bind=True, max_retries=MAX_RETRIES, shared=False)
    def ingest(self, job_id: str) -> None:
        try:
            jobs.run_ingestion_job(runtime, job_id)
        except TRANSIENT_ERRORS as error:
            if self.request.retries >= MAX_RETRIES:
                raise
            delay = backoff_s(self.request.retries)
            # The database may be what is down: recording the retry is best effort.
            with contextlib.suppress(*TRANSIENT_ERRORS):
                jobs.note_retry(
                    settings, job_id, error, attempt=self.request.retries + 1, delay_s=delay
                )
            raise self.retry(exc=error, countdown=delay) from error

    return app


# What `celery -A ingest.celery_app worker` runs: the app for this process's environment.
app = make_celery(get_settings())


@worker_init.connect
def _check_schema(**_: object) -> None:
    # A worker on a schema behind its code would fail every job: refuse to start instead.
    # SystemExit, not an exception: Celery logs and ignores exceptions raised by signal handlers.
    try:
        ready_schema(get_settings())
    except SchemaMismatch as exc:
        raise SystemExit(f"inherent worker: {exc}") from exc


@worker_shutdown.connect
def _close_indexes(**_: object) -> None:
    # Flush and release the embedded index so the next process can open it.
    close_vector_indexes()


@worker_ready.connect
def _fail_orphaned_jobs(**_: object) -> None:
    # A job a dead worker held is still in the broker, unacknowledged: it is handed to a live
    # worker once the visibility timeout passes, and that run records its own runner. Only a job
    # still held by a dead runner after that (its message lost, e.g. with a Redis that keeps
    # nothing) is marked failed; failing it at once would show "failed" before the retry runs.
    settings = get_settings()
    sweep = threading.Timer(settings.celery_visibility_timeout + ORPHAN_SWEEP_MARGIN_S,
                            jobs.fail_orphaned_jobs, [settings])
    sweep.daemon = True
    sweep.start()

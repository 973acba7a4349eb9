"""Celery on Redis as both ends of the ingestion queue configure it: the producer
(``ingest.jobs`` sends job ids) and the worker (``ingest.celery_app`` runs them).

Messages are acknowledged only after the task returns and are given back when a worker dies
under one (``task_acks_late``, ``task_reject_on_worker_lost``), so a job is never lost: a message
whose worker was killed outright stays unacknowledged in Redis, and a live worker puts it back on
the queue once ``Settings.celery_visibility_timeout`` has passed (it looks every few seconds).
Each deployment (``Settings.collection``) has its own queue.
"""

from celery import Celery

from provenance.settings import Settings

INGEST_TASK = "inherent.ingest"


def queue_name(settings: Settings) -> str:
    return f"inherent.ingest.{settings.collection}"


def configured_celery(settings: Settings) -> Celery:
    """A Celery app on the settings' broker and queue, with no task of its own."""
    app = Celery("inherent", broker=settings.redis_url or "memory://", set_as_current=False)
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_default_queue=queue_name(settings),
        task_ignore_result=True,
        task_serializer="json",
        accept_content=["json"],
        broker_connection_retry_on_startup=True,
        broker_transport_options={
            "visibility_timeout": settings.celery_visibility_timeout,
            # Sweep for expired messages at every interval (kombu's default only scans every
            # tenth, ~100 s), at most every 10 s and at least 4 times per timeout.
            "unacked_restore_interval": max(0.5, min(10.0, settings.celery_visibility_timeout / 4)),
            "unacked_restore_throttle": 1,
        },
        # A broker restart must not cancel the job in hand: it finishes and records its outcome
        # in the database (the job row is the truth); the worker reconnects afterwards.
        worker_cancel_long_running_tasks_on_connection_loss=False,
        worker_hijack_root_logger=False,
    )
    return app

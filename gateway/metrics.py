"""Prometheus metrics of the provenance side: retrieval (observed as requests run) and ingestion
(read from the database at scrape time, so they count the jobs of every process -- in-process
jobs and Celery workers alike -- and agree across API replicas)."""

import logging

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from sqlalchemy import func, select
from sqlalchemy.exc import SQLAlchemyError

from provenance.db import session_scope
from provenance.models import OPEN_EPOCH, Chunk, IngestionJob, SourceVersion

log = logging.getLogger("inherent.metrics")


class GatewayMetrics:
    """Retrieval per request, and the receipts written."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.receipts = Counter(
            "inherent:receipts", "Receipts written, by status (ok, failed)", ["status"],
            registry=registry,
        )
        self.latency = Histogram(
            "inherent:retrieval_duration_seconds",
            "Retrieval time per request: query embedding and vector search",
            ["stage"],
            registry=registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
        )
        self.chunks = Histogram(
            "inherent:retrieval_chunks",
            "Chunks per request: found by the search, and kept in the prompt's budget",
            ["stage"],
            registry=registry,
            buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 32),
        )

    def observe(self, embed: float, search: float, found: int, kept: int) -> None:
        self.latency.labels("embed").observe(embed)
        self.latency.labels("search").observe(search)
        self.chunks.labels("found").observe(found)
        self.chunks.labels("kept").observe(kept)


class IngestionCollector:
    """Ingestion totals, counted in the database when Prometheus scrapes."""

    def __init__(self, database_url: str) -> None:
        self.database_url = database_url

    def describe(self):
        return []  # collected at scrape time only: registering must not query

    def collect(self):
        # The engine's metrics must survive a database outage: report it instead of failing.
        try:
            yield from self._collect()
        except SQLAlchemyError as exc:
            log.warning("ingestion metrics unavailable: %s", exc)
            yield GaugeMetricFamily("inherent:ingestion_metrics_up",
                                    "Whether the ingestion counts could be read", value=0)

    def _collect(self):
        with session_scope(self.database_url) as session:
            jobs = session.execute(
                select(IngestionJob.state, func.count()).group_by(IngestionJob.state)
            ).all()
            embedded, reused = session.execute(
                select(
                    func.coalesce(func.sum(IngestionJob.chunks_embedded), 0),
                    func.coalesce(func.sum(IngestionJob.chunks_skipped), 0),
                )
            ).one()
            sources = session.execute(
                select(SourceVersion.status, func.count())
                .where(SourceVersion.valid_to_epoch == OPEN_EPOCH)
                .group_by(SourceVersion.status)
            ).all()
            chunks = session.scalar(select(func.count()).select_from(Chunk))
        by_state = GaugeMetricFamily(
            "inherent:ingestion_jobs", "Ingestion jobs by state", labels=["state"]
        )
        for state, count in jobs:
            by_state.add_metric([state], count)
        yield by_state
        open_sources = GaugeMetricFamily(
            "inherent:ingestion_sources", "Sources with an open version, by status",
            labels=["status"],
        )
        for status, count in sources:
            open_sources.add_metric([status], count)
        yield open_sources
        yield GaugeMetricFamily("inherent:ingestion_chunks", "Chunks stored (every version)",
                                value=chunks or 0)
        yield CounterMetricFamily("inherent:ingestion_chunks_embedded",
                                  "Chunks embedded by ingestion jobs", value=embedded)
        yield CounterMetricFamily(
            "inherent:ingestion_embeddings_reused",
            "Chunks whose embedding was already cached (same text, same model)", value=reused,
        )
        yield GaugeMetricFamily("inherent:ingestion_metrics_up",
                                "Whether the ingestion counts could be read", value=1)

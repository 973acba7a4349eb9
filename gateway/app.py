"""The FastAPI application: routes grouped by audience, one error body, metrics on every route."""

import gc
import logging
import time
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.auth import ensure_key
from gateway.drain import Drain, DrainMiddleware
from gateway.errors import install_error_handlers
from gateway.guard import RequestGuard
from gateway.metrics import IngestionCollector
from gateway.quotas import quotas_for
from gateway.request_context import RequestIds
from gateway.routes import (
    admin,
    chat,
    completions,
    embeddings,
    health,
    receipts,
    review,
    tokenize,
)
from gateway.schemas import ERROR_RESPONSES
from gateway.services import Services
from gateway.settings import ServerSettings
from gateway.tracing import get_tracer, tracer_provider_for
from ingest import jobs
from provenance.db import session_scope
from provenance.migrate import ready_schema
from provenance.settings import get_settings

log = logging.getLogger("inherent.app")


def create_app(
    settings: ServerSettings | None = None,
    services_factory: Callable[[ServerSettings, CollectorRegistry], Services] | None = None,
    tracer_provider=None,
) -> FastAPI:
    """Build the app. Services (model, embedder, index) load in the lifespan, so importing is cheap;
    tests pass their own ``services_factory`` (and a ``tracer_provider`` to read spans back)."""
    settings = settings or get_settings(ServerSettings)
    registry = CollectorRegistry()
    tracer_provider = tracer_provider or tracer_provider_for(settings.otel_endpoint)
    registry.register(IngestionCollector(settings.sqlalchemy_url))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        ready_schema(settings)
        for job_id in jobs.fail_orphaned_jobs(settings):
            log.warning("ingestion job %s was left by a process that died: marked failed", job_id)
        if settings.bootstrap_api_key:
            with session_scope(settings.sqlalchemy_url, write=True) as session:
                ensure_key(session, settings.api_key_tenant, settings.bootstrap_api_key)
        if services_factory is None:
            from gateway.services import build_services

            app.state.services = build_services(settings, registry)
        else:
            app.state.services = services_factory(settings, registry)
        app.state.services.tracer = get_tracer(tracer_provider)
        await app.state.services.start()
        # What startup made lives as long as the process (the model, tokenizers, modules: about
        # 475,000 objects), and a full collection walks all of it while every thread waits for
        # the GIL: 303-313 ms after 30 answers (Zen 3 kind), a stall of every stream. Frozen,
        # they are out of every collection's walk: the same full collection took 0.65-1.9 ms.
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            gc.unfreeze()  # a process that starts another app (tests) collects this one's cycles
            await app.state.services.stop()
            if tracer_provider is not None:
                tracer_provider.shutdown()  # flushes the spans still batched

    docs = settings.api_docs
    app = FastAPI(
        title="Inherent",
        version="0.1.0",
        lifespan=lifespan,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
    )
    app.state.settings = settings
    app.state.registry = registry
    app.state.drain = Drain(settings.shutdown_grace_s)
    app.add_middleware(DrainMiddleware, drain=app.state.drain)
    app.state.quotas = quotas_for(
        settings.tenant_max_concurrent_requests,
        settings.tenant_requests_per_minute,
        settings.redis_url,
    )
    install_error_handlers(app)
    app.add_middleware(RequestGuard, settings=settings)
    app.add_middleware(HttpMetrics, registry=registry)
    app.add_middleware(RequestIds)  # added last: the outermost middleware, so every response has it
    for module in (chat, completions, embeddings, tokenize, receipts, admin, health):
        app.include_router(module.router, responses=ERROR_RESPONSES)
    app.mount("/review", review.console_app(), name="review")
    return app


HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class HttpMetrics:
    """ASGI middleware: requests by route and status, latency to the first response byte.
    Plain ASGI for the reason gateway/request_context.py gives."""

    def __init__(self, app: ASGIApp, registry: CollectorRegistry) -> None:
        self.app = app
        self.requests = Counter(
            "inherent:http_requests",
            "HTTP requests by route and status",
            ["method", "route", "status"],
            registry=registry,
        )
        self.latency = Histogram(
            "inherent:http_request_duration_seconds",
            "HTTP request latency to the first response byte",
            ["method", "route"],
            registry=registry,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()

        async def observe(message: Message) -> None:
            if message["type"] == "http.response.start":
                path = getattr(scope.get("route"), "path", "unmatched")
                # A fixed set of label values: clients must not mint series with odd methods.
                method = scope["method"] if scope["method"] in HTTP_METHODS else "other"
                self.requests.labels(method, path, str(message["status"])).inc()
                self.latency.labels(method, path).observe(time.perf_counter() - start)
            await send(message)

        await self.app(scope, receive, observe)

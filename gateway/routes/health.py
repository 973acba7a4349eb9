"""Liveness, readiness and the Prometheus exposition (engine metrics plus HTTP ones)."""

from hmac import compare_digest
from importlib.metadata import version as package_version

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text

from gateway.auth import AuthError, check_key, require
from provenance.db import get_engine

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> dict:
    return {"status": "ok"}


@router.get("/health")
def health(request: Request) -> Response:
    """vLLM's health check (load generators such as guidellm call it first): 200 while the
    engine serves, 503 while it is not loaded or has stopped. The body says the same in the
    JSON the OpenAPI document promises."""
    services = getattr(request.app.state, "services", None)
    serving = services is not None and services.healthy()
    return JSONResponse(
        {"status": "ok" if serving else "unavailable"}, status_code=200 if serving else 503
    )


@router.get("/version")
def version() -> dict:
    return {"version": package_version("inherent")}


@router.get("/readyz")
def readyz(request: Request) -> JSONResponse:
    services = getattr(request.app.state, "services", None)
    checks = {"engine": services is not None and services.healthy()}
    # A draining replica (SIGTERM, gateway/drain.py) leaves the load balancer's rotation.
    checks["accepting"] = not request.app.state.drain.draining
    try:
        with get_engine(request.app.state.settings.sqlalchemy_url).connect() as connection:
            connection.execute(text("SELECT 1"))
        checks["database"] = True
    except Exception:
        checks["database"] = False
    ready = all(checks.values())
    return JSONResponse(
        {"status": "ready" if ready else "not ready", "checks": checks},
        status_code=200 if ready else 503,
    )


@router.get("/metrics", response_class=PlainTextResponse)
def metrics(request: Request) -> Response:
    """Prometheus exposition. Queue depths and latencies describe every tenant's load, so
    strangers get none of it: with a metrics token set only the operator's scraper (that
    token) reads it, otherwise any key with the `audit` scope does (SECURITY.md)."""
    settings = request.app.state.settings
    scheme, _, secret = request.headers.get("authorization", "").partition(" ")
    secret = secret.strip() if scheme.lower() == "bearer" else ""
    if settings.metrics_token:
        if not compare_digest(secret.encode(), settings.metrics_token.encode()):
            raise AuthError("/metrics needs the metrics token: send 'Authorization: Bearer <token>'")
    else:
        require(check_key(settings.sqlalchemy_url, secret), "audit")
    return Response(generate_latest(request.app.state.registry), media_type=CONTENT_TYPE_LATEST)

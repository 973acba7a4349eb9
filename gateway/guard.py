"""The request guard: the key first, then a bounded body, before any route reads a byte.

An ASGI middleware rather than a FastAPI dependency, because FastAPI reads and parses the body
before it resolves dependencies: a stranger could otherwise make the server read and parse a
large body, and learn from the 400 what a valid one looks like, without any key.
"""

from typing import Any

from sqlalchemy.exc import DBAPIError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.auth import AuthError, check_key
from gateway.errors import APIError, auth_error, database_error
from provenance.settings import Settings

# Routes that need an API key; the rest (health, metrics, docs, the review page) do not.
KEYED_PREFIXES = ("/v1/", "/admin/")
BODYLESS_METHODS = ("GET", "HEAD", "OPTIONS", "DELETE")


class BodyTooLarge(HTTPException):
    """Raised while a route reads the body; an HTTPException, so FastAPI's body parsing lets
    it through as itself (any other error there becomes a 400)."""

    def __init__(self, limit: int):
        super().__init__(413, f"the request body is over the {limit}-byte limit")


def too_large(limit: int) -> APIError:
    return APIError(413, BodyTooLarge(limit).detail, code="request_too_large")


def bearer(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, secret = value.decode("latin-1").partition(" ")
            return secret.strip() if scheme.lower() == "bearer" else None
    return None


def declared_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class RequestGuard:
    def __init__(self, app: ASGIApp, settings: Settings):
        self.app = app
        self.settings = settings

    def body_limit(self, scope: Scope) -> int:
        content_type = dict(scope["headers"]).get(b"content-type", b"")
        if scope["path"] == "/admin/ingest" and content_type.startswith(b"multipart/"):
            return self.settings.max_upload_body_bytes
        return self.settings.max_json_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope["path"].startswith(KEYED_PREFIXES):
            try:
                principal = await run_in_threadpool(
                    check_key, self.settings.sqlalchemy_url, bearer(scope)
                )
            except AuthError as exc:
                return await auth_error(exc).response()(scope, receive, send)
            except DBAPIError as exc:  # the database is down: 503 and Retry-After, as in routes
                return await database_error(exc).response()(scope, receive, send)
            scope.setdefault("state", {})["principal"] = principal
        if scope["method"] in BODYLESS_METHODS:
            return await self.app(scope, receive, send)
        limit = self.body_limit(scope)
        length = declared_length(scope)
        if length is not None and length > limit:
            return await too_large(limit).response()(scope, receive, send)
        await self.app(scope, counting(receive, limit), send)


def counting(receive: Receive, limit: int) -> Receive:
    """`receive` that stops a body sent without (or with a false) Content-Length at the limit."""
    received = 0

    async def guarded() -> Message:
        nonlocal received
        message: dict[str, Any] = await receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > limit:
                raise BodyTooLarge(limit)
        return message

    return guarded

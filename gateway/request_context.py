"""Request ids and logs: ``X-Request-Id`` is taken from the client (or made here), returned on
every response, stored in the receipt and carried by every log line written while the request
runs; logs are plain text or one JSON object per line."""

import json
import logging
import re
import uuid
from contextvars import ContextVar

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = "X-Request-Id"
# What a client may send: printable, no spaces, short (it lands in logs and receipts).
_ACCEPTED = re.compile(r"[\x21-\x7e]{1,128}")

current_request_id: ContextVar[str | None] = ContextVar("inherent_request_id", default=None)


def request_id_of(value: str | None) -> str:
    """The client's id when it is acceptable, else a fresh one."""
    return value if value and _ACCEPTED.fullmatch(value) else uuid.uuid4().hex


class RequestIds:
    """ASGI middleware: the request's id in ``request.state``, in the logging context while the
    request runs (its streamed body too) and on every response it starts.

    Plain ASGI, not ``@app.middleware("http")``: Starlette's BaseHTTPMiddleware relays each
    body chunk through a memory stream between two tasks, a cost every streamed token paid."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_of(Headers(scope=scope).get(HEADER))
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[HEADER] = request_id
            await send(message)

        token = current_request_id.set(request_id)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            current_request_id.reset(token)


class RequestIdFilter(logging.Filter):
    """Puts the running request's id (or "-") on every record as ``request_id``."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = current_request_id.get() or "-"
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "request_id": getattr(record, "request_id", "-"),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"


def configure_logging(level: str = "info", json_logs: bool = False) -> logging.Handler:
    """One handler on the root logger (uvicorn's loggers propagate to it); returns it."""
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter() if json_logs else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in [h for h in root.handlers if any(isinstance(f, RequestIdFilter) for f in h.filters)]:
        root.removeHandler(old)  # configured before (tests, a second serve): replace it
    root.addHandler(handler)
    root.setLevel(level.upper())
    return handler

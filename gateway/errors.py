"""Every failure leaves the API as one OpenAI-style body: {"error": {message, type, param, code}}."""

import logging
import secrets

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.auth import AuthError
from provenance.db import is_transient

log = logging.getLogger("inherent.errors")
# Seconds a client should wait before retrying while the database is unavailable.
DATABASE_RETRY_AFTER_S = 2

HTTP_ERROR_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )
        self.headers = headers

    def body(self) -> dict[str, dict[str, str | None]]:
        """The OpenAI error object, as a response body or a stream's error event."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def not_found(what: str) -> APIError:
    return APIError(404, f"{what} not found", code="not_found")


def auth_error(exc: AuthError) -> APIError:
    kind = "authentication_error" if exc.status == 401 else "permission_error"
    code = "invalid_api_key" if exc.status == 401 else "insufficient_scope"
    return APIError(exc.status, str(exc), type=kind, code=code)


def internal_error(what: str, exc: BaseException | None = None) -> APIError:
    """A 500 whose details go to the server log under a reference, never to the client: an
    exception's text can hold SQL, paths or another request's prompt."""
    reference = secrets.token_hex(6)
    log.error("%s (reference %s)", what, reference, exc_info=exc)
    return APIError(
        500, f"{what}; reference {reference}", type="server_error", code="internal_error"
    )


def database_error(exc: DBAPIError) -> APIError:
    if not is_transient(exc):
        return internal_error("database error", exc)
    # Down or restarting: nothing was generated, so nothing is lost; the client retries.
    return APIError(
        503,
        "the database is unavailable; retry shortly",
        type="server_error",
        code="database_unavailable",
        headers={"Retry-After": str(DATABASE_RETRY_AFTER_S)},
    )


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(AuthError)
    async def auth_failure(_: Request, exc: AuthError) -> JSONResponse:
        return auth_error(exc).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"msg": "invalid request", "loc": ()}
        location = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
        message = first.get("msg", "invalid request").removeprefix("Value error, ")
        if first.get("type") == "json_invalid":
            message = "the request body is not valid JSON"
        elif first.get("type") == "extra_forbidden":
            message = "this server does not support this field"
        param = ".".join(location) or None
        return APIError(
            400, f"{param}: {message}" if param else message, param=param, code="invalid_value"
        ).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(
            exc.status_code,
            str(exc.detail),
            code=HTTP_ERROR_CODES.get(exc.status_code),
            headers=exc.headers,  # a 405 keeps its Allow header
        ).response()

    @app.exception_handler(DBAPIError)
    async def database_failure(_: Request, exc: DBAPIError) -> JSONResponse:
        return database_error(exc).response()

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        error = internal_error(f"internal error in {request.url.path}", exc)
        # Answered outside the middleware stack: name the request id here.
        request_id = getattr(request.state, "request_id", None)
        if request_id:
            error.headers = {**(error.headers or {}), "X-Request-Id": request_id}
        return error.response()

"""Error -> HTTP mapping (one table) and OpenAI-style error bodies. Every client mistake is a 4xx naming the field."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from engines.errors import InferenceError, InvalidRequestError, NotReadyError, SdserveError

log = logging.getLogger(__name__)


class QueueFullError(SdserveError):
    """The queue is at its bound; ``retry_after`` seconds is the estimated wait."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class TenantLimitError(QueueFullError):
    """A tenant is over one of its limits (server/tenants.py): 429 with Retry-After, the body's ``code`` naming the
    limit (in_flight, images_queued, images_per_minute)."""

    def __init__(self, message: str, retry_after: int, limit: str) -> None:
        super().__init__(message, max(1, retry_after))
        self.limit = limit


class ClientGoneError(SdserveError):
    """The client disconnected; its queued request was dropped (logged as 499, nobody reads the body)."""


class DeadlineExceededError(SdserveError):
    """The request's deadline passed before it could start."""


class JobInterruptedError(SdserveError):
    """The caller interrupted the request (POST /sdapi/v1/interrupt) before it started (409)."""


class BodyTooLargeError(SdserveError):
    """The request body is over the configured cap (413)."""


class BodyTimeoutError(SdserveError):
    """The request body did not arrive within ``server.body_timeout_s`` of its head (408; the connection closes)."""


class AuthenticationError(SdserveError):
    """Missing or invalid API key (401)."""


class BindError(SdserveError):
    """The configured host:port cannot be bound (in use, not permitted, no such address): exit code 12."""


REQUEST_ID = "x-request-id"
"""Response header naming the request in the server log (an incoming one is kept when it is short and plain)."""


def request_id_of(scope: Any) -> str:
    """The id the guard middleware gave this request ("-" outside a request)."""
    state = scope.get("state") if isinstance(scope, dict) else None
    return str(state.get("request_id", "-")) if isinstance(state, dict) else "-"


def internal_error(request_id: str, type_: str = "server_error") -> JSONResponse:
    """A sanitized 500: no traceback or class name, the request id to find it in the log, and the connection
    closed (the client must not reuse a connection whose request failed inside the server)."""
    return JSONResponse(error_body(f"internal server error (request id {request_id})", type_),
                        status_code=500, headers={"connection": "close", REQUEST_ID: request_id})


_TABLE: tuple[tuple[type[SdserveError], int, str], ...] = (
    (InvalidRequestError, 400, "invalid_request_error"),
    (AuthenticationError, 401, "authentication_error"),
    (BodyTooLargeError, 413, "invalid_request_error"),
    (BodyTimeoutError, 408, "timeout"),
    (JobInterruptedError, 409, "request_interrupted"),
    (QueueFullError, 429, "rate_limit_exceeded"),
    (DeadlineExceededError, 504, "timeout"),
    (ClientGoneError, 499, "client_closed_request"),
    (NotReadyError, 503, "service_unavailable"),
    (InferenceError, 500, "server_error"),
    (SdserveError, 500, "server_error"),
)


MAX_MESSAGE_CHARS = 2000
MAX_PARAM_CHARS = 200
"""Every error body is O(1) in size whatever the request held: a message or param past these is cut."""


def bounded(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _param(loc: tuple[Any, ...]) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or None


def _validation_message(err: dict[str, Any]) -> tuple[str, str | None]:
    if err.get("type") == "json_invalid":
        return "request body is not valid JSON", None
    param = _param(tuple(err.get("loc", ())))
    if param is None:
        if isinstance(err.get("input"), bytes | str):
            return "request body is not JSON: send a JSON object with Content-Type: application/json", None
        if err.get("type") == "missing":
            return "request body is missing: send a JSON object", None
        return "request body must be a JSON object", None
    if err.get("type") == "missing":
        return f"{param}: field required", param
    if err.get("type") == "extra_forbidden":
        return f"{param}: unknown field", param
    message = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    return f"{param}: {message}", param


def is_a1111(path: str) -> bool:
    return path.startswith(("/sdapi/", "/controlnet/"))


A1111_FIELDS = {"n": "batch_size"}
"""A request field the service names by the OpenAI request model (the one model both APIs are validated through)
as an A1111 client knows it: its body has no ``n``. (``size`` stays: it names width and height together.)"""


def _detail(param: str | None, message: str, type_: str) -> dict[str, Any]:
    """FastAPI's 422 body, which A1111 clients parse."""
    return {"detail": [{"loc": ["body", *(param.split(".") if param else [])], "msg": message, "type": type_}]}


async def _on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    message, param = _validation_message(dict(errors[0]))
    message, param = bounded(message), bounded(param or "", MAX_PARAM_CHARS) or None
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem(s))"
    if is_a1111(request.url.path):
        return JSONResponse(_detail(param, message, str(errors[0].get("type", "value_error"))),
                            status_code=422)
    return JSONResponse(error_body(message, "invalid_request_error", param, "invalid_value"), status_code=400)


def status_of(exc: Exception) -> tuple[int, str]:
    """The one mapping from error class to (HTTP status, error type)."""
    return next((status, type_) for cls, status, type_ in _TABLE if isinstance(exc, cls))


def _headers(exc: SdserveError) -> dict[str, str]:
    if isinstance(exc, NotReadyError):
        return {"x-should-retry": "false"} if exc.permanent else {"Retry-After": "5"}
    if isinstance(exc, QueueFullError):
        return {"Retry-After": str(exc.retry_after)}
    if isinstance(exc, DeadlineExceededError):
        # The deadline passed while the request waited: retrying at once would wait again. openai-python retries
        # every 5xx unless this header says false (_base_client.py, _should_retry).
        return {"x-should-retry": "false"}
    if isinstance(exc, AuthenticationError):
        return {"WWW-Authenticate": "Bearer"}
    return {}


def error_response(exc: SdserveError, path: str, request_id: str = "-") -> JSONResponse:
    """The response for ``exc`` on ``path``: the one table, A1111's 422 shape for its routes' bad input, no
    internals in a 500. Exception handlers and the ASGI middleware both answer through here."""
    status, type_ = status_of(exc)
    if isinstance(exc, InvalidRequestError):
        message, param = bounded(exc.message), bounded(exc.param or "", MAX_PARAM_CHARS) or None
        if is_a1111(path):
            param = A1111_FIELDS.get(param or "", param)
            return JSONResponse(_detail(param, message, "value_error"), status_code=422)
        return JSONResponse(error_body(message, type_, param, "invalid_value"), status_code=status)
    if status == 500:  # our own failure: log it, tell the client nothing internal
        log.error("request %s failed", request_id, exc_info=exc)
        return internal_error(request_id, type_)
    code = getattr(exc, "limit", None) if isinstance(exc, TenantLimitError) else None
    return JSONResponse(error_body(bounded(str(exc)), type_, code=code), status_code=status, headers=_headers(exc))


async def _on_sdserve(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, SdserveError)
    state = getattr(request.app.state, "server_state", None)
    if isinstance(exc, NotReadyError) and not exc.permanent and getattr(state, "state", "") == "failed":
        exc = NotReadyError(str(exc), permanent=True)  # after a failed boot every route says the same: don't retry
    return error_response(exc, request.url.path, request_id_of(request.scope))


METHODS = ("GET", "HEAD", "POST", "PUT", "DELETE", "PATCH")


def allowed_methods(request: Request) -> str:
    """Every method some route serves at this path (Starlette's 405 names only the first route that matched)."""
    routes = request.app.router.routes
    return ", ".join(m for m in METHODS
                     if any(r.matches({**request.scope, "method": m})[0] == Match.FULL for r in routes))


async def _on_http(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    headers = dict(exc.headers or {})
    if exc.status_code == 405:
        headers["Allow"] = allowed_methods(request) or headers.get("Allow", "")
    return JSONResponse(error_body(str(exc.detail), "invalid_request_error"), status_code=exc.status_code,
                        headers=headers)


def install(app: FastAPI) -> None:
    """Handlers for the errors we raise on purpose. Anything else is answered by GuardMiddleware (outermost), not
    by Starlette's ServerErrorMiddleware, which re-raises into uvicorn and drops the kept-alive connection."""
    app.add_exception_handler(RequestValidationError, _on_validation)  # type: ignore[arg-type]
    app.add_exception_handler(SdserveError, _on_sdserve)
    app.add_exception_handler(StarletteHTTPException, _on_http)

"""ASGI middleware: the guard (request ids, one access-log line per request; any unexpected exception -> a
sanitized 500 that closes the connection; both Content-Length and Transfer-Encoding -> 400 and close), request
metrics, body-size cap (413, chunked bodies too), auth (401: Bearer API keys or HTTP Basic ``user:pass``) and the
request's tenant, with its cap on requests in flight (429). Strict JSON bodies: server/strict_json.py.

Secrets are compared as sha256 digests in constant time; a secret is never logged or stored, only its digest's first
8 hex characters as an id. A request's tenant (``tenant_label``) is the configured tenant's label for its key, else
the key id, else ``default`` without auth (server/tenants.py): whose jobs it sees and stops, its quotas, its share."""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import hmac
import logging
import re
import secrets
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.datastructures import MutableHeaders

from engines.errors import InvalidRequestError, NotReadyError, SdserveError
from server import headers as header_names
from server.errors import (
    REQUEST_ID,
    AuthenticationError,
    BodyTimeoutError,
    BodyTooLargeError,
    TenantLimitError,
    error_response,
    internal_error,
    request_id_of,
)
from server.metrics import OTHER_TENANT, REFUSAL, Metrics, Refusal, note_refusal, tenant_series
from server.tenant_config import DEFAULT_TENANT
from server.tenants import REQUEST, RequestCharge, TenantRegistry

log = logging.getLogger(__name__)
access_log = logging.getLogger("sdserve.access")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
GENERATION_PREFIXES = ("/v1/images/generations", "/v1/images/edits", "/v1/images/variations", "/sdapi/v1/txt2img",
                       "/sdapi/v1/img2img")
"""Every generation route: each counts against its tenant's cap on requests in flight."""
FILES_PREFIX = "/v1/images/files/"
"""URLs handed out by response_format=url: unguessable 128-bit ids, short-lived, fetched without a key (a valid key
sent with one names its tenant, never refuses it)."""
SERIES = "tenant_series"
"""Where the auth middleware puts the request's metrics label (server/metrics.py tenant_series) in the scope state."""


async def answer(exc: SdserveError, scope: Scope, receive: Receive, send: Send) -> None:
    """Answer through the one error table (server/errors.py) with Starlette's own response."""
    await error_response(exc, str(scope.get("path", "")), request_id_of(scope))(scope, receive, send)


_CLIENT_ID = re.compile(r"[!-~]{1,128}")
"""An incoming x-request-id is kept when it is 1..128 visible ASCII characters (no spaces or control characters:
it goes into headers and log lines as is); otherwise a fresh one is generated."""
MAX_LOGGED_PROMPT = 1000


def api_key_id(scope: Scope) -> str | None:
    """The authenticated caller's id (its secret's digest[:8], set by AuthMiddleware); None when auth is off."""
    value = scope.get("state", {}).get("api_key_id")
    return str(value) if value is not None else None


def tenant_label(scope: Scope) -> str:
    """The request's tenant (set by AuthMiddleware): the configured tenant's label for its key, an unconfigured
    key's id, or ``default`` without auth. Never a key or a digest: it goes into logs, metrics and job owners."""
    state = scope.get("state", {})
    value = state.get("tenant") or state.get("api_key_id")
    return str(value) if value is not None else DEFAULT_TENANT


def _access_fields(scope: Scope, status: int, seconds: float, log_prompts: bool) -> dict[str, Any]:
    """The access-log record of one request: never a secret, the query string or (unless log_prompts) a prompt."""
    state = scope.get("state", {})
    headers = dict(scope.get("headers", []))
    fields: dict[str, Any] = {
        "request_id": state.get("request_id"), "method": scope.get("method"), "path": scope.get("path"),
        "route": getattr(scope.get("route"), "path", None), "status": status,
        "duration_ms": round(seconds * 1000, 1), "client": (scope.get("client") or ("-",))[0],
        "key_id": state.get("api_key_id"), "tenant": state.get("tenant"),
        "user_agent": headers.get(b"user-agent", b"").decode("latin-1")[:200] or None}
    if log_prompts and isinstance(state.get("prompt"), str):
        fields["prompt"] = state["prompt"][:MAX_LOGGED_PROMPT]
    return fields


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def escape_controls(text: str) -> str:
    """Control characters (CR, LF, ESC, ...) as \\xNN / \\uNNNN: client text cannot forge or split a log line."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100
                        else f"\\u{ord(m.group()):04x}", text)


def relative_location(location: str) -> str:
    """A redirect's target without scheme and host (Starlette builds them from the request's Host header, which
    a client forges): path, query and fragment only, so a redirect never sends a client to another host."""
    scheme, sep, rest = location.partition("://")
    if not sep or "/" in scheme:
        return location if not location.startswith("//") else "/" + location.lstrip("/")
    path = rest[rest.find("/"):] if "/" in rest else "/"
    return "/" + path.lstrip("/")


class GuardMiddleware:
    """Outermost: gives every request an id (x-request-id on every response), writes one access-log line per
    request (logger ``sdserve.access``, fields in ``record.access``) and turns any exception that escapes the app
    into a sanitized 500 with ``connection: close``, logged once with its traceback and the id. (A 504's
    ``x-should-retry: false`` comes from the error table, server/errors.py.) A request whose client left before
    its answer was complete (the app saw ``http.disconnect``) is logged 499, with ``response_status`` the status
    the server would have answered: not a 200 for a client that was gone. A response the server could not send
    (the send raised) is logged with ``send_error``, and status 0 when not even its head went out. Header values
    are checked on the way out (server/headers.py ``repaired``): an invalid one is sent repaired and logged, never
    refused by h11 after the work is done."""

    def __init__(self, app: ASGIApp, log_prompts: bool = False) -> None:
        self.app, self.log_prompts = app, log_prompts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = dict(scope.get("headers", [])).get(REQUEST_ID.encode(), b"").decode("latin-1")
        request_id = incoming if _CLIENT_ID.fullmatch(incoming) else secrets.token_hex(8)
        scope.setdefault("state", {})["request_id"] = request_id
        start, watch = time.perf_counter(), _Exchange(receive, send, request_id)
        app = _refuse_framing if _ambiguous_framing(scope) else self.app
        try:
            await app(scope, watch.receive, watch.send)
        except asyncio.CancelledError:  # shutdown cancelled the request (e.g. a body still trickling in)
            if not watch.status:  # answer it as shutdown, not with the server's plain-text 500, then let it go
                with contextlib.suppress(Exception):
                    await error_response(NotReadyError("the server shut down before this request completed: retry "
                                                       "it on another replica"), str(scope.get("path", "")),
                                         request_id)(scope, receive, watch.send)
            raise
        except Exception:  # the last line of defence: nothing internal reaches the client
            log.exception("request %s %s %s failed", request_id, scope.get("method"), scope.get("path"))
            if not watch.status:  # else the response is cut short and uvicorn closes the connection
                await internal_error(request_id)(scope, receive, send)
                watch.status = 500
        finally:
            status = 499 if watch.gone else watch.sent if watch.send_error else watch.status or 499
            fields = _access_fields(scope, status, time.perf_counter() - start, self.log_prompts)
            if watch.gone or watch.send_error:
                fields["response_status"] = watch.status or None
            if watch.send_error:
                fields["send_error"] = watch.send_error
            access_log.info("%s %s %d %.1fms id=%s%s", fields["method"], escape_controls(str(fields["path"])),
                            fields["status"], fields["duration_ms"], request_id,
                            f" send failed ({watch.send_error})" if watch.send_error else "", extra={"access": fields})


class _Exchange:
    """One request's messages as the guard sees them: the status answered (x-request-id added, a redirect made
    relative, invalid header values repaired), the status whose head actually went out (``sent``), whether the
    answer completed, whether the client left before it did, and what a failed send raised."""

    def __init__(self, receive: Receive, send: Send, request_id: str) -> None:
        self._receive, self._send, self.request_id = receive, send, request_id
        self.status, self.sent, self.answered, self.gone = 0, 0, False, False
        self.send_error: str | None = None

    async def receive(self) -> Message:
        message = await self._receive()
        if message["type"] == "http.disconnect" and not self.answered:
            self.gone = True
        return message

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            self.answered = True
        if message["type"] == "http.response.start":
            self.status = int(message["status"])
            headers = MutableHeaders(scope=message)
            headers[REQUEST_ID] = self.request_id
            if "location" in headers:
                headers["location"] = relative_location(headers["location"])
            _repair_headers(message)
        try:
            await self._send(message)
        except Exception as exc:
            self.send_error = f"{type(exc).__name__}: {escape_controls(str(exc))[:200]}"
            raise
        if message["type"] == "http.response.start":
            self.sent = self.status


def _repair_headers(message: Message) -> None:
    """Every header value of a response head valid on the wire (server/headers.py ``repaired``); a repair is
    logged: it is a builder that did not go through headers.put."""
    raw = message.get("headers", [])
    fixed = [(name, header_names.repaired(bytes(value))) for name, value in raw]
    if any(new is not None for _, new in fixed):
        log.warning("invalid header value(s) repaired before sending: %s",
                    ", ".join(bytes(name).decode("latin-1") for name, new in fixed if new is not None))
        message["headers"] = [(name, new if new is not None else bytes(value))
                              for (name, new), (_, value) in zip(fixed, raw, strict=True)]


def _ambiguous_framing(scope: Scope) -> bool:
    names = {name.lower() for name, _ in scope.get("headers", [])}
    return b"content-length" in names and b"transfer-encoding" in names


async def _refuse_framing(scope: Scope, receive: Receive, send: Send) -> None:
    """RFC 9112 6.3: a request with both Transfer-Encoding and Content-Length "ought to be handled as an error" and
    the connection closed (h11 lets chunked win; a proxy in front may have used the length: request smuggling)."""
    await _answer_and_close(InvalidRequestError("the request has both Content-Length and Transfer-Encoding: send "
                                                "one of them (RFC 9112 section 6.3)", param="transfer-encoding"),
                            scope, receive, send)


class MetricsMiddleware:
    """Counts every request by route template (never the raw path) and status, and times it; the same per tenant
    (the label the auth middleware named, ``other`` when it named none: a 401, an exempt probe with auth on), and
    each 429 by the limit its refusal noted (server/metrics.py ``note_refusal``; ``busy`` when none did)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status, start = [500], time.perf_counter()

        async def send_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
            await send(message)

        refusal = Refusal()
        token = REFUSAL.set(refusal)
        try:
            await self.app(scope, receive, send_status)
        finally:
            REFUSAL.reset(token)
            m, seconds = self.metrics, time.perf_counter() - start
            path = str(getattr(scope.get("route"), "path", "unmatched"))
            tenant = str(scope.get("state", {}).get(SERIES, OTHER_TENANT))
            m.requests.labels(path, str(status[0])).inc()
            m.request_seconds.labels(path).observe(seconds)
            m.tenant_requests.labels(tenant, path, str(status[0])).inc()
            m.tenant_request_seconds.labels(tenant, path).observe(seconds)
            if status[0] == 429:
                m.tenant_refused.labels(tenant, refusal.limit or "busy").inc()


class BodyLimitMiddleware:
    """413 for bodies over ``max_bytes``: by Content-Length at once, or while a chunked body streams in; 408 (JSON,
    connection closed) for a body not complete within ``timeout_s`` of the head, however slowly it trickles. The
    body is read whole here (it is small by this bound) and replayed to the app, so the app never sees a partial
    body."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float = 30.0, upload_paths: tuple[str, ...] = (),
                 upload_max_bytes: int = 0) -> None:
        """``upload_paths`` (the edit routes, which take images) allow ``upload_max_bytes`` instead."""
        self.app, self.default_max, self.timeout_s = app, max_bytes, timeout_s
        self.upload_paths, self.upload_max = upload_paths, upload_max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        limit = self.upload_max if scope.get("path") in self.upload_paths else self.default_max
        length = dict(scope.get("headers", [])).get(b"content-length")
        if length is not None and (not length.isdigit() or len(length) > 12 or int(length) > limit):
            await _answer_and_close(BodyTooLargeError(f"request body over {limit} bytes"), scope, receive, send)
            return
        try:
            async with asyncio.timeout(self.timeout_s):
                body = await self._read(receive, limit)
        except TimeoutError:
            await _answer_and_close(BodyTimeoutError(f"request body not received within {self.timeout_s:g}s of "
                                                     "the request head (server.body_timeout_s)"), scope, receive,
                                    send)
            return
        except BodyTooLargeError as exc:
            await _answer_and_close(exc, scope, receive, send)
            return
        if body is not None:  # None: disconnected, nobody to answer
            await self.app(scope, replay(body, receive), send)

    async def _read(self, receive: Receive, limit: int) -> bytes | None:
        chunks: list[bytes] = []
        seen, more = 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return None
            chunks.append(message.get("body", b""))
            seen += len(chunks[-1])
            more = bool(message.get("more_body", False))
            if seen > limit:
                raise BodyTooLargeError(f"request body over {limit} bytes")
        return b"".join(chunks)


async def _answer_and_close(exc: SdserveError, scope: Scope, receive: Receive, send: Send) -> None:
    """An answer given before the body was read (whole): the connection closes after it, since what the client
    still sends belongs to this request, not to a next one."""
    response = error_response(exc, str(scope.get("path", "")), request_id_of(scope))
    response.headers["connection"] = "close"
    await response(scope, receive, send)


def replay(body: bytes, receive: Receive) -> Receive:
    """A receive that yields ``body`` once, then defers to the server (disconnect events)."""
    sent = [False]

    async def replay() -> Message:
        if sent[0]:
            return await receive()
        sent[0] = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


CHALLENGE = 'Bearer, Basic realm="sdserve", charset="UTF-8"'
"""WWW-Authenticate on every 401: both schemes the server accepts (RFC 9110 11.6.1 allows a list)."""


def presented_secret(header: str) -> str | None:
    """The secret an Authorization header presents: a Bearer key as sent, or HTTP Basic's decoded ``user:pass``
    (what A1111's ``--api-auth user:pass`` clients send; RFC 7617, UTF-8). None when neither is well formed."""
    scheme, _, value = header.strip().partition(" ")
    value = value.strip()
    if not value:
        return None
    if scheme.lower() == "bearer":
        return value
    if scheme.lower() != "basic":
        return None
    try:
        pair = base64.b64decode(value, validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None
    return pair if ":" in pair else None


def _has_body(scope: Scope) -> bool:
    headers = dict(scope.get("headers", []))
    return headers.get(b"content-length", b"0") != b"0" or b"transfer-encoding" in headers


class AuthMiddleware:
    """Secrets checked against stored sha256 digests: a Bearer key's digest, or for HTTP Basic the digest of
    ``user:pass`` (so ``printf %s 'user:pass' | sha256sum`` gives the entry). Exempt paths (probes) pass without
    one. The caller's id (digest[:8]) is put in ``scope["state"]["api_key_id"]`` and its tenant's label in
    ``scope["state"]["tenant"]`` for the routes (``tenant_label``); without auth every request is the ``default``
    tenant's. Every generation route counts against the tenant's cap on requests in flight (429 over it). A url
    link fetch is never refused: a valid key sent with it names its tenant as on other paths."""

    def __init__(self, app: ASGIApp, registry: TenantRegistry, exempt: tuple[str, ...]) -> None:
        self.app, self.registry, self.exempt = app, registry, exempt
        self.in_flight: defaultdict[str, int] = defaultdict(int)

    def _match(self, scope: Scope) -> str | None:
        header = dict(scope.get("headers", [])).get(b"authorization", b"").decode("latin-1")
        secret = presented_secret(header)
        if secret is None:
            return None
        digest = key_digest(secret)
        found = None
        for stored in self.registry.current.digests:  # compare against every digest: timing does not reveal which
            if hmac.compare_digest(digest, stored):
                found = stored
        return found

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.registry.refresh()
        if not self.registry.enabled:
            label = DEFAULT_TENANT
        elif path in self.exempt:
            await self.app(scope, receive, send)
            return
        elif path.startswith(FILES_PREFIX):
            digest = self._match(scope)
            if digest is not None:
                self._name(scope, digest)
            await self.app(scope, receive, send)
            return
        else:
            digest = self._match(scope)
            if digest is None:
                await self._refuse(scope, receive, send)
                return
            label = self._name(scope, digest)
        state = scope.setdefault("state", {})
        state["tenant"] = label
        state[SERIES] = tenant_series(label, self.registry.current.by_label, self.registry.enabled)
        counted = path.startswith(GENERATION_PREFIXES)
        cap = self.registry.in_flight_cap(label) if counted else None
        if cap is not None and self.in_flight[label] >= cap:
            note_refusal("in_flight")
            await answer(TenantLimitError(f"too many concurrent requests for tenant {label!r} (its in_flight "
                                          f"limit, {cap})", 1, "in_flight"), scope, receive, send)
            return
        self.in_flight[label] += counted
        request = REQUEST.set(RequestCharge(label))
        try:
            await self.app(scope, receive, send)
        finally:
            REQUEST.reset(request)
            self.in_flight[label] -= counted
            if self.in_flight[label] <= 0:
                del self.in_flight[label]

    def _name(self, scope: Scope, digest: str) -> str:
        """Put an accepted key's id, tenant and metrics label in the scope state; returns the tenant."""
        label = self.registry.label_for(digest)
        state = scope.setdefault("state", {})
        state["api_key_id"], state["tenant"] = digest[:8], label
        state[SERIES] = tenant_series(label, self.registry.current.by_label, True)
        return label

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        refusal = error_response(AuthenticationError("missing or invalid credentials: send Authorization: "
                                                     "Bearer <key> or Basic (user:pass)"),
                                 str(scope.get("path", "")), request_id_of(scope))
        refusal.headers["WWW-Authenticate"] = CHALLENGE
        if _has_body(scope):  # decided on the headers; the unread body must not be taken for a next request
            refusal.headers["connection"] = "close"
        await refusal(scope, receive, send)

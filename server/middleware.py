"""ASGI middleware: the guard (request ids, one access-log line per request; any
unexpected exception -> a sanitized 500 that closes the connection), request metrics, body-size cap (413, chunked
bodies too), strict JSON (duplicate keys, oversized numbers, NaN, lone surrogates: 400/422), auth (401: Bearer API
keys or HTTP Basic ``user:pass``) with per-key concurrency (429).

Secrets are compared as sha256 digests in constant time; a secret is never logged or stored, only its digest's first
8 hex characters as an id for per-key accounting and for whose jobs /sdapi/v1/interrupt may stop."""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import hmac
import json
import logging
import re
import secrets
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import MutableHeaders

from engines.errors import InvalidRequestError, NotReadyError, SdserveError
from server.errors import (
    REQUEST_ID,
    AuthenticationError,
    BodyTimeoutError,
    BodyTooLargeError,
    QueueFullError,
    error_response,
    internal_error,
    request_id_of,
)
from server.metrics import Metrics

log = logging.getLogger(__name__)
access_log = logging.getLogger("sdserve.access")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
GENERATION_PREFIXES = ("/v1/images/generations", "/sdapi/v1/txt2img")
FILES_PREFIX = "/v1/images/files/"
"""URLs handed out by response_format=url: unguessable 128-bit ids, short-lived, fetched without a key."""


async def _answer(exc: SdserveError, scope: Scope, receive: Receive, send: Send) -> None:
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


def _access_fields(scope: Scope, status: int, seconds: float, log_prompts: bool) -> dict[str, Any]:
    """The access-log record of one request: never a secret, the query string or (unless log_prompts) a prompt."""
    state = scope.get("state", {})
    headers = dict(scope.get("headers", []))
    fields: dict[str, Any] = {
        "request_id": state.get("request_id"), "method": scope.get("method"), "path": scope.get("path"),
        "route": getattr(scope.get("route"), "path", None), "status": status,
        "duration_ms": round(seconds * 1000, 1), "client": (scope.get("client") or ("-",))[0],
        "key_id": state.get("api_key_id"),
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
    ``x-should-retry: false`` comes from the error table, server/errors.py.)"""

    def __init__(self, app: ASGIApp, log_prompts: bool = False) -> None:
        self.app, self.log_prompts = app, log_prompts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = dict(scope.get("headers", [])).get(REQUEST_ID.encode(), b"").decode("latin-1")
        request_id = incoming if _CLIENT_ID.fullmatch(incoming) else secrets.token_hex(8)
        scope.setdefault("state", {})["request_id"] = request_id
        status, start = [0], time.perf_counter()

        async def tagged(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
                headers = MutableHeaders(scope=message)
                headers[REQUEST_ID] = request_id
                if "location" in headers:
                    headers["location"] = relative_location(headers["location"])
            await send(message)

        try:
            await self.app(scope, receive, tagged)
        except asyncio.CancelledError:  # shutdown cancelled the request (e.g. a body still trickling in)
            if not status[0]:  # answer it as shutdown, not with the server's plain-text 500, then let it go
                with contextlib.suppress(Exception):
                    await error_response(NotReadyError("the server shut down before this request completed: retry "
                                                       "it on another replica"), str(scope.get("path", "")),
                                         request_id)(scope, receive, tagged)
            raise
        except Exception:  # the last line of defence: nothing internal reaches the client
            log.exception("request %s %s %s failed", request_id, scope.get("method"), scope.get("path"))
            if not status[0]:  # else the response is cut short and uvicorn closes the connection
                await internal_error(request_id)(scope, receive, send)
                status[0] = 500
        finally:
            fields = _access_fields(scope, status[0] or 499, time.perf_counter() - start, self.log_prompts)
            access_log.info("%s %s %d %.1fms id=%s", fields["method"], escape_controls(str(fields["path"])),
                            fields["status"], fields["duration_ms"], request_id, extra={"access": fields})


class MetricsMiddleware:
    """Counts every request by route template (never the raw path) and status, and times it."""

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

        try:
            await self.app(scope, receive, send_status)
        finally:
            path = str(getattr(scope.get("route"), "path", "unmatched"))
            self.metrics.requests.labels(path, str(status[0])).inc()
            self.metrics.request_seconds.labels(path).observe(time.perf_counter() - start)


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
            await self.app(scope, _replay(body, receive), send)

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


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that yields ``body`` once, then defers to the server (disconnect events)."""
    sent = [False]

    async def replay() -> Message:
        if sent[0]:
            return await receive()
        sent[0] = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


MAX_NUMBER_CHARS = 32
"""A JSON number longer than this is refused before Python parses it (int() of thousands of digits is slow and
raises a message of its own)."""


def _bounded(kind: type[int] | type[float]) -> Callable[[str], int | float]:
    def parse(text: str) -> int | float:
        if len(text) > MAX_NUMBER_CHARS:
            raise InvalidRequestError(f"a number in the request body is longer than {MAX_NUMBER_CHARS} characters")
        return kind(text)

    return parse


MAX_OBJECT_KEYS = 1000
"""Keys one JSON object may hold: no route takes more than a few dozen, and refusing at parse time keeps a body of
100,000 unknown keys from costing 100,000 validation errors."""
OFF_LOOP_BYTES = 64 << 10
"""Bodies at least this large are parsed in a worker thread, so a burst of them never stalls the probes."""


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    if len(pairs) > MAX_OBJECT_KEYS:
        raise InvalidRequestError(f"a JSON object in the request body has {len(pairs)} keys; at most "
                                  f"{MAX_OBJECT_KEYS} are accepted")
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise InvalidRequestError(f"{key}: duplicate key in the request body", param=key)
        seen[key] = value
    return seen


def _constant(name: str) -> float:
    raise InvalidRequestError(f"{name} is not a JSON number")


def _check_text(value: Any, where: str) -> None:
    """Every string must be valid Unicode text: a lone UTF-16 surrogate (JSON "\\ud800") is refused."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequestError(f"{where or 'body'}: contains an unpaired UTF-16 surrogate",
                                      param=where or None) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(key, where)
            _check_text(item, f"{where}.{key}" if where else key)
    elif isinstance(value, list):
        for item in value:
            _check_text(item, where)


def strict_loads(body: bytes) -> Any:
    """json.loads that refuses what the standard library lets through: duplicate keys, NaN/Infinity, numbers of
    unbounded length and lone surrogates. Raises InvalidRequestError, or ValueError for text that is not JSON."""
    value = json.loads(body, object_pairs_hook=_pairs, parse_int=_bounded(int), parse_float=_bounded(float),
                       parse_constant=_constant)
    _check_text(value, "")
    return value


def _is_json(scope: Scope) -> bool:
    content_type = dict(scope.get("headers", [])).get(b"content-type", b"application/json").decode("latin-1")
    media: str = content_type.split(";")[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


class StrictJsonMiddleware:
    """JSON request bodies are checked by ``strict_loads`` before the app parses them (after the body cap, which
    has read the body whole); a body that is not JSON at all is left to the app's own 400. With ``keep_prompt``
    (``server.log_prompts``) a body's ``prompt`` is kept in the request state for the access log."""

    def __init__(self, app: ASGIApp, keep_prompt: bool = False) -> None:
        self.app, self.keep_prompt = app, keep_prompt

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS") or not _is_json(scope):
            await self.app(scope, receive, send)
            return
        message = await receive()
        if message["type"] != "http.request":  # disconnected: nobody to answer
            return
        body = message.get("body", b"")
        if body:
            try:
                value = await run_in_threadpool(strict_loads, body) if len(body) >= OFF_LOOP_BYTES \
                    else strict_loads(body)
                if self.keep_prompt and isinstance(value, dict) and isinstance(value.get("prompt"), str):
                    scope.setdefault("state", {})["prompt"] = value["prompt"]
            except InvalidRequestError as exc:
                await _answer(exc, scope, receive, send)
                return
            except (UnicodeDecodeError, RecursionError) as exc:  # the app would answer an undocumented 400 / a 500
                what = "is not UTF-8 text" if isinstance(exc, UnicodeDecodeError) else "is nested too deeply"
                await _answer(InvalidRequestError(f"request body is not valid JSON: it {what}"), scope, receive, send)
                return
            except ValueError:  # not JSON: the app's validation answers it (400, or 422 on A1111 routes)
                pass
        await self.app(scope, _replay(body, receive), send)


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
    one. The caller's id (digest[:8]) is put in ``scope["state"]["api_key_id"]`` for the routes."""

    def __init__(self, app: ASGIApp, digests: tuple[str, ...], exempt: tuple[str, ...], per_key: int) -> None:
        self.app, self.digests, self.exempt, self.per_key = app, digests, exempt, per_key
        self.in_flight: defaultdict[str, int] = defaultdict(int)

    def _match(self, scope: Scope) -> str | None:
        header = dict(scope.get("headers", [])).get(b"authorization", b"").decode("latin-1")
        secret = presented_secret(header)
        if secret is None:
            return None
        digest = key_digest(secret)
        found = None
        for stored in self.digests:  # compare against every digest: timing does not reveal which matched
            if hmac.compare_digest(digest, stored):
                found = stored
        return found

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not self.digests or path in self.exempt or path.startswith(FILES_PREFIX):
            await self.app(scope, receive, send)
            return
        digest = self._match(scope)
        if digest is None:
            refusal = error_response(AuthenticationError("missing or invalid credentials: send Authorization: "
                                                         "Bearer <key> or Basic (user:pass)"),
                                     path, request_id_of(scope))
            refusal.headers["WWW-Authenticate"] = CHALLENGE
            if _has_body(scope):  # decided on the headers; the unread body must not be taken for a next request
                refusal.headers["connection"] = "close"
            await refusal(scope, receive, send)
            return
        key_id = digest[:8]
        scope.setdefault("state", {})["api_key_id"] = key_id
        if not path.startswith(GENERATION_PREFIXES):
            await self.app(scope, receive, send)
            return
        if self.in_flight[key_id] >= self.per_key:
            await _answer(QueueFullError(f"too many concurrent requests for this key (limit {self.per_key})", 1),
                          scope, receive, send)
            return
        self.in_flight[key_id] += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight[key_id] -= 1

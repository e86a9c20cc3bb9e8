"""ASGI middleware: request metrics, body-size cap (413), API-key auth (401) with per-key concurrency (429).

Keys are compared as sha256 digests in constant time; a key is never logged or stored, only its digest's first
8 hex characters as an id for per-key accounting."""

from __future__ import annotations

import hashlib
import hmac
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from engines.errors import SdserveError
from server.errors import AuthenticationError, BodyTooLargeError, QueueFullError, error_response
from server.metrics import Metrics

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
    await error_response(exc, str(scope.get("path", "")))(scope, receive, send)


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
    """413 for bodies over ``max_bytes``: by Content-Length at once, or while a chunked body streams in."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers", [])).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await _answer(BodyTooLargeError(f"request body over {self.max_bytes} bytes"), scope, receive, send)
            return
        seen = [0]
        started = [False]

        async def counted() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                seen[0] += len(message.get("body", b""))
                if seen[0] > self.max_bytes:
                    raise _TooLargeError
            return message

        async def tracked(message: Message) -> None:
            if message["type"] == "http.response.start":
                started[0] = True
            await send(message)

        try:
            await self.app(scope, counted, tracked)
        except _TooLargeError:
            if not started[0]:
                await _answer(BodyTooLargeError(f"request body over {self.max_bytes} bytes"), scope, receive, send)


class _TooLargeError(Exception):
    pass


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class AuthMiddleware:
    """Bearer API keys checked against stored sha256 digests; exempt paths (probes) pass without one."""

    def __init__(self, app: ASGIApp, digests: tuple[str, ...], exempt: tuple[str, ...], per_key: int) -> None:
        self.app, self.digests, self.exempt, self.per_key = app, digests, exempt, per_key
        self.in_flight: defaultdict[str, int] = defaultdict(int)

    def _match(self, scope: Scope) -> str | None:
        header = dict(scope.get("headers", [])).get(b"authorization", b"").decode("latin-1")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key:
            return None
        digest = key_digest(key.strip())
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
            await _answer(AuthenticationError("missing or invalid API key: send Authorization: Bearer <key>"),
                          scope, receive, send)
            return
        if not path.startswith(GENERATION_PREFIXES):
            await self.app(scope, receive, send)
            return
        key_id = digest[:8]
        if self.in_flight[key_id] >= self.per_key:
            await _answer(QueueFullError(f"too many concurrent requests for this key (limit {self.per_key})", 1),
                          scope, receive, send)
            return
        self.in_flight[key_id] += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight[key_id] -= 1

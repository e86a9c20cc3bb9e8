"""Owns the uvicorn server: binding, the logged address, connection bounds and signals. SIGTERM/SIGINT drain first
(/ready 503 at once, queued work finishes within the drain timeout), then shut down, all of it within
``queue.drain_timeout_s`` whatever clients do; the process exits with our code (0 when healthy) instead of uvicorn
re-raising the signal. A second signal stops at once, cleanly: every request in flight answers 503, the executing
batch stops at its next step boundary and the engine is closed only after it returned (no abort), exit code 0.

Hostile clients: a connection that has not sent a complete request head within ``server.header_timeout_s`` is closed
(uvicorn's own keep-alive timer starts only after a first response), and a body must arrive whole within
``server.body_timeout_s`` (408, server/middleware.py); open connections are capped below RLIMIT_NOFILE: one over the
cap closes the oldest connection still sending its head, else the oldest still sending its body (so probes keep
answering under an idle or slow-body flood), or is refused at once with a 503 when every connection is busy.
Accepted sockets get TCP_NODELAY. Repeated log lines
(accept errors, refusals, invalid requests) are rate-limited."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import resource
import signal
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from engines.errors import ConfigError
from server.errors import BindError
from server.exitcodes import ExitCode
from server.settings import Settings

log = logging.getLogger("sdserve")
conn_log = logging.getLogger("sdserve.connections")
FD_RESERVE = 64
"""File descriptors kept free for the process itself (model files, logs, pipes) besides the accept backlog."""
STOP_GRACE_S = 5
"""After a second signal, how long uvicorn waits for connections to finish their (503) responses."""
REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
           b"retry-after: 1\r\ncontent-length: 20\r\n\r\ntoo many connections")


class RepeatFilter(logging.Filter):
    """Lets the first record of each message template through, then at most one per ``interval_s`` carrying the
    count of those suppressed in between: an attack repeated 90,000 times writes a few lines, not 90,000."""

    def __init__(self, interval_s: float = 10.0) -> None:
        super().__init__()
        self.interval_s = interval_s
        self._last: dict[str, tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = f"{record.name}:{record.msg}"
        now = time.monotonic()
        last, suppressed = self._last.get(key, (-math.inf, 0))
        if now - last < self.interval_s:
            self._last[key] = (last, suppressed + 1)
            return False
        self._last[key] = (now, 0)
        if suppressed:
            record.msg = f"{record.msg} [{suppressed} more like this in the last {now - last:.0f}s]"
        return True


RATE_LIMITED_LOGGERS = ("asyncio", "uvicorn.error", "sdserve.connections")


@dataclass
class Bounds:
    """Connection limits shared by every connection of one server."""

    max_connections: int
    header_timeout_s: float
    waiting: dict[BoundedH11Protocol, None] = field(default_factory=dict)
    """Connections with no complete request head yet, oldest first (the ones an over-cap connection may evict)."""
    reading: dict[BoundedH11Protocol, None] = field(default_factory=dict)
    """Connections whose request head arrived but whose body is still coming, oldest first (evicted next)."""

    def evictable(self) -> BoundedH11Protocol | None:
        """The connection an over-cap one may close: the oldest still sending a head, else a body."""
        return next(iter(self.waiting), None) or next(iter(self.reading), None)


class _Config(uvicorn.Config):
    def __init__(self, app: FastAPI, bounds: Bounds, **kwargs: Any) -> None:
        super().__init__(app, http=BoundedH11Protocol, **kwargs)
        self.bounds = bounds


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a request-head timeout and the connection cap (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, server_state: Any, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.bounds: Bounds = config.bounds if isinstance(config, _Config) else Bounds(1 << 30, 3600.0)
        self.head_timer: asyncio.TimerHandle | None = None
        self.seen_cycle: object = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        nodelay(transport)
        if len(self.connections) > self.bounds.max_connections:
            oldest = self.bounds.evictable()
            if oldest is None:  # every connection is busy with a request: refuse this one, fast
                conn_log.warning("connection cap %d reached with every connection busy: refusing new connections",
                                 self.bounds.max_connections)
                transport.write(REFUSAL)
                transport.close()
                return
            conn_log.warning("connection cap %d reached: closing the oldest connections still sending a request "
                             "head or body", self.bounds.max_connections)
            oldest.expire()
        self.await_head()

    def await_head(self) -> None:
        self.bounds.waiting.pop(self, None)
        self.bounds.waiting[self] = None
        if self.head_timer is not None:
            self.head_timer.cancel()
        self.head_timer = self.loop.call_later(self.bounds.header_timeout_s, self.expire)

    def head_arrived(self) -> None:
        self.seen_cycle = self.cycle
        self.bounds.waiting.pop(self, None)
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def expire(self) -> None:
        """No complete request head in time (or evicted by the cap): close."""
        self.bounds.waiting.pop(self, None)
        self.bounds.reading.pop(self, None)
        if not self.transport.is_closing():
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.cycle is not None and self.cycle is not self.seen_cycle:
            self.head_arrived()
        self.track_body()

    def track_body(self) -> None:
        if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
            self.bounds.reading.setdefault(self, None)
        else:
            self.bounds.reading.pop(self, None)

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start a pipelined request
        self.track_body()
        if self.cycle is not self.seen_cycle:
            self.head_arrived()
        elif not self.transport.is_closing():
            self.await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self.bounds.waiting.pop(self, None)
        self.bounds.reading.pop(self, None)
        if self.head_timer is not None:
            self.head_timer.cancel()
        super().connection_lost(exc)


def nodelay(transport: asyncio.BaseTransport) -> None:
    """TCP_NODELAY on an accepted socket. asyncio sets it only for sockets it creates with proto IPPROTO_TCP;
    ours is bound by hand (proto 0), and without it Nagle holds each response's body behind its headers until
    the client's delayed ACK (~40 ms on every kept-alive request)."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):  # the peer already went away
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def fd_budget(configured: int) -> tuple[int, int]:
    """(connection cap, accept backlog) that fit under RLIMIT_NOFILE (its soft limit raised to the hard one): the
    open descriptors, a reserve and one backlog of accepted-but-not-yet-counted sockets stay below it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = 1 << 20 if hard == resource.RLIM_INFINITY else min(hard, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):  # not permitted here: work within the soft limit
            pass
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    try:
        open_now = len(os.listdir("/proc/self/fd"))
    except OSError:
        open_now = FD_RESERVE
    room = soft - open_now - FD_RESERVE
    backlog = min(2048, max(16, room // 4))
    cap = min(configured, room - backlog)
    if cap < 8:
        raise ConfigError(f"RLIMIT_NOFILE {soft} leaves room for {cap} connections: raise it (ulimit -n)")
    return cap, backlog


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before anything else runs; BindError (exit code 12) names the address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise BindError(f"cannot bind {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: FastAPI, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.drain_app = app
        self.drain_timeout_s = drain_timeout_s
        self._draining: asyncio.Task[None] | None = None
        self._stopping = False
        self._signals = 0

    def handle_exit(self, sig: int, frame: Any) -> None:
        loop = asyncio.get_event_loop()
        self._signals += 1  # counted here, synchronously: two signals in a row are a drain and a stop
        if self._signals == 1:
            loop.call_soon_threadsafe(self._start_drain, loop, signal.Signals(sig).name)
        elif self._signals == 2:
            self._stopping = True
            loop.call_soon_threadsafe(self._stop_now, signal.Signals(sig).name)
        else:  # already stopping: the executing batch returns within app.SETTLE_S, then the process exits
            loop.call_soon_threadsafe(log.warning, "%s: already stopping", signal.Signals(sig).name)

    def _start_drain(self, loop: asyncio.AbstractEventLoop, name: str) -> None:
        log.warning("%s: draining began (within %.0fs); send it again to stop at once", name, self.drain_timeout_s)
        self._draining = loop.create_task(self._drain_then_exit(time.monotonic() + self.drain_timeout_s))

    def _stop_now(self, name: str) -> None:
        """Second signal: requests in flight answer 503 now; uvicorn then closes the connections and runs the
        lifespan shutdown, which waits for the executing batch before closing the engine."""
        from server.app import stop_now

        log.warning("%s again: stopping now; requests in flight get 503", name)
        stop_now(self.drain_app)
        self.config.timeout_graceful_shutdown = STOP_GRACE_S
        self.should_exit = True

    async def _drain_then_exit(self, deadline: float) -> None:
        from server.app import drain

        try:
            await asyncio.wait_for(drain(self.drain_app), timeout=self.drain_timeout_s + 1)
        except TimeoutError:
            log.error("drain overran %.0fs: shutting down anyway", self.drain_timeout_s)
        finally:
            # uvicorn then waits for open connections (a client trickling a body keeps one open) only as long as
            # the drain budget has left, and cancels their requests after that.
            if not self._stopping:  # else a second signal has already set a shorter bound
                self.config.timeout_graceful_shutdown = max(1, math.ceil(deadline - time.monotonic()))
            self.should_exit = True

    async def startup(self, sockets: Any = None) -> None:
        """Log the bound address once uvicorn has started (port 0 picks a free port)."""
        await super().startup(sockets=sockets)
        for srv in getattr(self, "servers", []):
            for sock in srv.sockets:
                host, port = sock.getsockname()[:2]
                log.info("sdserve listening on http://%s:%d", host, port)


class Launcher:
    """Runs ``app`` until a signal or a fatal boot failure; ``run`` returns the process exit code."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.exit_code = ExitCode.OK
        self._server: _Server | None = None

    def on_fatal(self, code: ExitCode, reason: str) -> None:
        """Boot failed for good: stop serving and exit with ``code``."""
        self.exit_code = code
        if self._server is not None:
            self._server.should_exit = True

    def run(self, app: FastAPI) -> int:
        """Binds first (BindError: exit 12), then serves; raises ConfigError when RLIMIT_NOFILE is too low."""
        s = self.settings.server
        sock = bind(s.host, s.port)
        cap, backlog = fd_budget(s.max_connections)
        bounds = Bounds(cap, s.header_timeout_s)
        # log_config=None: uvicorn's lines go through our handler (text or JSON), not its own formatter; the
        # access log is ours (server/middleware.py GuardMiddleware), one line per request.
        config = _Config(app, bounds, host=s.host, port=s.port, log_level="warning", access_log=False,
                         log_config=None, lifespan="on", server_header=False, backlog=backlog,
                         timeout_keep_alive=max(1, round(s.header_timeout_s)),  # idle keep-alive: same bound
                         ws="none")  # no websocket routes
        repeat = RepeatFilter()
        for name in RATE_LIMITED_LOGGERS:
            logging.getLogger(name).addFilter(repeat)
        log.info("connections: at most %d open, request head within %.1fs; drain within %.0fs", cap,
                 s.header_timeout_s, self.settings.queue.drain_timeout_s)
        self._server = _Server(config, app, self.settings.queue.drain_timeout_s)
        self._server.run(sockets=[sock])
        return int(self.exit_code)

"""Owns the uvicorn server: binding, the logged address, connection bounds and signals. SIGTERM/SIGINT drain first
(/ready 503 at once, queued work finishes within the drain timeout), then shut down, all of it within
``queue.drain_timeout_s`` whatever clients do; the process exits with our code (0 when healthy) instead of uvicorn
re-raising the signal. A second signal stops at once, cleanly: every request in flight answers 503, the executing
batch stops at its next step boundary and the engine is closed only after it returned (no abort), exit code 0.

Hostile clients: connection bounds (request-head, body and reply deadlines, the cap, evictions, probe slots) are
server/connections.py's. Repeated log lines (accept errors, refusals, invalid requests) are rate-limited."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import resource
import signal
import socket
import time
from typing import Any

import uvicorn
from fastapi import FastAPI

from engines.errors import ConfigError
from server.connections import BoundedConfig, Bounds
from server.errors import BindError
from server.exitcodes import ExitCode
from server.settings import Settings

log = logging.getLogger("sdserve")
FD_RESERVE = 64
"""File descriptors kept free for the process itself (model files, logs, pipes) besides the accept backlog."""
STOP_GRACE_S = 5
"""After a second signal, how long uvicorn waits for connections to finish their (503) responses."""


class RepeatFilter(logging.Filter):
    """Lets the first record of each message template through, then at most one per ``interval_s`` carrying the
    count of those suppressed in between: an attack repeated 90,000 times writes a few lines, not 90,000."""

    def __init__(self, interval_s: float = 10.0, per_logger: bool = False) -> None:
        """``per_logger``: one key for the whole logger, for libraries that format their messages before logging
        (python_multipart: "... at index 17"), so that every malformed body would be a new template."""
        super().__init__()
        self.interval_s, self.per_logger = interval_s, per_logger
        self._last: dict[str, tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = record.name if self.per_logger else f"{record.name}:{record.msg}"
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
PER_LOGGER_LIMITED = ("python_multipart.multipart",)
"""Loggers rate-limited as a whole: python_multipart logs one WARNING per malformed multipart body (issue 32)."""


def rate_limit_logs() -> None:
    """RepeatFilters on the loggers an attacker can make repeat (once per logger, however often called)."""
    repeat = RepeatFilter()
    for names, per_logger in ((RATE_LIMITED_LOGGERS, False), (PER_LOGGER_LIMITED, True)):
        for name in names:
            logger = logging.getLogger(name)
            if not any(isinstance(f, RepeatFilter) for f in logger.filters):
                logger.addFilter(RepeatFilter(per_logger=True) if per_logger else repeat)


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
        bounds = Bounds(cap, s.header_timeout_s, s.write_timeout_s, s.probe_slots,
                        max_unread_bytes=s.max_unread_reply_mb << 20)
        # log_config=None: uvicorn's lines go through our handler (text or JSON), not its own formatter; the
        # access log is ours (server/middleware.py GuardMiddleware), one line per request.
        config = BoundedConfig(app, bounds, host=s.host, port=s.port, log_level="warning", access_log=False,
                         log_config=None, lifespan="on", server_header=False, backlog=backlog,
                         timeout_keep_alive=max(1, round(s.header_timeout_s)),  # idle keep-alive: same bound
                         ws="none")  # no websocket routes
        rate_limit_logs()
        log.info("connections: at most %d open (+%d probe slots), request head within %.1fs, replies taken "
                 "within %.0fs; drain within %.0fs", cap, s.probe_slots, s.header_timeout_s, s.write_timeout_s,
                 self.settings.queue.drain_timeout_s)
        self._server = _Server(config, app, self.settings.queue.drain_timeout_s)
        self._server.run(sockets=[sock])
        return int(self.exit_code)

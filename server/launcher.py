"""Owns the uvicorn server: binding, the logged address, and signals. SIGTERM/SIGINT drain first (/ready 503 at once,
queued work finishes within the drain timeout), then shut down; the process exits with our code (0 when healthy)
instead of uvicorn re-raising the signal. A second signal stops at once."""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Any

import uvicorn
from fastapi import FastAPI

from server.exitcodes import ExitCode
from server.settings import Settings

log = logging.getLogger("sdserve")


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self.drain_app = app
        self._draining: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._draining is not None:
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True
            return
        loop = asyncio.get_event_loop()
        loop.call_soon_threadsafe(self._start_drain, loop)

    def _start_drain(self, loop: asyncio.AbstractEventLoop) -> None:
        self._draining = loop.create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        from server.app import drain

        try:
            await drain(self.drain_app)
        finally:
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
        s = self.settings.server
        config = uvicorn.Config(app, host=s.host, port=s.port, log_level="warning", access_log=False, lifespan="on")
        self._server = _Server(config, app)
        self._server.run()
        return int(self.exit_code)

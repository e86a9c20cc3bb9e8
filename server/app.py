"""The FastAPI application: the lifespan owns the engine, the watchdog and the stderr tee; the port opens before
the model is proven (/health 200, /ready 503 with the state and reasons until the self-test passes)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from engines.faults import FaultInjector
from engines.ortlog import StderrTee
from engines.protocol import Engine
from engines.telemetry import TelemetrySource
from server import errors
from server.exitcodes import ExitCode, exit_code_for
from server.metrics import Metrics
from server.routes import debug, health, observability, openai_images
from server.service import ImageService
from server.settings import Settings
from server.state import ServerState
from server.watchdog import Watchdog

log = logging.getLogger(__name__)

OnFatal = Callable[[ExitCode, str], None]
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]


class MetricsMiddleware:
    """Counts every request by route template (never the raw path) and status, and times it."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Message]],
                       send: Callable[[Message], Awaitable[None]]) -> None:
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
            route = scope.get("route")
            path = str(getattr(route, "path", "unmatched"))
            self.metrics.requests.labels(path, str(status[0])).inc()
            self.metrics.request_seconds.labels(path).observe(time.perf_counter() - start)


async def boot(app: FastAPI) -> None:
    """preflight -> loading -> self-test -> ready; a failure marks the state failed and, per profile, exits."""
    engine: Engine = app.state.engine
    state: ServerState = app.state.server_state
    settings: Settings = app.state.settings
    metrics: Metrics = app.state.metrics
    try:
        state.set("preflight", ["checking versions, provider libraries and the device"])
        await run_in_threadpool(engine.preflight)
        state.set("loading", ["building sessions under the provider policy"])
        await run_in_threadpool(engine.load)
        state.set("self-test", ["warming up and timing canaries at every served shape"])
        async with app.state.service.lock:
            await run_in_threadpool(engine.self_test)
    except Exception as exc:  # every boot failure is reported, none escapes unlogged
        code = exit_code_for(exc)
        reason = str(exc) if code != ExitCode.INTERNAL else f"{type(exc).__name__}: {exc}"
        log.error("boot failed (exit code %d %s): %s", code, code.name, reason)
        state.set("failed", [reason])
        metrics.set_degraded({"boot_failed"})
        if settings.on_boot_failure == "exit":
            app.state.on_fatal(code, reason)
        return
    snapshot = engine.capabilities()
    for component, session in snapshot.get("sessions", {}).items():
        used = session.get("providers_used") or ["none"]
        metrics.provider.labels(component, used[0]).set(1)
        for event in session.get("ort_events", []):
            metrics.ort_events.labels(event["kind"]).inc()
    state.set("ready", [] if not settings.runtime.allow_cpu else ["accelerated: false (dev profile, CPU allowed)"])
    metrics.ready.set(1)
    log.info("ready: serving %s on %s", engine.info.name, settings.runtime.providers[0])
    if settings.watchdog.enabled:
        app.state.watchdog_task = asyncio.create_task(app.state.watchdog.run())


def create_app(engine: Engine, settings: Settings, on_fatal: OnFatal | None = None,
               telemetry: TelemetrySource | None = None, tee: StderrTee | None = None,
               faults: FaultInjector | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(boot(app))
        try:
            yield
        finally:
            tasks = [t for t in (task, getattr(app.state, "watchdog_task", None)) if t is not None]
            for t in tasks:
                t.cancel()
            await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=10)
            await run_in_threadpool(engine.close)

    app = FastAPI(title="sdserve", version="0.1.0", lifespan=lifespan,
                  description="Stable Diffusion text-to-image server that proves its GPU fast path.")
    metrics = Metrics(settings.runtime.device_id)
    state = ServerState()
    service = ImageService(engine, settings, metrics)
    app.state.engine, app.state.settings, app.state.metrics = engine, settings, metrics
    app.state.server_state, app.state.service, app.state.faults = state, service, faults
    app.state.watchdog = Watchdog(engine, service, state, settings, metrics, telemetry, tee)
    app.state.on_fatal = on_fatal or (lambda code, reason: None)
    errors.install(app)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    for router in (health.router, observability.router, openai_images.router):
        app.include_router(router)
    if settings.debug.fault_injection and faults is not None:
        app.include_router(debug.router)
    return app

"""The FastAPI application: lifespan owns the engine; the port opens before the model is proven."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from engines.errors import NotReadyError
from engines.protocol import Engine
from server import errors
from server.exitcodes import ExitCode, exit_code_for
from server.routes import health, openai_images
from server.service import ImageService
from server.settings import Settings
from server.state import ServerState

log = logging.getLogger(__name__)

OnFatal = Callable[[ExitCode, str], None]


async def boot(app: FastAPI) -> None:
    """preflight -> loading -> self-test -> ready; a failure marks the state failed and, per profile, exits."""
    engine: Engine = app.state.engine
    state: ServerState = app.state.server_state
    settings: Settings = app.state.settings
    try:
        state.set("preflight")
        await run_in_threadpool(engine.preflight)
        state.set("loading")
        await run_in_threadpool(engine.load)
        state.set("self-test")
        await run_in_threadpool(engine.self_test)
    except Exception as exc:  # every boot failure is reported, none escapes unlogged
        code = exit_code_for(exc)
        reason = str(exc) if isinstance(exc, NotReadyError | ValueError) or code != ExitCode.INTERNAL else repr(exc)
        log.error("boot failed (exit code %d %s): %s", code, code.name, reason)
        state.set("failed", [reason])
        if settings.on_boot_failure == "exit":
            app.state.on_fatal(code, reason)
        return
    reasons = [] if not settings.runtime.allow_cpu else ["accelerated: false (dev profile, CPU allowed)"]
    state.set("ready", reasons)
    log.info("ready: serving %s on %s", engine.info.name, settings.runtime.providers[0])


def create_app(engine: Engine, settings: Settings, on_fatal: OnFatal | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(boot(app))
        try:
            yield
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await run_in_threadpool(engine.close)

    app = FastAPI(title="sdserve", version="0.1.0", lifespan=lifespan,
                  description="Stable Diffusion text-to-image server that proves its GPU fast path.")
    app.state.engine = engine
    app.state.settings = settings
    app.state.server_state = ServerState()
    app.state.service = ImageService(engine, settings)
    app.state.on_fatal = on_fatal or (lambda code, reason: None)
    errors.install(app)
    app.include_router(health.router)
    app.include_router(openai_images.router)
    return app

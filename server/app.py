"""The FastAPI application: the lifespan owns the engine (and with it the ORT log tee), the batcher and
the watchdog; the port opens before
the model is proven (/health 200, /ready 503 with the state and reasons until the self-test passes)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool
from starlette.middleware.cors import CORSMiddleware

from engines.config import parse_size
from engines.protocol import Engine
from engines.types.health import Faults
from engines.types.snapshot import SelfTestReport
from server import errors, headers, images_in
from server.bootstrap import selftest_plan
from server.caching import Caching
from server.controlnet import ControlNetLibrary
from server.exitcodes import ExitCode, exit_code_for
from server.images import ImageStore
from server.metrics import Exposition, Metrics
from server.middleware import AuthMiddleware, BodyLimitMiddleware, GuardMiddleware, MetricsMiddleware
from server.routes import (
    a1111,
    a1111_extras,
    a1111_img2img,
    a1111_info,
    a1111_loras,
    controlnet,
    debug,
    edits,
    health,
    observability,
    openai_images,
)
from server.schemas import document_openapi
from server.service import ImageService
from server.settings import Settings
from server.state import ServerState
from server.strict_json import StrictJsonMiddleware
from server.tenants import TenantRegistry
from server.watchdog import Watchdog

log = logging.getLogger(__name__)
SETTLE_S = 60.0
DRAIN_ANSWER_S = 2.0
"""After the drain deadline: how long the requests of a stopped batch get to send their 503 before uvicorn closes."""
"""At shutdown, how long to wait for an executing batch to return before closing the engine: closing ONNX Runtime
sessions under a running batch can abort the process, so past this the engine is left to the process exit."""
EXPOSED_HEADERS = headers.RESPONSE
"""What CORS lets a browser read: every header a response may carry (server/headers.py)."""

OnFatal = Callable[[ExitCode, str], None]


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
        if settings.cache.policy != "off":
            state.set("self-test", ["gating the step cache: canaries cached and uncached"])
            async with app.state.service.lock:
                await run_in_threadpool(gate_cache, app.state.service.caching, engine, settings)
    except Exception as exc:  # every boot failure is reported, none escapes unlogged
        code = exit_code_for(exc)
        reason = str(exc) if code != ExitCode.INTERNAL else f"{type(exc).__name__}: {exc}"
        log.error("boot failed (exit code %d %s): %s", code, code.name, reason)
        public = str(exc) if code != ExitCode.INTERNAL else "internal error during boot (details: the log)"
        state.set("failed", [public], details=[reason], codes=[code.name.lower()])
        metrics.set_degraded({"boot_failed"})
        if settings.on_boot_failure == "exit":
            app.state.on_fatal(code, reason)
        return
    snapshot = engine.capabilities()
    _seed_costs(app, engine, settings, snapshot.self_test)
    await run_in_threadpool(app.state.service.measure_memory)  # admission by memory: the budget after warm-up
    unet = snapshot.sessions.get("unet") or next(iter(snapshot.sessions.values()), None)
    if unet is not None and unet.providers_used:
        app.state.watchdog.expect_provider(unet.providers_used[0])
    for component, session in snapshot.sessions.items():
        metrics.provider.labels(component, (session.providers_used or ("none",))[0]).set(1)
        for event in session.ort_events:
            metrics.ort_events.labels(event.kind).inc()
    state.set("ready", [] if not settings.runtime.allow_cpu else ["accelerated: false (dev profile, CPU allowed)"])
    metrics.ready.set(1)
    runtime = settings.runtime  # a plugin-EP policy lists no built-in providers
    log.info("ready: serving %s on %s", engine.info.name, (runtime.accelerators or runtime.providers)[0])
    if settings.watchdog.enabled:
        app.state.watchdog_task = asyncio.create_task(app.state.watchdog.run())


def gate_cache(caching: Caching, engine: Engine, settings: Settings) -> None:
    """The step cache's quality gate at every served size (server/caching.py): the canaries cached and uncached;
    a failed gate keeps the cache off at that size, never fails the boot."""
    suite = selftest_plan(settings).suite.for_family(engine.info.family)
    sizes = [parse_size(s) for s in settings.serving.sizes] or [(engine.info.default_size,) * 2]
    caching.run_gate(engine.generate, list(dict.fromkeys(sizes)), suite.canary, suite.scheduler,
                     suite.guidance_scale, engine.info.default_steps)


def _seed_costs(app: FastAPI, engine: Engine, settings: Settings, report: SelfTestReport | None) -> None:
    """Admission's first per-step costs: the self-test's timed canaries (then live batches refine them), scaled to
    other sizes by the model's own work per step (a DiT by its tokens: engines.types.model.ModelInfo.work)."""
    info = engine.info
    app.state.service.cost.scale_by(info.work, info.work_basis, info.reference_tokens)
    if report is None:
        return
    try:
        steps = selftest_plan(settings).suite.for_family(engine.info.family).steps
    except Exception:  # admission then starts from live batches; never a boot failure of its own
        log.warning("canary steps unknown: admission costs start from live batches", exc_info=True)
        return
    app.state.service.seed_costs([(s.shape, s.p50_s) for s in report.shapes], steps)
    edit = selftest_plan(settings).suite.for_family(info.family, info.instruct_images > 0).edit
    if edit is not None:  # the edit canary: an edit's steps at its reference tokens, measured apart
        for s in report.edits:
            width, height, batch = (int(v) for v in s.shape.removesuffix("-edit").split("x"))
            app.state.service.cost.seed(width, height, batch, edit.steps or steps, s.p50_s,
                                        info.reference_tokens(((edit.image, edit.image),)))


def create_app(engine: Engine, settings: Settings, on_fatal: OnFatal | None = None,
               faults: Faults | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(boot(app))
        batching = asyncio.create_task(app.state.service.batcher.run())
        try:
            yield
        finally:
            tasks = [t for t in (task, batching, getattr(app.state, "watchdog_task", None)) if t is not None]
            settled = await app.state.service.settle(SETTLE_S)  # cancelling the batcher does not stop its thread
            for t in tasks:
                t.cancel()
            await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=10)
            if settled:
                await run_in_threadpool(engine.close)
            else:
                log.error("a batch was still executing %.0fs into shutdown: exiting without closing the engine",
                          SETTLE_S)

    app = FastAPI(title="sdserve", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="Stable Diffusion text-to-image server that proves its GPU fast path.")
    metrics = Metrics(settings.runtime.device_id)
    state = ServerState()
    tenants = TenantRegistry(settings.auth)  # ConfigError (exit 10) for a tenants file unreadable at boot
    tenants.watch_slos(metrics.set_tenant_slos)  # sdserve_tenant_slo_p95_seconds at boot and on every good reload
    service = ImageService(engine, settings, metrics, state, tenants=tenants)
    app.state.engine, app.state.settings, app.state.metrics = engine, settings, metrics
    app.state.exposition = Exposition(metrics.registry, settings.server.metrics_cache_s)
    app.state.server_state, app.state.service, app.state.faults = state, service, faults
    app.state.tenants = tenants
    app.state.watchdog = Watchdog(engine, service, state, settings, metrics)
    app.state.on_fatal = on_fatal or (lambda code, reason: None)
    app.state.image_store = ImageStore(max_bytes=settings.server.url_store_max_bytes)
    # A1111's ControlNet routes read this library; without a folder they list nothing (server/routes/controlnet.py)
    app.state.controlnets = (ControlNetLibrary(Path(settings.runtime.controlnet.dir))
                             if settings.runtime.controlnet.dir else None)
    images_in.configure(settings.limits.max_jpeg_scans, settings.limits.decode_concurrency)
    errors.install(app)
    _add_middleware(app, settings, metrics, tenants)
    for router in (health.router, observability.router, openai_images.router, a1111.router, a1111_info.router,
                   a1111_loras.router, edits.router, a1111_img2img.router, a1111_extras.router,
                   controlnet.router):
        app.include_router(router)
    if settings.debug.fault_injection and faults is not None:
        app.include_router(debug.router)
    app.openapi = lambda: document_openapi(app, settings.auth)  # type: ignore[method-assign]
    return app


def _add_middleware(app: FastAPI, settings: Settings, metrics: Metrics, tenants: TenantRegistry) -> None:
    """Outermost last: guard -> CORS (when configured) -> metrics -> auth -> body cap and deadline -> strict JSON
    -> routes. CORS sits outside auth: a browser's preflight carries no credentials. Auth sits outside the body
    reader: a request without valid credentials is refused on its headers, its body never read."""
    auth, server = settings.auth, settings.server
    app.add_middleware(StrictJsonMiddleware, keep_prompt=server.log_prompts)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.queue.max_body_bytes, timeout_s=server.body_timeout_s,
                       upload_paths=edits.EDIT_PATHS,
                       upload_max_bytes=max(settings.limits.max_upload_bytes, settings.queue.max_body_bytes))
    app.add_middleware(AuthMiddleware, registry=tenants, exempt=auth.exempt_paths)
    app.add_middleware(MetricsMiddleware, metrics=metrics)  # sees every status, 401/413/500 included
    if server.cors_origins or server.cors_origin_regex:
        app.add_middleware(CORSMiddleware, allow_origins=list(server.cors_origins), allow_credentials=False,
                           allow_origin_regex=server.cors_origin_regex or None,
                           allow_methods=["GET", "HEAD", "POST"], expose_headers=list(EXPOSED_HEADERS),
                           allow_headers=list(headers.REQUEST),
                           max_age=600)
    app.add_middleware(GuardMiddleware, log_prompts=server.log_prompts)


async def drain(app: FastAPI) -> None:
    """SIGTERM: /ready 503 at once; queued and running work finishes within the drain timeout; the rest gets 503."""
    state: ServerState = app.state.server_state
    settings: Settings = app.state.settings
    state.set("draining", ["shutting down: finishing queued work, accepting none"])
    log.warning("draining: /ready is 503, queued work finishes within %.0fs; a second SIGTERM/SIGINT stops at once",
                settings.queue.drain_timeout_s)
    app.state.metrics.ready.set(0)
    watchdog = getattr(app.state, "watchdog_task", None)
    if watchdog is not None:
        watchdog.cancel()
    service = app.state.service
    failed = await service.batcher.drain(settings.queue.drain_timeout_s)
    log.warning("drained: %d queued request(s) were not started before the %.0fs drain deadline", failed,
                settings.queue.drain_timeout_s)
    if not service.batcher.running:
        # Every batch finished: its requests still encode and send their images (a moment after the batch ends);
        # let them answer instead of mistaking them for work the deadline cut off.
        await service.quiesce(DRAIN_ANSWER_S)
    if service.batcher.running or service.waiting:
        # The deadline passed with a batch still executing: stop it at its next step boundary and answer its
        # requests 503 now, as a second signal would, so the process exits within the drain bound.
        log.warning("drain deadline passed with a batch executing: stopping it at the next step boundary; its "
                    "requests get 503")
        stop_now(app, "drain deadline passed: the executing batch stops at its next step boundary; its requests "
                      "got 503")
        await service.quiesce(DRAIN_ANSWER_S)


def stop_now(app: FastAPI, reason: str = "stopping now: a second signal; requests in flight got 503") -> None:
    """A second SIGTERM/SIGINT: every request still waiting answers 503 at once and the executing batch stops at
    its next step boundary; the lifespan then waits for it before closing the engine (no abort)."""
    app.state.server_state.set("draining", [reason])
    app.state.metrics.ready.set(0)
    app.state.service.stop()

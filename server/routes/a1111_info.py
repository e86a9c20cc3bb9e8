"""The AUTOMATIC1111 routes clients call to connect and to watch a job: options, progress, interrupt/skip, listings.

Shapes follow AUTOMATIC1111/stable-diffusion-webui ``modules/api/models.py`` (ProgressRequest, ProgressResponse,
SchedulerItem, UpscalerItem, LatentUpscalerModeItem, SDVaeItem, HypernetworkItem, FaceRestorerItem, RealesrganItem,
PromptStyleItem, EmbeddingsResponse, MemoryResponse, ScriptInfo, ExtensionItem), the handlers in
``modules/api/api.py`` (``progressapi``, ``interruptapi`` -> ``{}``, ``skip``, ``get_config``/``set_config``,
``get_schedulers``, ``get_memory``, ``refresh_checkpoints`` -> null) and ``State.dict()`` in
``modules/shared_state.py``. ``/sdapi/v1/sd-modules`` is Forge's (SillyTavern asks it); it answers an empty list
here. ``/sdapi/v1/loras`` (A1111's built-in Lora extension's route) lists the adapter library:
server/routes/a1111_loras.py.

What is listed is what sdserve has: the Hires fix upscalers None, Lanczos and Nearest (``modules/upscaler.py``;
"None" first, which SillyTavern expects), the schedules it serves (``modules/sd_schedulers.py``), no VAEs,
hypernetworks, face restorers, styles or embeddings. ``POST /sdapi/v1/png-info`` reads an image's infotext
back as A1111's ``pnginfoapi`` does.

Progress comes from the engine's step hook (engines.types.request.StepHook): ``sampling_step``/``sampling_steps`` of the
executing batch, ``progress`` = steps done / steps (at least 0.01 once started, A1111's floor), ``eta_relative`` from
the batch's step rate plus the queued batches at the recent batch time; ``state.job_count`` is the requests waiting
plus the batches executing. ``current_image`` is always null (no live previews: the latents stay on the device).
While the model boots (or the watchdog holds it degraded) the boot counts as one job, so ``util_wait_for_ready``
(webuiapi) and SillyTavern's set-model wait until the server can generate; after a failed boot /progress is 503.
/interrupt stops the caller's queued requests at once (they answer 409) and its running batch at the next step
boundary (the images are decoded from the latents so far and the response says it was interrupted); /skip stops
only the running batch. In a micro-batch shared with another caller's request the batch runs on (the response says
so): one caller never cuts another's images short. With API keys each key's tenant sees only its own jobs
(``caller_view``: another tenant's step, ETA or count never; issue 52 point 4) and reads and writes its own
options.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

from fastapi import APIRouter, FastAPI, Request, Response
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from server import headers
from server.a1111_options import OptionsStore, model_title
from server.batcher import Batcher, Progress
from server.controlnet import script_info as controlnet_script_info
from server.edits import within_deadline
from server.hires import UPSCALERS, served_latent_modes
from server.images_in import decoding_for
from server.infotext_parse import png_info_body
from server.middleware import tenant_label
from server.routes.a1111 import SCHEDULES, served_schedules
from server.routes.a1111_extras import library as extras_library
from server.schemas import error_responses

router = APIRouter(prefix="/sdapi/v1", tags=["automatic1111"])

BOOTING = ("starting", "preflight", "loading", "self-test", "degraded")
"""Server states in which a generation would get 503 but the server will (or may) become ready."""


def options_store(app: FastAPI) -> OptionsStore:
    """The process's options store, created on first use (one per app)."""
    store = getattr(app.state, "a1111_options", None)
    if store is None:
        store = app.state.a1111_options = OptionsStore()
    return store


@router.get("/options")
async def get_options(request: Request) -> dict[str, Any]:
    """The options A1111 clients read to connect (503 until the model is loaded); the writable ones are the
    caller's tenant's."""
    return options_store(request.app).snapshot(request.app.state.engine.info, caller(request))


@router.post("/options")
async def set_options(body: dict[str, Any], request: Request) -> None:
    """Writes sdserve can honour persist for the process, for the caller's tenant only; anything else is 422 naming
    the key (A1111 returns null)."""
    options_store(request.app).apply(body, request.app.state.engine.info, caller(request))


class ProgressState(BaseModel):
    """A1111's ``State.dict()``."""

    skipped: bool = False
    interrupted: bool = False
    stopping_generation: bool = False
    job: str = ""
    job_count: int = 0
    job_timestamp: str = "0"
    job_no: int = 0
    sampling_step: int = 0
    sampling_steps: int = 0


class ProgressResponse(BaseModel):
    progress: float = Field(ge=0, le=1, description="0 when idle; 0.01 while busy (steps are not reported yet)")
    eta_relative: float = Field(ge=0, description="seconds, estimated from recent batch times; 0 when unknown")
    state: ProgressState
    current_image: str | None = None
    textinfo: str | None = None


@router.get("/progress", response_model=ProgressResponse)
async def progress(request: Request, skip_current_image: bool = False) -> ProgressResponse:
    """Step-level progress of the executing batch; ``skip_current_image`` is accepted (no preview image exists)."""
    state = request.app.state.server_state
    if state.state == "failed":
        request.app.state.service.require_ready()  # raises the permanent 503 with the boot failure
    batcher = request.app.state.service.batcher
    queued, running, now, ahead = caller_view(batcher, caller(request))
    booting = state.state in BOOTING
    jobs = queued + running + int(booting)
    if jobs == 0:
        return ProgressResponse(progress=0.0, eta_relative=0.0, state=ProgressState())
    ahead_s = math.ceil(ahead / batcher.max_batch) * batcher.stats.batch_seconds
    if booting:
        job, text = f"sdserve: {state.state}", "; ".join(state.reasons) or f"server is {state.state}"
        return ProgressResponse(progress=0.01, eta_relative=round(ahead_s, 3),
                                state=ProgressState(job=job, job_count=jobs), textinfo=text)
    done, total = (now.steps_done, now.steps_total) if now is not None else (0, 0)
    fraction = max(0.01, done / total) if total else 0.01
    eta = ahead_s + (_remaining_s(now) if now is not None else batcher.stats.batch_seconds)
    text = f"{queued} request(s) queued, {running} running, step {done}/{total}"
    return ProgressResponse(progress=round(min(fraction, 1.0), 4), eta_relative=round(eta, 3),
                            state=ProgressState(job="sdserve: generating" if running else "sdserve: queued",
                                                job_count=jobs, sampling_step=done, sampling_steps=total),
                            textinfo=text)


def caller_view(batcher: Batcher, owner: str | None) -> tuple[int, int, Progress | None, int]:
    """What /progress shows ``owner``: (requests queued, running, the progress to report, images queued up to its
    last queued request). While every job in sight is the caller's (always without auth) that is the server's
    whole state, as before tenants. Once another tenant's job is queued or running, only the caller's own are
    counted and only its own running job's step and ETA are reported (issue 52 point 4): none of another
    tenant's."""
    live = [*batcher._live, *batcher.rows()]  # the jobs executing: a batch run whole, and rows stepped
    queue = list(batcher.queue)
    if all(job.owner == owner for job in (*live, *queue)):
        return len(queue), batcher.running, batcher.progress_for(owner), sum(job.images for job in queue)
    mine = [i for i, job in enumerate(queue) if job.owner == owner]
    ahead = sum(job.images for job in queue[:mine[-1] + 1]) if mine else 0
    rows = [job for job in batcher.rows() if job.owner == owner]
    whole = any(job.owner == owner for job in batcher._live)
    stepped = [job for job in rows if job.run is not None]
    if stepped:  # the caller's oldest stepped request, as the step batcher's progress_for picks it
        job = min(stepped, key=lambda j: j.enqueued)
        assert job.run is not None
        now: Progress | None = Progress(job.run.steps_done, job.run.steps_total, job.started, job.images)
    else:
        now = batcher.progress if whole else None
    return len(mine), len(rows) + int(whole), now, ahead


def _remaining_s(now: Progress) -> float:
    """Seconds left in the executing batch at its step rate so far."""
    if now.steps_done == 0 or now.steps_total == 0:
        return 0.0
    elapsed = time.perf_counter() - now.started
    return elapsed / now.steps_done * (now.steps_total - now.steps_done)


class InterruptResponse(BaseModel):
    """A1111 answers ``{}``; sdserve says what it stopped."""

    interrupted: bool = Field(description="true when a running or queued request of the caller was stopped")
    queued: int = Field(description="the caller's queued requests dropped (they answer 409)")
    running: int = Field(description="the caller's running requests stopping at the next step boundary")
    detail: str


def caller(request: Request) -> str:
    """The caller's tenant (server/middleware.py ``tenant_label``), as the generation routes name their jobs'
    owner: ``default`` when auth is off (one caller, as in A1111)."""
    return tenant_label(request.scope)


def _stop(request: Request, response: Response, queued_too: bool) -> InterruptResponse:
    batcher = request.app.state.service.batcher
    running, queued = batcher.interrupt(caller(request), queued_too)
    if running or queued:
        response.headers[headers.INTERRUPT] = "stopping"
        detail = (f"{running} running request(s) stop at the next step boundary; {queued} queued request(s) "
                  "dropped")
    else:
        response.headers[headers.INTERRUPT] = "idle"
        detail = "nothing to stop: the caller has no request queued or running"
    return InterruptResponse(interrupted=bool(running or queued), queued=queued, running=running, detail=detail)


@router.post("/interrupt", response_model=InterruptResponse)
async def interrupt(request: Request, response: Response) -> InterruptResponse:
    """Stop the caller's running request at the next step boundary and drop its queued ones."""
    return _stop(request, response, queued_too=True)


@router.post("/skip", response_model=InterruptResponse)
async def skip(request: Request, response: Response) -> InterruptResponse:
    """Stop the caller's running request at the next step boundary (queued ones run)."""
    return _stop(request, response, queued_too=False)


@router.get("/schedulers")
async def schedulers(request: Request) -> list[dict[str, Any]]:
    """The schedule types sdserve serves on the loaded model (A1111's modules/sd_schedulers.py shape): Automatic
    (the sampler's own), Uniform, Karras, Exponential, SGM Uniform on the UNet families; Automatic only where the
    family has one schedule (the flow-matching families: FLUX.1, FLUX.2, SD 3.x, Qwen-Image, Z-Image), as the model's
    ModelInfo.schedulers says."""
    served = served_schedules(request.app.state.engine.info.schedulers)
    return [{"name": aliases[0], "label": label, "aliases": list(aliases[1:]) or None,
             "default_rho": 7.0 if label == "Karras" else -1.0, "need_inner_model": False}
            for label, (_, aliases) in SCHEDULES.items() if label in served]


@router.get("/upscalers")
async def upscalers(request: Request) -> list[dict[str, Any]]:
    """The Hires fix upscalers sdserve offers (server/hires.py), as A1111 lists its built-in ones
    (modules/upscaler.py UpscalerNone, UpscalerLanczos, UpscalerNearest: no model files, scale 4); "None" first,
    which SillyTavern expects. Then the ONNX upscalers of ``[runtime] upscaler_dir``, which the extras routes
    serve (server/routes/a1111_extras.py; model_path is the file's name only)."""
    return [*({"name": name, "model_name": None, "model_path": None, "model_url": None, "scale": 4.0}
              for name in UPSCALERS),
            *({"name": name, "model_name": name, "model_path": f"{name}.onnx", "model_url": None, "scale": scale}
              for name, scale in extras_library(request).listed() if name not in UPSCALERS)]


@router.get("/latent-upscale-modes")
async def latent_upscale_modes() -> list[dict[str, str]]:
    """A1111's latent upscale modes sdserve serves for Hires fix (server/hires.py; the antialiased ones are not)."""
    return [{"name": name} for name in served_latent_modes()]


class PngInfoRequest(BaseModel):
    image: str = Field(description="A base64 image (with or without a data: prefix): PNG, JPEG or WebP")


class PngInfoResponse(BaseModel):
    info: str = Field(description="The image's infotext: its PNG parameters text or EXIF UserComment; \"\" if none")
    items: dict[str, Any] = Field(description="The image's other text items")
    parameters: dict[str, Any] = Field(description="The infotext parsed as A1111's parse_generation_parameters")


@router.post("/png-info", response_model=PngInfoResponse,
             responses=error_responses(401, 413, 422, 500, validation=True))
async def png_info(req: PngInfoRequest, request: Request) -> Response:
    """The generation parameters written into an image (by sdserve or A1111), as A1111's pnginfoapi reads them:
    decoded under the upload limits (an image that is not one is a 422 naming ``image``), read and parsed in a
    worker thread under the request's deadline, bounded (server/infotext_parse.py)."""
    limit = request.app.state.settings.limits.max_image_pixels
    deadline = request.app.state.service.deadline(request.headers.get(headers.TIMEOUT))
    with decoding_for(caller(request)):  # the decoders are shared fairly across tenants
        body = await within_deadline(deadline, png_info_body, req.image, limit)
    return Response(body, media_type="application/json")


@router.get("/sd-vae")
@router.get("/sd-modules")
@router.get("/hypernetworks")
@router.get("/face-restorers")
@router.get("/realesrgan-models")
@router.get("/prompt-styles")
@router.get("/extensions")
async def empty_listing() -> list[dict[str, Any]]:
    """Nothing of this kind exists in sdserve: the served model's own VAE is the only one, and there are no
    modules, hypernetworks, face restorers, ESRGAN models, styles, scripts or extensions (LoRAs:
    server/routes/a1111_loras.py)."""
    return []


@router.get("/script-info")
async def script_info(request: Request) -> list[dict[str, Any]]:
    """A1111's scripts with their arguments: sd-webui-controlnet's always-on ``controlnet`` on txt2img and img2img
    (one argument per unit) when a ControlNet folder is served (server/controlnet.py), else none."""
    library = getattr(request.app.state, "controlnets", None)
    return controlnet_script_info(library.unit_count) if library is not None else []


@router.get("/embeddings")
async def embeddings() -> dict[str, dict[str, Any]]:
    """No textual-inversion embeddings are loaded."""
    return {"loaded": {}, "skipped": {}}


@router.post("/refresh-checkpoints")
@router.post("/refresh-vae")
@router.post("/refresh-embeddings")
async def refresh() -> None:
    """A no-op, answered as A1111 does (null): one model is served per process, fixed at boot."""


class CheckpointAnswer(BaseModel):
    """A1111 answers ``{}``; sdserve says what happened to the one model it serves."""

    resident: bool = Field(description="true: the served model stays loaded (sdserve never unloads it)")
    model: str = Field(description="the served model's A1111 title")
    detail: str


RESIDENT = ("sdserve keeps its one model resident for the life of the process: it was proven at boot (placement, "
            "canaries), and unloading it would take /ready down until a reload proved it again")


@router.post("/unload-checkpoint", response_model=CheckpointAnswer)
async def unload_checkpoint(request: Request, response: Response) -> CheckpointAnswer:
    """A1111 frees the model's memory (text-generation-webui's sd_api_pictures asks before its LLM runs); sdserve
    does not, and says so: nothing is freed, the next generation needs no reload."""
    response.headers[headers.RESIDENT] = "true"
    return CheckpointAnswer(resident=True, model=model_title(request.app.state.engine.info),
                            detail=f"not unloaded: {RESIDENT}; no device memory was freed")


@router.post("/reload-checkpoint", response_model=CheckpointAnswer)
async def reload_checkpoint(request: Request, response: Response) -> CheckpointAnswer:
    """A1111 moves the model back to the device; sdserve's model never left it."""
    response.headers[headers.RESIDENT] = "true"
    return CheckpointAnswer(resident=True, model=model_title(request.app.state.engine.info),
                            detail=f"already loaded: {RESIDENT}")


@router.get("/cmd-flags")
async def cmd_flags(request: Request) -> dict[str, Any]:
    """The A1111 flags that describe this server (API only, no UI, no server-stop routes), and its profile."""
    return {"api": True, "nowebui": True, "api_server_stop": False, "api_log": False,
            "sdserve_profile": request.app.state.settings.profile}


def _ram() -> dict[str, Any]:
    """A1111's ``ram``: this process's resident memory against the machine's (Linux /proc)."""
    try:
        with open("/proc/self/statm") as statm:
            used = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError) as exc:
        return {"error": str(exc)}
    return {"free": total - used, "used": used, "total": total}


async def _cuda(app: FastAPI) -> dict[str, Any]:
    """A1111's ``cuda.system`` from NVML through the engine's telemetry; A1111's "unavailable" without a GPU."""
    source = app.state.watchdog.telemetry
    if source is None:
        return {"error": "unavailable"}
    device = app.state.settings.runtime.device_id
    try:
        sample = await run_in_threadpool(source.sample, device)
    except Exception as exc:  # NVML's error family: report it as A1111 does, never fail the route
        return {"error": str(exc)}
    observations = app.state.engine.capabilities().observations
    devices = observations.nvml.devices if observations is not None else ()
    total = next((d.memory_total_bytes for d in devices if d.index == device), 0)
    if not total:
        return {"error": "total device memory unknown", "used": sample.memory_used_bytes}
    used = sample.memory_used_bytes
    return {"system": {"free": total - used, "used": used, "total": total}}


@router.get("/memory")
async def memory(request: Request) -> dict[str, dict[str, Any]]:
    """A1111's MemoryResponse; ``cuda`` holds the device totals only (no torch allocator statistics exist here)."""
    return {"ram": _ram(), "cuda": await _cuda(request.app)}


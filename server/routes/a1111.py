"""AUTOMATIC1111-compatible API: POST /sdapi/v1/txt2img, GET /sdapi/v1/samplers, GET /sdapi/v1/sd-models.
Validation errors are 422 with FastAPI's `detail` list (what A1111 clients expect)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection
from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

import engines.families as families
from engines.errors import InvalidRequestError
from engines.types.model import ModelInfo
from engines.types.request import Batch
from server import headers
from server.a1111_options import OptionsStore, set_overrides
from server.a1111_request import Txt2ImgRequest as Txt2ImgRequest  # its old home: importers still find it here
from server.a1111_request import from_a1111
from server.controlnet import parse_units, record_control, served_names
from server.hires import HiresPlan, make_plan, run_hires
from server.images import embed_infotext
from server.middleware import tenant_label
from server.provenance_stage import stamp_a1111
from server.request_rules import resolve_size
from server.routes.a1111_infotext import generation_info
from server.schemas import error_responses
from server.service import b64
from server.settings import Settings

router = APIRouter(prefix="/sdapi/v1", tags=["automatic1111"])

SAMPLERS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "Euler": ("euler", ("k_euler",), ""),
    "Euler a": ("euler_a", ("k_euler_a", "k_euler_ancestral"), ""),
    "DDIM": ("ddim", (), ""),
    "DPM++ 2M": ("dpmpp_2m", ("k_dpmpp_2m",), "karras"),
    "DPM++ 2M SDE": ("dpmpp_2m_sde", ("k_dpmpp_2m_sde",), "exponential"),
    "DPM++ 2M SDE Heun": ("dpmpp_2m_sde_heun", ("k_dpmpp_2m_sde_heun",), "exponential"),
    "LMS": ("lms", ("k_lms",), ""),
    "Heun": ("heun", ("k_heun",), ""),
    "UniPC": ("unipc", ("unipc",), ""),
    "PLMS": ("plms", ("plms",), ""),
}
"""A1111 sampler -> (our sampler, A1111's aliases, the schedule A1111's "Automatic" means for it: its
modules/sd_samplers_kdiffusion.py ``options["scheduler"]``; "" = the model's own scheduler_config, as for Euler)."""
FIXED_SCHEDULE = ("ddim", "plms")
"""Our samplers that take no schedule suffix (their diffusers schedulers have no sigma-schedule options)."""
SCHEDULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "Automatic": ("", ("automatic",)), "Uniform": ("uniform", ("uniform",)), "Karras": ("karras", ("karras",)),
    "Exponential": ("exponential", ("exponential",)), "SGM Uniform": ("sgm_uniform", ("sgm_uniform", "SGMUniform")),
}
"""A1111 schedule type (modules/sd_schedulers.py label) -> (our scheduler-name suffix, A1111's name and aliases)."""
UNSERVED: dict[str, str] = {
    **dict.fromkeys(("DPM2", "DPM2 a", "DPM++ 2S a"), "its second model call per step, at a midpoint sigma, is "
                    "not implemented"),
    **dict.fromkeys(("DPM adaptive", "Restart"), "it calls the model a varying number of times per step"),
    "DPM++ SDE": "its noise comes from a torchsde Brownian tree",
    "DPM++ 3M SDE": "it needs the two previous steps' predictions",
    "DPM fast": "it calls the model a varying number of times per step",
    "DDIM CFG++": "it re-noises with the unconditional prediction alone",
    "LCM": "it needs LCM-distilled weights",
}
"""A1111 samplers sdserve refuses, and why (engines/numerics/schedulers.py's docstring has the details)."""
_BY_NAME = {alias.lower(): name for name, (_, aliases, _) in SAMPLERS.items() for alias in (name, *aliases)}
_SCHEDULE_BY_NAME = {alias.lower(): label for label, (_, aliases) in SCHEDULES.items() for alias in (label, *aliases)}
_A1111_SCHEDULES = ("Polyexponential", "KL Optimal", "Align Your Steps", "Simple", "Normal", "Beta",
                    "Karras Exponential")
"""A1111's other schedule types (refused): recognized as a suffix of a legacy sampler name."""


def ignored_headers(response: Response, ignored: dict[str, str]) -> list[str]:
    """``x-sdserve-ignored-fields`` (names percent-encoded: headers.token; the info JSON has them as sent) and the
    warning line."""
    if not ignored:
        return []
    names = sorted(ignored)
    headers.put(response.headers, headers.IGNORED_FIELDS, headers.tokens(names))
    return [f"ignored A1111 fields: {', '.join(names)}"]


class Txt2ImgResponse(BaseModel):
    images: list[str]
    parameters: dict[str, Any]
    info: str
    """JSON text, as A1111 returns it."""


def _split_schedule(name: str) -> tuple[str, str | None]:
    """A legacy combined name ("DPM++ 2M Karras") -> ("DPM++ 2M", "Karras"), as A1111's
    modules/sd_samplers.py get_sampler_and_scheduler strips a schedule label, name or alias."""
    samplers = {*_BY_NAME, *(s.lower() for s in UNSERVED)}
    for suffix in (*_SCHEDULE_BY_NAME, *(s.lower() for s in _A1111_SCHEDULES)):
        if name.lower().endswith(" " + suffix) and name[: -len(suffix) - 1].lower() in samplers:
            return name[: -len(suffix) - 1], name[-len(suffix):]
    return name, None


def resolve_sampler(name: str, schedule: str | None = None, notes: list[str] | None = None,
                    served: Collection[str] | None = None) -> str:
    """The API scheduler name for an A1111 sampler name or alias and schedule type ("DPM++ 2M", "Karras" ->
    "dpmpp_2m_karras"); a schedule in the name wins, as in A1111. An unknown sampler, or one that does not run on the
    served model (``served``: its scheduler names; flow models run Euler, Euler a, DPM++ 2M and UniPC), is a 422 naming
    sampler_name and listing the A1111 names that run. A schedule sdserve does not serve with it, or one the sampler
    takes none of (DDIM, PLMS), is a 422 naming scheduler, unless ``notes`` is given: then it falls back to Automatic as
    A1111's get_sampler_and_scheduler does for a scheduler it cannot use, and the fallback is appended to ``notes``."""
    base, suffix = _split_schedule(name)
    label = _BY_NAME.get(base.lower())
    if label is None or (served is not None and not _schedules(label, served)):
        available = list(SAMPLERS) if served is None else served_samplers(served)
        why = next((f": sdserve does not implement it ({reason})" for s, reason in UNSERVED.items()
                    if s.lower() == base.lower()), "") if label is None else ": it does not run on the served model"
        raise InvalidRequestError(f"unknown sampler {name!r}{why}; available: {available}"
                                  if label is None else f"sampler {name!r}{why}; available: {available}",
                                  param="sampler_name")
    offered = _schedules(label, served)
    wanted = suffix or schedule or "Automatic"
    known = _SCHEDULE_BY_NAME.get(wanted.lower())
    if known is None or known not in offered:
        if notes is None:
            raise InvalidRequestError(f"scheduler {wanted!r} is not supported with {label}; available: {offered}",
                                      param="scheduler")
        ours = SAMPLERS[label][0]
        why = "it takes no schedule type" if ours in FIXED_SCHEDULE else f"sdserve serves {offered}"
        fallback = "Automatic" if "Automatic" in offered else offered[0]
        notes.append(f"scheduler {wanted[:64]!r} ignored for {label} ({why}): used {fallback}, as A1111 does "
                     "for a scheduler it cannot use")
        known = fallback
    return _full_name(label, known, served)


def _full_name(label: str, schedule: str, served: Collection[str] | None = None) -> str:
    """Our scheduler name for an A1111 sampler label and schedule label. Automatic is the sampler's A1111 default
    schedule where the model serves it, else the model's own (flow-matching models: their flow schedule)."""
    ours, _, automatic = SAMPLERS[label]
    chosen = SCHEDULES[schedule][0] or automatic
    if not SCHEDULES[schedule][0] and served is not None and f"{ours}_{chosen}" not in served and ours in served:
        chosen = ""
    return f"{ours}_{chosen}" if chosen else ours


def _schedules(label: str, served: Collection[str] | None) -> list[str]:
    """The schedule labels the sampler takes (DDIM and PLMS: Automatic only), those whose scheduler runs on the
    served model when ``served`` is given."""
    offered = ["Automatic"] if SAMPLERS[label][0] in FIXED_SCHEDULE else list(SCHEDULES)
    return offered if served is None else [s for s in offered if _full_name(label, s, served) in served]


def served_samplers(served: Collection[str]) -> list[str]:
    """The A1111 sampler names that run on a model serving the schedulers ``served`` (GET /sdapi/v1/samplers)."""
    return [label for label in SAMPLERS if _schedules(label, served)]


def served_schedules(served: Collection[str]) -> list[str]:
    """The A1111 schedule types some sampler runs with on a model serving ``served`` (GET /sdapi/v1/schedulers)."""
    return [label for label in SCHEDULES if any(label in _schedules(s, served) for s in SAMPLERS)]


def sampler_label(ours: str) -> str:
    """The A1111 sampler name of an API scheduler name ("dpmpp_2m_karras" -> "DPM++ 2M")."""
    for suffix in sorted((s for s, _ in SCHEDULES.values() if s), key=len, reverse=True):
        ours = ours.removesuffix("_" + suffix)
    return next(name for name, (base, _, _) in SAMPLERS.items() if base == ours)


def _sampler(req: Txt2ImgRequest, notes: list[str], served: Collection[str]) -> str | None:
    name = req.sampler_name or req.sampler_index
    if name is None:
        if (req.scheduler or "automatic").lower() != "automatic":
            raise InvalidRequestError("a scheduler other than Automatic needs a sampler_name", param="scheduler")
        return None
    return resolve_sampler(name, req.scheduler, notes, served)


def check_common(req: Txt2ImgRequest, info: ModelInfo, settings: Settings) -> None:
    """What both A1111 routes check before building batches: refused features, the overrides that say something,
    the batch limits, and the size (its refusal names the settings that apply to the A1111 routes)."""
    req.refuse_unsupported(controlnet=bool(settings.runtime.controlnet.dir))
    OptionsStore().check(set_overrides(req.override_settings), info, "override_settings.")
    max_n = settings.limits.max_n
    for name, value in (("batch_size", req.batch_size), ("n_iter", req.n_iter)):
        if value > max_n:
            raise InvalidRequestError(f"{name} must be at most {max_n}, got {value}", param=name)
    if (req.width is None) != (req.height is None):
        raise InvalidRequestError("give both width and height, or neither", param="width")
    if req.width is not None and req.height is not None:
        resolve_size(f"{req.width}x{req.height}", settings, info, route="a1111")


async def with_controlnet(req: Txt2ImgRequest, batches: list[Batch],
                          request: Request) -> tuple[list[Batch], dict[str, str]]:
    """The batches with the request's ControlNet units (``alwayson_scripts.controlnet``, server/controlnet.py)
    and the infotext parameters A1111's extension writes (``ControlNet 0: "Module: ..."``); unchanged without."""
    library = getattr(request.app.state, "controlnets", None)
    script = req.controlnet_script() if library is not None else None
    if script is None:  # without a library check_common refused every enabled unit
        return batches, {}
    first = batches[0]
    units = await run_in_threadpool(parse_units, script, library, first.width, first.height,
                                    request.app.state.settings.limits.max_image_pixels,
                                    served_names(getattr(request.app.state, "engine", None)))
    if not units:
        return batches, {}
    record_control(request, units)  # the control images as C2PA ingredients, with the ControlNets' hashes
    if req.enable_hr and request.url.path.endswith("/txt2img"):
        raise InvalidRequestError("enable_hr with ControlNet units is not served yet", param="enable_hr")
    control = tuple(u.unit for u in units)
    params = dict(u.infotext.split(": ", 1) for u in units)
    return [dataclasses.replace(b, control=control) for b in batches], {k: v.strip('"') for k, v in params.items()}


@router.post("/txt2img", response_model=Txt2ImgResponse,
             responses=error_responses(400, 401, 413, 422, 429, 500, 503, 504, validation=True))
async def txt2img(req: Txt2ImgRequest, request: Request, response: Response) -> Txt2ImgResponse:
    """batch_size images per iteration, n_iter iterations; image i uses seed + i. With enable_hr, Hires fix
    (server/hires.py): the images come back at the target size, ``info`` names the first pass's size."""
    service = request.app.state.service
    service.require_ready()
    info_model = request.app.state.engine.info
    check_common(req, info_model, request.app.state.settings)
    notes: list[str] = []
    scheduler = _sampler(req, notes, info_model.schedulers)
    batches, control = await with_controlnet(req, service.to_batches(from_a1111(req, info_model, scheduler)),
                                             request)
    plan = _hires_plan(req, batches[0], info_model, request.app.state.settings) if req.enable_hr else None
    timeout = request.headers.get(headers.TIMEOUT)
    owner = tenant_label(request.scope)
    if plan is not None:
        outs = await run_hires(service, batches, plan, timeout, request.is_disconnected, owner)
    else:
        outs = await service.run_all(batches, timeout, request.is_disconnected, owner)  # n_iter: in turn
    outs[-1].trace_headers(response)
    ignored = req.ignored(families.facts(info_model.family).distilled_guidance)
    warnings = outs[0].warnings + notes + ignored_headers(response, ignored)
    if notes:
        headers.put(response.headers, headers.WARNINGS, "; ".join(warnings))
    interrupted = any(out.result.interrupted for out in outs)
    steps_done = min(out.result.steps_done or batches[0].steps for out in outs)
    extra = {"warnings": warnings, "interrupted": interrupted, "steps_done": steps_done}
    if plan is not None:  # "hires": sdserve's key, the size the second pass made (absent when it was skipped)
        second = outs[0].result.images[0].image.size == plan.size  # an interrupted first pass skips the second
        extra |= {"denoising_strength": plan.denoising_strength} | ({"hires": plan.size} if second else {})
    params = (plan.infotext if plan else {}) | control  # A1111's extra infotext parameters
    info = generation_info(req.prompt, req.negative_prompt, batches, outs, info_model,
                           sampler_label(batches[0].scheduler), extra, params or None)
    if interrupted:
        response.headers[headers.INTERRUPTED] = f"{steps_done}/{batches[0].steps}"
    pngs = with_infotexts([p for out in outs for p in out.pngs], info["infotexts"], request.app.state.settings)
    pngs = await stamp_a1111(request, response, outs, batches, pngs)  # provenance: last, it signs the final bytes
    return Txt2ImgResponse(images=[b64(p) for p in pngs],
                           parameters=req.model_dump(exclude=set(ignored) - {"styles"}), info=json.dumps(info))


def _hires_plan(req: Txt2ImgRequest, first: Batch, info: ModelInfo, settings: Settings) -> HiresPlan:
    """The Hires fix plan; its target must be a size this server serves (422 naming the field that set it)."""
    _same_second_pass(req, first)
    plan = make_plan(first, info, scale=req.hr_scale, resize=(req.hr_resize_x, req.hr_resize_y),
                     upscaler=req.hr_upscaler, steps=req.hr_second_pass_steps,
                     denoising_strength=req.denoising_strength)
    if plan.steps > settings.limits.max_steps:
        raise InvalidRequestError(f"hr_second_pass_steps must be at most {settings.limits.max_steps} (this server's "
                                  f"limits.max_steps), got {plan.steps}", param="hr_second_pass_steps")
    try:
        resolve_size("{}x{}".format(*plan.size), settings, info, route="hires")
    except InvalidRequestError as exc:
        field = "hr_resize_x" if req.hr_resize_x or req.hr_resize_y else "hr_scale"
        how = f"hr_resize_x/y {req.hr_resize_x}x{req.hr_resize_y}" if field == "hr_resize_x" else \
            f"hr_scale {req.hr_scale:g} x {first.width}x{first.height}"
        raise InvalidRequestError(f"Hires fix target ({how}): {exc.message}; ask a smaller {field}",
                                  param=field) from None
    return plan


def _same_second_pass(req: Txt2ImgRequest, first: Batch) -> None:
    """A1111's hr_prompt, hr_negative_prompt, hr_sampler_name and hr_checkpoint_name change the second pass; sdserve
    runs it with the first pass's, so they are accepted (and named as ignored) only when they say the same."""
    extra = req.model_extra or {}
    same: dict[str, tuple[object, ...]] = {
        "hr_prompt": ("", req.prompt), "hr_negative_prompt": ("", req.negative_prompt),
        "hr_sampler_name": ("", "Use same sampler", sampler_label(first.scheduler)),
        "hr_scheduler": ("", "Use same scheduler"), "hr_checkpoint_name": ("", "Use same checkpoint")}
    for name, allowed in same.items():
        value = extra.get(name)
        if value is not None and value not in allowed:
            raise InvalidRequestError(f"{name} {str(value)[:64]!r} is not supported by sdserve: its Hires fix second "
                                      f"pass uses the first pass's settings (send {allowed[0]!r} or leave it out)",
                                      param=name)


def with_infotexts(images: list[bytes], texts: list[str], settings: Settings) -> list[bytes]:
    """Each image with its infotext embedded (server/images.py), unless the profile's ``[api] infotext`` is off."""
    if not settings.api.infotext:
        return images
    return [embed_infotext(data, text) for data, text in zip(images, texts, strict=True)]


@router.get("/samplers")
async def samplers(request: Request) -> list[dict[str, Any]]:
    """The samplers that run on the served model (its family's: flow-matching models run Euler, Euler a, DPM++ 2M
    and UniPC on their flow schedule); ``options`` names the schedule Automatic means where the model serves it."""
    schedulers = request.app.state.engine.info.schedulers
    served = served_samplers(schedulers)
    return [{"name": name, "aliases": list(aliases),
             "options": {"scheduler": automatic} if f"{ours}_{automatic}" in schedulers else {}}
            for name, (ours, aliases, automatic) in SAMPLERS.items() if name in served]


@router.get("/scripts")
async def scripts(request: Request) -> dict[str, list[str]]:
    """A1111's scripts: ``controlnet`` (an always-on script, as sd-webui-controlnet registers it) when a ControlNet
    folder is served (server/controlnet.py), else none (clients probe this)."""
    served = ["controlnet"] if getattr(request.app.state, "controlnets", None) is not None else []
    return {"txt2img": list(served), "img2img": list(served)}


@router.get("/sd-models")
async def sd_models(request: Request) -> list[dict[str, Any]]:
    """The served model. ``config`` names the family the way A1111 does, by the model config it would load
    (repositories' v1-inference.yaml, v2-inference-v.yaml, sd_xl_base.yaml, ...); GET /v1/models has the details."""
    info = request.app.state.engine.info
    short = info.digest[:10] if info.digest else ""
    return [{"title": f"{info.name} [{short}]" if short else info.name, "model_name": info.name, "hash": short,
             "sha256": info.digest, "filename": info.name, "config": _a1111_config(info)}]


def _a1111_config(info: ModelInfo) -> str | None:
    """A1111's config label for the served family (engines/families.py); None where A1111 has none."""
    return families.facts(info.family).a1111_config(info.text_encoders, info.prediction_type) or None


def sampler_name(name: str) -> str | None:
    """The API scheduler name for an A1111 sampler name or alias ("DPM++ 2M", "k_euler_a", "DPM++ 2M Karras"), its
    schedule Automatic unless the name carries one; None when sdserve does not serve it."""
    try:
        return resolve_sampler(name)
    except InvalidRequestError:
        return None

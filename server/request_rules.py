"""Request -> engine batch: the served model and sizes, quality, and the rule for the fields clients always send.

The rule (docs/api.md "Fields clients always send"), on both APIs:

1. A field that changes the image and that sdserve can honour is honoured (``size``, ``quality`` through
   ``[api] quality_steps``, ``output_format`` with ``output_compression``, ``background: opaque``).
2. A field sdserve cannot honour that a popular client sends by default, and whose ignoring still returns what the
   client asked for, is accepted and named: in the ``x-sdserve-ignored-fields`` header and the response's warnings
   (``style``, ``moderation``, ``output_compression`` with PNG; A1111's hires/save fields when off).
3. A field whose ignoring would return something the client did not ask for is a 400 (422 on A1111 routes) naming
   it: ``background: transparent`` (the model has no alpha), a size the model does not serve (never resized).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import engines.families as families
from engines.config import parse_size
from engines.errors import InvalidRequestError
from engines.types.model import LoraInfo, ModelInfo
from engines.types.request import Batch, ImageSpec, LoraUse
from server import headers, lora_prompt
from server.a1111_options import checkpoint_names
from server.generation import OPENAI_NAMES, SEED_SPAN, GenerationRequest, LoraAsk, draw_seed
from server.schemas import ImageGenerationRequest
from server.settings import Settings

OPENAI_SIZES = ("1024x1024", "1536x1024", "1024x1536", "1792x1024", "1024x1792")
"""The sizes OpenAI's image models take, which OpenAI clients send by default ([serving] openai_sizes)."""
DALL_E = ("dall-e-2", "dall-e-3")
"""Models whose OpenAI default response_format is url (gpt-image models answer b64_json)."""


@dataclass
class FieldNotes:
    """What a request asked for that sdserve accepted without honouring: field names and one warning each."""

    ignored: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def ignore(self, name: str, why: str) -> None:
        self.ignored.append(name)
        self.warnings.append(f"{name} ignored: {why}")

    def headers(self) -> dict[str, str]:
        """``x-sdserve-ignored-fields`` (names percent-encoded: headers.token; the warnings have them as sent)."""
        if not self.ignored:
            return {}
        return {headers.IGNORED_FIELDS: headers.value(headers.tokens(sorted(self.ignored)))}


def served_model(requested: str | None, settings: Settings, info: ModelInfo) -> str:
    """The served model id for an OpenAI ``model``: absent, the served id (the model's folder name) or another of
    its A1111 names (title, hash), or a profile alias (``[api] model_aliases``). Anything else is a 400 naming the
    served id and the aliases: a request for another model is never silently answered by this one."""
    if requested is None or requested in checkpoint_names(info) or requested in settings.api.model_aliases:
        return info.name
    aliases = list(settings.api.model_aliases)
    raise InvalidRequestError(f"model {requested[:64]!r} is not served here; served: {[info.name]}"
                              + (f", aliases: {aliases}" if aliases else "") + " (GET /v1/models)", param="model")


def alias_models(settings: Settings, info: ModelInfo) -> list[dict[str, Any]]:
    """GET /v1/models entries for the profile's ``[api] model_aliases``: each runs the served model (``parent``)."""
    return [{"id": alias, "object": "model", "created": 0, "owned_by": "sdserve", "parent": info.name}
            for alias in settings.api.model_aliases]


def response_format(req: ImageGenerationRequest) -> str:
    """The asked response_format, else OpenAI's default for the model: url for DALL·E, b64_json otherwise."""
    if req.response_format is not None:
        return req.response_format
    return "url" if req.model in DALL_E else "b64_json"


def openai_notes(req: ImageGenerationRequest) -> FieldNotes:
    """Rule 1 for the OpenAI fields sdserve accepts without honouring; 400 where ignoring would mislead."""
    notes = FieldNotes()
    if req.background == "transparent":
        raise InvalidRequestError("background 'transparent' is not supported: the model's images are opaque (no "
                                  "alpha channel); use auto or opaque", param="background")
    if req.style is not None:
        notes.ignore("style", f"{req.style!r}: sdserve has no styles (steer the image with prompt and "
                              "negative_prompt)")
    if req.moderation is not None:
        notes.ignore("moderation", f"{req.moderation!r}: sdserve runs no content moderation")
    if req.output_compression is not None and (req.output_format or "png") == "png":
        notes.ignore("output_compression", "applies to jpeg and webp only; PNG is lossless")
    return notes


def quality_steps(req: ImageGenerationRequest, settings: Settings) -> int | None:
    """The steps OpenAI's ``quality`` asks for (``[api] quality_steps``: DALL·E's standard/hd and gpt-image's
    low/medium/high; "auto" or absent: None, the default). Anything not mapped is a 400 naming the field."""
    if req.quality is None or req.quality == "auto":
        return None
    mapped = settings.api.quality_steps
    if req.quality not in mapped:
        raise InvalidRequestError(f"quality {req.quality[:32]!r} is not supported here; supported: "
                                  f"{['auto', *mapped]}", param="quality")
    if req.steps is not None:
        raise InvalidRequestError("quality and steps both set: give one of them", param="quality")
    steps = mapped[req.quality]
    if steps > settings.limits.max_steps:  # a profile that lowered max_steps below its quality table
        raise InvalidRequestError(f"quality {req.quality!r} means {steps} steps, over this server's limit of "
                                  f"{settings.limits.max_steps}", param="quality")
    return steps


def openai_sizes(settings: Settings, info: ModelInfo) -> tuple[str, ...]:
    """The OpenAI sizes served beyond the profile's sizes and limits: [serving] openai_sizes on a model of a family
    trained at 1024x1024 (engines/families.py ``trained_size``: SDXL, Flux.1, SD 3.x), each a multiple of the
    model's factor."""
    if not settings.serving.openai_sizes or not families.facts(info.family).openai_sizes:
        return ()
    return tuple(s for s in OPENAI_SIZES if all(v % info.size_multiple == 0 for v in parse_size(s)))


def served_sizes_text(settings: Settings, info: ModelInfo) -> str:
    """What this server serves, for an error message: the sizes, and the model's native size."""
    native = f"{info.default_size}x{info.default_size}"
    limits, extra = settings.limits, openai_sizes(settings, info)
    if settings.serving.sizes:
        served = ", ".join((*settings.serving.sizes, *extra))
    else:
        served = (f"WIDTHxHEIGHT with each side a multiple of {info.size_multiple} up to "
                  f"{limits.max_width}x{limits.max_height}" + (f", and {', '.join(extra)}" if extra else ""))
    return f"served sizes: {served}; the model's native size is {native} (size auto)"


Route = Literal["openai", "a1111", "hires"]
"""Who asks a size, for the hint of a refusal: the OpenAI routes (where [serving] openai_sizes_hires applies), the
A1111 routes (where it does not), or a Hires fix target (whose size the A1111 hr_* fields chose)."""


def resolve_size(size: str | None, settings: Settings, info: ModelInfo, route: Route = "openai") -> tuple[int, int]:
    """(width, height) for a requested size (None or "auto": the first served size, else the native size); a size
    the model does not serve is a 400 naming the served sizes, the native size and, for a size over the limits, the
    setting that refused it (``[limits] max_width/max_height``), with a hint for an OpenAI size that names only
    settings that apply on ``route``. Never resized."""
    served = settings.serving.sizes
    if size is None or size == "auto":
        return parse_size(served[0]) if served else (info.default_size, info.default_size)
    width, height = parse_size(size)
    if f"{width}x{height}" in openai_sizes(settings, info):
        return width, height
    hint = "" if route == "hires" else _openai_hint(size, settings, info, route)
    if served:
        if f"{width}x{height}" not in served:
            raise InvalidRequestError(f"size {width}x{height} is not served; "
                                      f"{served_sizes_text(settings, info)}" + hint, param="size")
        return width, height
    for name, value, cap in (("width", width, settings.limits.max_width),
                             ("height", height, settings.limits.max_height)):
        if value % info.size_multiple:
            raise InvalidRequestError(f"size {size}: {name} {value} is not a multiple of {info.size_multiple}; "
                                      f"{served_sizes_text(settings, info)}", param="size")
        if value > cap:
            raise InvalidRequestError(f"size {size}: {name} {value} is over this server's largest {cap} ([limits] "
                                      f"max_{name}); {served_sizes_text(settings, info)}" + hint, param="size")
    return width, height


def hires_base(size: str | None, settings: Settings, info: ModelInfo) -> tuple[int, int] | None:
    """The first-pass size for an OpenAI size served through Hires fix ([serving] openai_sizes_hires, on a model
    of a family not trained at 1024x1024; generations, edits and variations alike): the requested aspect at the
    model's native pixel count, each side a multiple of the model's factor. None when the request is not served
    that way."""
    if size not in OPENAI_SIZES or families.facts(info.family).openai_sizes or not settings.serving.openai_sizes_hires:
        return None
    width, height = parse_size(size)
    scale, m = math.sqrt(info.default_size**2 / (width * height)), info.size_multiple
    return max(m, round(width * scale / m) * m), max(m, round(height * scale / m) * m)


def trained_at_1024() -> str:
    """The registered families trained at 1024x1024, by description (for messages)."""
    return ", ".join(f.description.split(" (")[0] for f in families.REGISTRY.values() if f.openai_sizes)


def _openai_hint(size: str, settings: Settings, info: ModelInfo, route: Route) -> str:
    if size not in OPENAI_SIZES:
        return ""
    trained = families.facts(info.family).trained_size
    if trained < 1024:
        where = (f"enable [serving] openai_sizes_hires to serve it on the OpenAI routes through Hires fix, a "
                 f"native-size first pass then a second pass at {size}") if route == "openai" else \
            "[serving] openai_sizes_hires serves it on the OpenAI routes only (/v1/images/*)"
        return (f" ({size} is an OpenAI size: served directly only by models of a family trained at 1024x1024 "
                f"({trained_at_1024()}) with [serving] openai_sizes; this model is {info.family}, trained at "
                f"{trained}x{trained}: {where})")
    return "" if settings.serving.openai_sizes else " (enable [serving] openai_sizes to serve OpenAI's sizes)"


def from_openai(req: ImageGenerationRequest, settings: Settings, info: ModelInfo) -> GenerationRequest:
    """The OpenAI request as the core's request: the served model checked (``model``), ``quality`` mapped to steps
    (``[api] quality_steps``), the rest carried over as validated."""
    served_model(req.model, settings, info)
    mapped = quality_steps(req, settings)
    loras = tuple(LoraAsk(item.name, item.weight, item.unet_weight) for item in req.loras or [])
    crops = req.crops_coords_top_left
    return GenerationRequest(prompt=req.prompt, negative_prompt=req.negative_prompt, images=req.n, size=req.size,
                             seed=req.seed, steps=req.steps if req.steps is not None else mapped,
                             guidance=req.guidance_scale, scheduler=req.scheduler, loras=loras,
                             original_size=req.original_size, crops=(crops[0], crops[1]) if crops else None,
                             step_cache=req.step_cache, names=OPENAI_NAMES)


def build_batch(req: ImageGenerationRequest, settings: Settings, info: ModelInfo,
                library: Mapping[str, LoraInfo] | None = None) -> Batch:
    """An OpenAI request's one batch (``from_openai`` then ``generation_batches``)."""
    return generation_batches(from_openai(req, settings, info), settings, info, library)[0]


def generation_batches(req: GenerationRequest, settings: Settings, info: ModelInfo,
                       library: Mapping[str, LoraInfo] | None = None) -> list[Batch]:
    """Validate a request against the profile's limits and the model; fill defaults; draw the seed when none was
    sent (once for all its batches) and expand per-image seeds; resolve its LoRAs (prompt tags and the ``loras``
    field) against ``library`` (server/lora_prompt.py). Refusals name the wire field (``req.names``)."""
    limits, defaults, names = settings.limits, settings.defaults_for(info.family), req.names
    if not 1 <= req.images <= limits.max_n:
        raise InvalidRequestError(f"{names.images} must be between 1 and {limits.max_n}, got {req.images}",
                                  param=names.images)
    width, height = resolve_size(req.size, settings, info, route=names.api)
    steps = req.steps if req.steps is not None else defaults.steps
    if steps > limits.max_steps:
        raise InvalidRequestError(f"{names.steps} must be at most {limits.max_steps} (this server's "
                                  f"limits.max_steps), got {steps}", param=names.steps)
    scheduler = req.scheduler or defaults.scheduler
    if scheduler not in info.schedulers:
        raise InvalidRequestError(f"unknown scheduler {scheduler!r}; expected one of {list(info.schedulers)}",
                                  param=names.scheduler)
    for name, text in (("prompt", req.prompt), ("negative_prompt", req.negative_prompt)):
        if len(text) > limits.max_prompt_chars:
            raise InvalidRequestError(f"{name} is longer than {limits.max_prompt_chars} characters",
                                      param=name)
    seed = req.seed if req.seed is not None else draw_seed()
    guidance = req.guidance if req.guidance is not None else defaults.guidance_scale
    prompt, loras = _loras(req, settings, library or {})
    original, crops = _micro_conditioning(req, info)
    truncate = limits.prompt_overflow == "truncate"
    return [Batch(tuple(ImageSpec(prompt, req.negative_prompt, (seed + k * req.images + i) % SEED_SPAN, guidance)
                        for i in range(req.images)), width, height, steps, scheduler, truncate, original, crops,
                  loras=loras)
            for k in range(req.batches)]


def _loras(req: GenerationRequest, settings: Settings,
           library: Mapping[str, LoraInfo]) -> tuple[str, tuple[LoraUse, ...]]:
    """The prompt the encoder sees (LoRA tags removed) and the request's adapter set."""
    prompt, wanted = lora_prompt.parse_prompt(req.prompt)  # tags only: an empty text, as A1111 encodes it
    for i, item in enumerate(req.loras):
        unet = item.unet_weight if item.unet_weight is not None else item.weight
        wanted.append(lora_prompt.Wanted(item.name, item.weight, unet, f"{req.names.loras}.{i}.name"))
    limits = settings.runtime.lora
    return prompt, lora_prompt.resolve(wanted, library, limits.max_per_request, limits.max_multiplier)


def _micro_conditioning(req: GenerationRequest, info: ModelInfo) -> tuple[tuple[int, int] | None,
                                                                         tuple[int, int]]:
    """SDXL's original_size (as the (height, width) diffusers takes) and crop; refused for other families."""
    for name, value in (("original_size", req.original_size), ("crops_coords_top_left", req.crops)):
        if value is not None and not families.facts(info.family).micro_conditioning:
            raise InvalidRequestError(f"{name} applies to SDXL models only; this model is {info.family}", param=name)
    original = None
    if req.original_size is not None:
        width, height = parse_size(req.original_size)
        original = (height, width)
    return original, req.crops or (0, 0)

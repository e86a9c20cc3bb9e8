"""The A1111 generation request (POST /sdapi/v1/txt2img's body; img2img's extends it) and its one mapping into the
serving core's request (server/generation.py): ``from_a1111``. Validation errors are 422 with FastAPI's ``detail``
list (what A1111 clients expect); a refusal names the A1111 field the client sent."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

import engines.families as families
from engines.errors import InvalidRequestError
from engines.types.model import ModelInfo
from server.a1111_lax import lax_extra, lax_number, number_type
from server.a1111_options import empty_overrides
from server.generation import A1111_NAMES, SEED_SPAN, GenerationRequest
from server.schemas import Prompt, Text


class Txt2ImgRequest(BaseModel):
    """The A1111 txt2img fields sdserve honours. Other fields A1111 clients send (save_images, hr fields with
    enable_hr off, ...) are accepted so those clients work, and named in the response (``info.warnings`` and the
    ``x-sdserve-ignored-fields`` header), never silently ignored; features that would change the image are refused.
    Numbers sent as strings are read as A1111's lax pydantic models read them (server/a1111_lax.py)."""

    model_config = ConfigDict(extra="allow", strict=True)

    prompt: Prompt = Field(..., description="What to draw.")
    negative_prompt: Text = ""
    seed: int = Field(-1, ge=-1, le=2**32 - 1, description="-1 = random")
    steps: int | None = Field(None, ge=1, le=200)
    cfg_scale: float | None = Field(None, ge=0, le=30, description="the guidance scale; on a guidance-distilled "
                                    "model (FLUX.1 dev) with distilled_cfg_scale, Forge's true CFG: 1 only")
    distilled_cfg_scale: float | None = Field(None, ge=0, le=30, description="Forge's Flux guidance: the embedded "
                                              "guidance of a guidance-distilled model (FLUX.1 dev); named as ignored "
                                              "on other models, as Forge ignores it there")
    width: int | None = Field(None, ge=1, le=4096)
    height: int | None = Field(None, ge=1, le=4096)
    batch_size: int = Field(1, ge=1, le=16)
    n_iter: int = Field(1, ge=1, le=16)
    sampler_name: str | None = Field(None, description="GET /sdapi/v1/samplers lists them; a legacy name with a "
                                     "schedule (\"DPM++ 2M Karras\") works too")
    sampler_index: str | None = Field(None, description="legacy alias of sampler_name")
    scheduler: str | None = Field(None, description="A1111 schedule type: Automatic (the sampler's A1111 default), "
                                  "Uniform, Karras, Exponential or SGM Uniform; DDIM and PLMS take Automatic only")
    # Hires fix (A1111's StableDiffusionProcessingTxt2Img fields and defaults; server/hires.py runs it).
    enable_hr: bool = False
    denoising_strength: float | None = Field(None, ge=0, le=1, description="Hires fix's second pass (A1111's "
                                             "default 0.75); without enable_hr it is named as ignored")
    hr_scale: float = Field(2.0, gt=0, le=8)
    hr_upscaler: str | None = Field(None, description="GET /sdapi/v1/upscalers; A1111's default is Latent")
    hr_second_pass_steps: int = Field(0, ge=0, le=200, description="0: the first pass's steps")
    hr_resize_x: int = Field(0, ge=0, le=4096)
    hr_resize_y: int = Field(0, ge=0, le=4096)
    # Features sdserve does not implement: accepted only when off, refused (422) rather than silently ignored.
    restore_faces: bool = False
    tiling: bool = False
    script_name: str | None = None
    alwayson_scripts: dict[str, Any] = Field(default_factory=dict)
    styles: list[str] = Field(default_factory=list, description="sdserve has no styles: a style is a 422; "
                              "\"None\" and \"\" (a UI's no-style choice) are named as ignored")
    override_settings: dict[str, Any] = Field(default_factory=dict, description="only what sdserve already does "
                                              "(e.g. sd_model_checkpoint naming the served model); else 422")
    override_settings_restore_afterwards: bool = True
    step_cache: bool | None = Field(None, description="sdserve extension: true runs the step cache (the image is "
                                    "no longer the seed-reproducible uncached one), false never; absent: [cache] "
                                    "policy; the infotext's Step cache names what ran")

    @field_validator("*", mode="before")
    @classmethod
    def _lax_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields.get(info.field_name or "")
        return lax_number(number_type(field.annotation) if field else None, value)

    def controlnet_script(self) -> object:
        """The ``controlnet`` entry of ``alwayson_scripts`` (any case), None without one."""
        return next((v for k, v in self.alwayson_scripts.items() if str(k).lower() == "controlnet"), None)

    def refuse_unsupported(self, controlnet: bool = False) -> None:
        """Rule 1 (server/request_rules.py): a feature whose ignoring would return an image the client did not ask
        for is a 422 naming it; the same fields when off, and the others A1111 clients send, are accepted.
        ``controlnet``: a ControlNet folder is configured, so the ``controlnet`` script (any case) is served."""
        for script in self.alwayson_scripts:  # A1111's modules/api/api.py init_script_args: 422 naming the script
            if str(script).lower() == "controlnet":
                args = self.alwayson_scripts[script].get("args") if isinstance(self.alwayson_scripts[script],
                                                                                dict) else None
                # no enabled unit (webuiapi sends {"args": []} to a server listing the extension): nothing to ignore
                idle = isinstance(args, list) and not any(not isinstance(u, dict) or u.get("enabled", True)
                                                          for u in args)
                if controlnet or idle:
                    continue
                raise InvalidRequestError(f"always on script {str(script)[:64]} not found: this server has no "
                                          "ControlNet folder (no --controlnet-dir is set)",
                                          param=f"alwayson_scripts.{str(script)[:64]}")
            raise InvalidRequestError(f"always on script {str(script)[:64]} not found: {str(script)[:64]} is not "
                                      "installed on this server (sdserve runs no A1111 extensions)",
                                      param=f"alwayson_scripts.{str(script)[:64]}")
        for name, why in REFUSED.items():
            if getattr(self, name):
                raise InvalidRequestError(f"{name} is not supported by sdserve: {why}", param=name)
        real = [s for s in self.styles if s not in NO_STYLE]
        if real:
            raise InvalidRequestError(f"unknown style {real[0][:64]!r}: sdserve has no styles "
                                      "(GET /sdapi/v1/prompt-styles lists none)", param="styles")
        if (self.model_extra or {}).get("loras"):  # sdserve's OpenAI extension: on A1111 routes the prompt says it
            raise InvalidRequestError("loras is an extension of the OpenAI routes; on A1111's routes name LoRAs in "
                                      "the prompt as A1111 does: <lora:name:multiplier>", param="loras")
        for name, neutral in NEUTRAL.items():
            value = lax_extra((self.model_extra or {}).get(name))
            if value is not None and (type(value) is bool or value not in neutral):
                raise InvalidRequestError(f"{name} {value!r} is not supported by sdserve (only {neutral[0]!r}): "
                                          "ignoring it would change the image", param=name)

    def ignored(self, distilled: bool = False) -> dict[str, str]:
        """The fields accepted without being honoured, each with why (rule 2); ``distilled``: the served model takes
        distilled_cfg_scale (guidance-distilled)."""
        found = dict.fromkeys(self.model_extra or {}, "not used by sdserve")
        if self.styles:
            found["styles"] = f"{self.styles[:4]!r} is the no-style choice"
        if not self.enable_hr:
            found |= dict.fromkeys(sorted(HIRES_FIELDS & self.model_fields_set), "enable_hr is off")
        return found | self.common_ignored(distilled)

    def common_ignored(self, distilled: bool) -> dict[str, str]:
        """What both A1111 routes accept without honouring: empty per-request overrides (A1111 drops them too)
        and Forge's distilled_cfg_scale on a model that is not guidance-distilled (Forge ignores it there)."""
        found = {f"override_settings.{key}": "empty: A1111 ignores an empty override"
                 for key in empty_overrides(self.override_settings)}
        if self.distilled_cfg_scale is not None and not distilled:
            found["distilled_cfg_scale"] = "applies to guidance-distilled models (FLUX.1 dev) only; cfg_scale is " \
                "this model's guidance"
        return found


REFUSED = {"restore_faces": "no face restoration model", "tiling": "no seamless tiling (the image would not tile)",
           "script_name": "no scripts"}
"""Features sdserve does not implement, refused when on, and why (an ``alwayson_scripts`` entry is refused naming its
script, as A1111 refuses a script it does not have)."""
NO_STYLE = ("None", "")
"""Style entries that mean no style: a UI's "None" choice, an empty entry."""
HIRES_FIELDS = frozenset({"denoising_strength", "hr_scale", "hr_upscaler", "hr_second_pass_steps", "hr_resize_x",
                          "hr_resize_y"})
"""The Hires fix settings, named as ignored when enable_hr is off (A1111 ignores them then)."""
NEUTRAL: dict[str, tuple[object, ...]] = {"subseed_strength": (0, 0.0), "clip_skip": (1, 0),
                                          "seed_resize_from_w": (-1, 0), "seed_resize_from_h": (-1, 0)}
"""Undeclared A1111 fields accepted (and named as ignored) only at values that leave the image as sdserve makes
it: webuiapi's and SillyTavern's defaults."""


def guidance(req: Txt2ImgRequest, info: ModelInfo) -> float | None:
    """The guidance scale the engine gets (docs/api.md "Guidance on the A1111 routes"). On a guidance-distilled
    model (FLUX.1 dev): Forge's ``distilled_cfg_scale`` when sent, and ``cfg_scale`` is then Forge's true CFG,
    which sdserve does not run on such a model: at most 1 (none) is accepted, more is a 422 naming it; without
    ``distilled_cfg_scale``, ``cfg_scale`` sets the embedded guidance (as diffusers' guidance_scale). On any other
    model: ``cfg_scale`` (``distilled_cfg_scale`` is named as ignored). None: the family's default."""
    if req.distilled_cfg_scale is None or not families.facts(info.family).distilled_guidance:
        return req.cfg_scale
    if req.cfg_scale is not None and req.cfg_scale > 1:
        raise InvalidRequestError(f"cfg_scale {req.cfg_scale:g} with distilled_cfg_scale is Forge's true CFG, which "
                                  f"sdserve does not run on this guidance-distilled model ({info.family}): send "
                                  "cfg_scale 1 (or leave it out) and the guidance as distilled_cfg_scale",
                                  param="cfg_scale")
    return req.distilled_cfg_scale


def from_a1111(req: Txt2ImgRequest, info: ModelInfo, scheduler: str | None) -> GenerationRequest:
    """The A1111 request as the core's request: batch_size images per batch, n_iter batches, seed -1 drawn by the
    core (once), the guidance as ``guidance`` decides it; ``scheduler``: the sampler the route resolved (engine
    name; None: the model's default)."""
    size = f"{req.width}x{req.height}" if req.width is not None and req.height is not None else None
    return GenerationRequest(prompt=req.prompt, negative_prompt=req.negative_prompt, images=req.batch_size,
                             batches=req.n_iter, size=size, seed=req.seed % SEED_SPAN if req.seed >= 0 else None,
                             steps=req.steps, guidance=guidance(req, info), scheduler=scheduler,
                             step_cache=req.step_cache, names=A1111_NAMES)

"""Request and response models of the HTTP API (validated at the edge; the pipeline validates again)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from engines.config import parse_size
from server.settings import AuthSettings


def _unicode(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("contains an unpaired UTF-16 surrogate") from None
    return value


def _not_blank(value: str) -> str:
    if not value.strip():
        raise ValueError("must not be empty")
    return _unicode(value)


MAX_TEXT = 100_000
"""The largest limits.max_prompt_chars a profile may set; the profile's own limit applies on top (400)."""
Prompt = Annotated[str, Field(max_length=MAX_TEXT), AfterValidator(_not_blank)]
"""A prompt: Unicode text that is not empty or only whitespace."""
Text = Annotated[str, Field(max_length=MAX_TEXT), AfterValidator(_unicode)]
"""Unicode text (no lone surrogates), possibly empty."""
STRICT = ConfigDict(extra="forbid", strict=True)
"""Public request models: booleans are not numbers, numbers are not strings, unknown fields are refused."""


class LoraRequest(BaseModel):
    """Extension: one LoRA of the request's adapter set (the same as ``<lora:name:weight>`` in the prompt)."""

    model_config = STRICT

    name: str = Field(..., min_length=1, max_length=256, description="A LoRA of GET /sdapi/v1/loras, by name.")
    weight: float = Field(1.0, description="Multiplier on the text encoders and the denoiser (A1111's "
                          "<lora:name:weight>); bounded by [runtime.lora] max_multiplier.")
    unet_weight: float | None = Field(None, description="Multiplier on the denoiser (UNet or DiT transformer) "
                                      "instead of weight (A1111's <lora:name:te:unet>).")


class ImageGenerationRequest(BaseModel):
    """OpenAI Images API ``POST /v1/images/generations``, with sdserve extensions."""

    model_config = STRICT

    prompt: Prompt = Field(..., description="What to draw. Longer than 77 CLIP tokens is truncated (reported).")
    n: int = Field(1, json_schema_extra={"minimum": 1, "maximum": 16},  # enforced against limits.max_n (one message)
                   description="Number of images (1..limits.max_n).")
    size: str | None = Field(None, max_length=11, description="WIDTHxHEIGHT, multiples of the model's size factor, "
                             "or auto. Default (and auto): the model's native size, or the profile's first served "
                             "size.")
    response_format: Literal["b64_json", "url"] | None = Field(
        None, description="b64_json, or url: an absolute link to a short-lived copy (GET /v1/images/files/{id}"
        ".{ext}; [server] public_base_url, else the request's Host when allowed). Default: url for dall-e-2 and "
        "dall-e-3, b64_json otherwise (OpenAI's defaults).")
    model: str | None = Field(None, max_length=256, description="The served model id (GET /v1/models) or one of "
                              "the profile's aliases ([api] model_aliases); any other is a 400. The response's "
                              "x-sdserve-model header names the model that ran.")
    user: str | None = Field(None, max_length=256, description="End-user id (logged, never a metric label).")
    quality: str | None = Field(None, max_length=32, description="auto, or a value the profile maps to steps "
                                "([api] quality_steps: standard/hd, low/medium/high); any other is a 400. Not "
                                "together with steps.")
    style: Literal["vivid", "natural"] | None = Field(None, description="DALL·E 3's style: accepted and named in "
                                                       "x-sdserve-ignored-fields (sdserve has no styles).")
    output_format: Literal["png", "jpeg", "webp"] | None = Field(None, description="Encoding of the images; "
                                                                  "default png.")
    output_compression: int | None = Field(None, ge=0, le=100, description="JPEG/WebP quality 0-100 (default "
                                           "100); with png it is accepted and named as ignored (PNG is lossless).")
    background: Literal["auto", "opaque", "transparent"] | None = Field(
        None, description="auto and opaque are honoured (the images are opaque); transparent is a 400.")
    moderation: Literal["auto", "low"] | None = Field(None, description="Accepted and named as ignored: sdserve "
                                                      "runs no content moderation.")
    negative_prompt: Text = Field("", description="Extension: what to steer away from.")
    seed: int | None = Field(None, ge=0, le=2**32 - 1, description="Extension: seed of the first image; "
                                                                    "image i uses seed+i. Random when absent.")
    steps: int | None = Field(None, ge=1, le=200, description="Extension: denoising steps (1..limits.max_steps).")
    guidance_scale: float | None = Field(None, ge=0.0, le=30.0, description="Extension: CFG scale.")
    scheduler: str | None = Field(None, description="Extension: a sampler (euler, euler_a, ddim, dpmpp_2m, "
                                  "dpmpp_2m_sde, dpmpp_2m_sde_heun), optionally with a sigma schedule suffix except "
                                  "for ddim (_karras, _exponential, _uniform, _sgm_uniform), e.g. dpmpp_2m_karras.")
    original_size: str | None = Field(None, description="Extension, SDXL only: the WIDTHxHEIGHT the image claims to "
                                        "come from (micro-conditioning); default: the requested size.")
    crops_coords_top_left: list[Annotated[int, Field(ge=0, le=16384)]] | None = Field(
        None, min_length=2, max_length=2, description="Extension, SDXL only: [top, left] of the claimed crop "
                                                      "(micro-conditioning); default [0, 0].")
    loras: list[LoraRequest] | None = Field(None, max_length=64, description="Extension: LoRAs applied to every "
                                            "image of the request (with any <lora:name:weight> tags of the prompt; "
                                            "the response's x-sdserve-loras names the set that ran).")
    controlnet: list[dict[str, Any]] | None = Field(
        None, max_length=16, description="Extension: ControlNet units (server/controlnet.py; a ControlNet folder "
        "must be served), each as one unit of A1111's alwayson_scripts.controlnet.args: image (base64 or a data "
        "URL), model (GET /controlnet/model_list), module (GET /controlnet/module_list), weight, guidance_start, "
        "guidance_end, processor_res, threshold_a, threshold_b, resize_mode, pixel_perfect. On /v1/images/edits "
        "the same list as JSON text.")
    step_cache: bool | None = Field(None, description="Extension: true runs the server's step cache (skips "
                                    "denoiser evaluations whose output barely changes; the image is then not the "
                                    "seed-reproducible uncached one), false never; absent: [cache] policy. "
                                    "x-sdserve-cache names what ran.")

    @field_validator("original_size")
    @classmethod
    def _original_size_format(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                parse_size(value)
            except ValueError:
                raise ValueError(f"must look like 1024x1024, got {value[:32]!r}") from None
        return value

    @field_validator("size")
    @classmethod
    def _size_format(cls, value: str | None) -> str | None:
        if value is None or value == "auto":
            return value
        try:
            parse_size(value)
        except ValueError:
            raise ValueError(f"must look like 512x512, got {value[:32]!r}") from None
        return value


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error of the OpenAI routes, probes and files (a 500 names only the request id)."""

    error: ErrorDetail


class ValidationItem(BaseModel):
    loc: list[str | int]
    msg: str
    type: str


class ValidationResponse(BaseModel):
    """A1111 routes' 422: FastAPI's ``detail`` list, which A1111 clients parse."""

    detail: list[ValidationItem]


MEANING = {400: "invalid request", 401: "missing or invalid credentials (Bearer key or Basic user:pass)",
           404: "not found", 413: "body too large", 422: "invalid request (A1111 shape)",
           429: "queue full or too many requests for this key; see Retry-After", 499: "client went away",
           500: "internal error (request id only; connection closed)",
           503: "not ready, draining or stopping; Retry-After, or x-should-retry: false when the boot failed",
           504: "deadline passed before the request started (x-should-retry: false)"}


def error_responses(*statuses: int, validation: bool = False) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for the error statuses a route really answers (schemathesis checks them)."""
    return {status: {"model": ValidationResponse if status == 422 and validation else ErrorResponse,
                     "description": MEANING[status]} for status in statuses}


SECURITY_SCHEMES = {
    "bearerAuth": {"type": "http", "scheme": "bearer", "description": "an API key; its sha256 is in "
                   "[auth] api_key_sha256, SDSERVE_API_KEYS_SHA256 or a tenant's digests"},
    "basicAuth": {"type": "http", "scheme": "basic", "description": "user:pass (A1111's --api-auth); the sha256 "
                  "of the text user:pass is in the same digest list"}}


def _ref(name: str) -> dict[str, Any]:
    return {"content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}}


def _statuses(path: str, method: str, guarded: bool) -> dict[int, str]:
    """What the middleware can answer on any operation, besides what the route documents itself."""
    found = {500: "ErrorResponse"}
    if method in ("post", "put"):
        found |= {413: "ErrorResponse"}
        found |= {422: "ValidationResponse"} if path.startswith("/sdapi/") else {400: "ErrorResponse"}
    if guarded:
        found[401] = "ErrorResponse"
    return found


def document_openapi(app: FastAPI, auth: AuthSettings) -> dict[str, Any]:
    """The OpenAPI document with what the middleware answers (401, 413, strict-JSON 400/422, the guard's 500) on
    every operation it applies to, and the two security schemes; with auth on (keys or tenants configured:
    ``auth.enabled``) every operation but the probes, /metrics and url links requires one of them."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    components = schema.setdefault("components", {})
    components["securitySchemes"] = SECURITY_SCHEMES
    models = components.setdefault("schemas", {})
    for model in (ErrorResponse, ValidationResponse):  # referenced below whether or not a route lists them
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, part in {**body.pop("$defs", {}), model.__name__: body}.items():
            models.setdefault(name, part)
    keys_on = auth.enabled
    for path, item in schema.get("paths", {}).items():
        open_path = path in auth.exempt_paths or path.startswith("/v1/images/files/")
        for method, operation in item.items():
            responses = operation.setdefault("responses", {})
            for status, name in _statuses(path, method, not open_path).items():
                responses.setdefault(str(status), {**_ref(name), "description": MEANING[status]})
            if keys_on:
                operation["security"] = [] if open_path else [{"bearerAuth": []}, {"basicAuth": []}]
    app.openapi_schema = schema
    return schema


class ImageData(BaseModel):
    b64_json: str | None = None
    url: str | None = None
    revised_prompt: str | None = None


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageData]
    output_format: str | None = None
    size: str | None = None
    background: str | None = None
    warnings: list[str] | None = None
    """sdserve extension: what was truncated or accepted without being honoured (also x-sdserve-warnings)."""

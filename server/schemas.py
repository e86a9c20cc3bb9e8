"""Request and response models of the HTTP API (validated at the edge; the pipeline validates again)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from engines.config import parse_size


def _not_blank(value: str) -> str:
    if not value.strip():
        raise ValueError("must not be empty")
    return value


Prompt = Annotated[str, AfterValidator(_not_blank)]
"""A prompt: text that is not empty or only whitespace."""


class ImageGenerationRequest(BaseModel):
    """OpenAI Images API ``POST /v1/images/generations``, with sdserve extensions."""

    model_config = ConfigDict(extra="forbid")

    prompt: Prompt = Field(..., description="What to draw. Longer than 77 CLIP tokens is truncated (reported).")
    n: int = Field(1, description="Number of images (1..limits.max_n).")
    size: str | None = Field(None, description="WIDTHxHEIGHT, multiples of the model's size factor. "
                                               "Default: the model's native size.")
    response_format: Literal["b64_json", "url"] = Field("b64_json", description="b64_json, or url: a link to "
                                                       "a short-lived copy (GET /v1/images/files/{id}.png).")
    model: str | None = Field(None, description="Accepted for compatibility; the server serves one model.")
    user: str | None = Field(None, max_length=256, description="End-user id (logged, never a metric label).")
    quality: str | None = Field(None, description="Accepted for compatibility; ignored.")
    style: str | None = Field(None, description="Accepted for compatibility; ignored.")
    negative_prompt: str = Field("", description="Extension: what to steer away from.")
    seed: int | None = Field(None, ge=0, le=2**32 - 1, description="Extension: seed of the first image; "
                                                                    "image i uses seed+i. Random when absent.")
    steps: int | None = Field(None, ge=1, description="Extension: denoising steps.")
    guidance_scale: float | None = Field(None, ge=0.0, le=30.0, description="Extension: CFG scale.")
    scheduler: str | None = Field(None, description="Extension: euler, euler_a, ddim or dpmpp_2m.")

    @field_validator("size")
    @classmethod
    def _size_format(cls, value: str | None) -> str | None:
        if value is None:
            return value
        try:
            parse_size(value)
        except ValueError:
            raise ValueError(f"must look like 512x512, got {value[:32]!r}") from None
        return value


class ImageData(BaseModel):
    b64_json: str | None = None
    url: str | None = None
    revised_prompt: str | None = None


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageData]

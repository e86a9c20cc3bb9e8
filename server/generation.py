"""The serving core's generation request: what to generate, in the core's own terms, whichever API asked.

Each route family maps its wire schema into a ``GenerationRequest`` through one validated function (OpenAI:
server/request_rules.py ``from_openai``; A1111: server/a1111_request.py ``from_a1111``); the core
(server/request_rules.py ``generation_batches``, server/service.py ``ImageService.to_batches``) takes only this.
Refusals name the field the client sent (``WireNames``), never a name of the core or of the engine's batch.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Literal

from engines.errors import InvalidRequestError

SEED_SPAN = 2**32
"""Seeds are taken modulo this (image i of a request uses seed + i)."""
RANDOM_SEEDS = SEED_SPAN - 1024
"""A drawn seed is below this, so the request's later images (seed + i, at most 16 x 16 of A1111's batch_size x
n_iter) do not wrap around."""
STEP_CACHE = "step_cache"
"""The wire field of the step cache on both APIs (the engine's batch calls it ``cache``; clients never send that)."""


def draw_seed() -> int:
    """The seed of a request that sent none: the serving core's one random draw, once per request."""
    return secrets.randbelow(RANDOM_SEEDS)


@dataclass(frozen=True)
class WireNames:
    """The wire field that set each value of a request, which a refusal names, and the API that sent it."""

    api: Literal["openai", "a1111"] = "openai"
    images: str = "n"
    size: str = "size"
    steps: str = "steps"
    scheduler: str = "scheduler"
    guidance: str = "guidance_scale"
    seed: str = "seed"
    loras: str = "loras"
    step_cache: str = STEP_CACHE


OPENAI_NAMES = WireNames()
A1111_NAMES = WireNames(api="a1111", images="batch_size", size="width", scheduler="sampler_name",
                        guidance="cfg_scale")


@dataclass(frozen=True)
class LoraAsk:
    """One LoRA asked for by a field of the request (prompt tags are parsed by the core)."""

    name: str
    weight: float = 1.0
    unet_weight: float | None = None
    """The denoiser's multiplier; None: ``weight``."""


@dataclass(frozen=True)
class GenerationRequest:
    """One request to generate ``batches`` x ``images`` images. None means the profile's or the model's default.
    Construction checks the values' own bounds (naming the wire field); the profile's limits and the model's
    offer are checked by the core."""

    prompt: str
    negative_prompt: str = ""
    images: int = 1
    """Images per batch (one engine batch each)."""
    batches: int = 1
    """Batches run in turn under one deadline (A1111's n_iter); the seeds go on from one to the next."""
    size: str | None = None
    """WIDTHxHEIGHT; None or "auto": the first served size, else the model's native size."""
    seed: int | None = None
    """The first image's seed (image i: seed + i); None: drawn once for the whole request (``draw_seed``)."""
    steps: int | None = None
    guidance: float | None = None
    scheduler: str | None = None
    """The engine's scheduler name (an A1111 sampler is resolved before)."""
    loras: tuple[LoraAsk, ...] = ()
    original_size: str | None = None
    """SDXL micro-conditioning: WIDTHxHEIGHT the image claims to come from."""
    crops: tuple[int, int] | None = None
    """SDXL micro-conditioning: [top, left] of the claimed crop."""
    step_cache: bool | None = None
    """True asks for the step cache, False refuses it, None follows the policy."""
    names: WireNames = OPENAI_NAMES

    def __post_init__(self) -> None:
        n = self.names
        # images: the core checks it against the profile's limits.max_n (one message, with the limit)
        checks = (("n_iter", self.batches >= 1, f"n_iter must be at least 1, got {self.batches}"),
                  (n.seed, self.seed is None or 0 <= self.seed < SEED_SPAN,
                   f"{n.seed} must be between 0 and {SEED_SPAN - 1}, got {self.seed}"),
                  (n.steps, self.steps is None or self.steps >= 1, f"{n.steps} must be at least 1, got {self.steps}"),
                  (n.guidance, self.guidance is None or self.guidance >= 0,
                   f"{n.guidance} must not be negative, got {self.guidance}"))
        for param, ok, message in checks:
            if not ok:
                raise InvalidRequestError(message, param=param)

"""Turns API requests into engine batches (validated against limits and the model) and results into PNGs."""

from __future__ import annotations

import asyncio
import base64
import io
import secrets
import time
from dataclasses import dataclass

from starlette.concurrency import run_in_threadpool

from engines.errors import InvalidRequestError
from engines.protocol import Batch, BatchResult, Engine, ImageSpec
from server.schemas import ImageGenerationRequest
from server.settings import Settings


def encode_png(image: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")  # type: ignore[attr-defined]
    return buffer.getvalue()


@dataclass(frozen=True)
class Generated:
    pngs: list[bytes]
    result: BatchResult
    queue_seconds: float
    encode_seconds: float


class ImageService:
    """One engine; one executing batch at a time (an asyncio lock, so waiting requests hold no thread)."""

    def __init__(self, engine: Engine, settings: Settings) -> None:
        self.engine = engine
        self.settings = settings
        self._lock = asyncio.Lock()

    def to_batch(self, req: ImageGenerationRequest) -> Batch:
        limits, defaults, info = self.settings.limits, self.settings.defaults, self.engine.info
        if not 1 <= req.n <= limits.max_n:
            raise InvalidRequestError(f"n must be between 1 and {limits.max_n}, got {req.n}", param="n")
        width, height = (info.default_size, info.default_size)
        if req.size is not None:
            width, height = (int(p) for p in req.size.lower().split("x"))
        for name, value, cap in (("width", width, limits.max_width), ("height", height, limits.max_height)):
            if value % info.size_multiple or value > cap:
                raise InvalidRequestError(
                    f"size {req.size}: {name} {value} must be a multiple of {info.size_multiple} "
                    f"and at most {cap}", param="size")
        steps = req.steps if req.steps is not None else defaults.steps
        if steps > limits.max_steps:
            raise InvalidRequestError(f"steps must be at most {limits.max_steps}, got {steps}", param="steps")
        scheduler = req.scheduler or defaults.scheduler
        if scheduler not in info.schedulers:
            raise InvalidRequestError(f"unknown scheduler {scheduler!r}; expected one of {list(info.schedulers)}",
                                      param="scheduler")
        for name, text in (("prompt", req.prompt), ("negative_prompt", req.negative_prompt)):
            if len(text) > limits.max_prompt_chars:
                raise InvalidRequestError(f"{name} is longer than {limits.max_prompt_chars} characters",
                                          param=name)
        seed = req.seed if req.seed is not None else secrets.randbelow(2**32)
        guidance = req.guidance_scale if req.guidance_scale is not None else defaults.guidance_scale
        images = tuple(ImageSpec(req.prompt, req.negative_prompt, (seed + i) % 2**32, guidance)
                       for i in range(req.n))
        return Batch(images, width, height, steps, scheduler)

    async def generate(self, batch: Batch) -> Generated:
        start = time.perf_counter()
        async with self._lock:
            queued = time.perf_counter() - start
            result = await run_in_threadpool(self.engine.generate, batch)
        t = time.perf_counter()
        pngs = await run_in_threadpool(lambda: [encode_png(g.image) for g in result.images])
        return Generated(pngs, result, queued, time.perf_counter() - t)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")

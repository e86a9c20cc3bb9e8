"""What every generation route does between parsing and formatting: readiness gate, prompt-length policy, deadline,
cancellation when the client goes away, and the headers that trace one request."""

from __future__ import annotations

import asyncio

from fastapi import Request, Response

from engines.errors import InvalidRequestError, NotReadyError
from engines.protocol import Batch
from server.batcher import ClientGoneError
from server.service import Generated

CLIENT_POLL_S = 0.1


def require_ready(request: Request) -> None:
    state = request.app.state.server_state
    if state.ready:
        return
    reasons = "; ".join(state.reasons)
    message = f"server is {state.state}" + (f": {reasons}" if reasons else "")
    raise NotReadyError(message, permanent=state.state == "failed")


def check_prompts(request: Request, batch: Batch) -> list[str]:
    """Warnings for truncated prompts, or a 400 when the profile rejects over-long prompts."""
    settings, engine = request.app.state.settings, request.app.state.engine
    prompts = [batch.images[0].prompt, batch.images[0].negative_prompt]
    over = engine.prompt_overflows(prompts)
    names = ("prompt", "negative_prompt")
    if any(over) and settings.limits.prompt_overflow == "reject":
        name = names[over.index(True)]
        raise InvalidRequestError(f"{name} is longer than the text encoder's {engine.info.max_prompt_tokens} tokens",
                                  param=name)
    return [f"{name} truncated to {engine.info.max_prompt_tokens} CLIP tokens" for name, o in zip(names, over,
                                                                                               strict=True) if o]


async def run_generation(request: Request, batch: Batch) -> Generated:
    """Queue the batch; cancel it if the client disconnects before it is done."""
    service = request.app.state.service
    deadline = service.deadline(request.headers.get("x-sdserve-timeout-s"))
    task = asyncio.ensure_future(service.generate(batch, deadline))
    while True:
        done, _ = await asyncio.wait({task}, timeout=CLIENT_POLL_S)
        if done:
            result: Generated = task.result()
            return result
        if await request.is_disconnected():
            task.cancel()
            request.app.state.metrics.cancelled.labels("disconnect").inc()
            await asyncio.gather(task, return_exceptions=True)
            raise ClientGoneError("client disconnected before the response was ready; its request was dropped")


def trace_headers(response: Response, out: Generated, warnings: list[str]) -> None:
    timings = out.result.timings
    response.headers["Server-Timing"] = (f"queue;dur={out.queue_seconds * 1000:.1f}, "
                                         f"compute;dur={timings.get('total', 0.0) * 1000:.1f}, "
                                         f"encode;dur={out.encode_seconds * 1000:.1f}")
    response.headers["x-sdserve-provider"] = out.result.provider
    response.headers["x-sdserve-seeds"] = ",".join(str(g.seed) for g in out.result.images)
    response.headers["x-sdserve-batch-size"] = str(int(timings.get("batch_images", len(out.result.images))))
    if warnings:
        response.headers["x-sdserve-warnings"] = "; ".join(warnings)

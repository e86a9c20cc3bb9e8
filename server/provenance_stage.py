"""The provenance stage of a response: what the server knows about each image, signed into it (server/provenance.py).

Every fact comes from where /capabilities and the response headers take it, never recomputed from a guess: the
model (``ModelInfo``: id, family, UNet sha256), the model folder's and the engine artifacts' manifest digests (the
files boot verified), the provider each component's session runs on, the runtime and library versions preflight
observed, the GPU, the provider that ran this batch (``x-sdserve-provider``), the seed (``x-sdserve-seeds``), the
request id (``x-request-id``) and the readiness state. The prompt only when ``[provenance] include_prompt``.

With ``[provenance] watermark`` the pixels are marked first (server/watermark.py), so the signature covers the
marked image and the manifest records each image's payload (or why it has none).
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from functools import cache
from pathlib import Path
from typing import Any

from fastapi import Request, Response
from starlette.concurrency import run_in_threadpool

from engines.factory import manifest_name
from engines.types.request import Batch, ImageSpec
from engines.types.snapshot import Capabilities
from server import headers
from server.errors import request_id_of
from server.provenance import HEADER, WATERMARK_HEADER, Provenance, digest_of, media_type
from server.service import Generated
from server.watermark import Marked

MANIFEST = manifest_name()


@cache
def sdserve_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sdserve")
    except PackageNotFoundError:  # a checkout that was never installed
        return "unknown"


@cache
def _digest(path: str) -> str | None:
    """A manifest's sha256, read once: boot verified these files and the watchdog flips /ready if they change."""
    return digest_of(Path(path))


def _gpu(caps: Capabilities) -> str | None:
    if caps.device != "cuda" or caps.observations is None:
        return None
    devices = caps.observations.nvml.devices
    return next((d.name for d in devices if d.index == caps.device_id), devices[0].name if devices else None)


def _versions(caps: Capabilities) -> dict[str, str | None]:
    obs = caps.observations
    if obs is None:
        return {}
    return {"onnxruntime": obs.onnxruntime, "onnxruntime_cuda_build": obs.onnxruntime_cuda_build or None,
            "cuda_driver": obs.nvml.cuda_driver_version or None, "driver": obs.nvml.driver_version or None,
            "cudnn": obs.cudnn.version, "tensorrt": obs.tensorrt.version,
            **({"plugin": f"{obs.plugin.package} {obs.plugin.package_version}"} if obs.plugin else {})}


def ingredient(data: bytes, title: str, relationship: str) -> dict[str, Any]:
    """One input image as a C2PA ingredient (server/provenance.py manifest_definition): ``title`` (the request's
    field: ``image``, ``image.1``, ``init_images.0``, ``mask``), its format as its bytes say, the SHA-256 of the
    bytes as sent, and its ``relationship``: ``parentOf`` the image edited (img2img's and inpainting's init image,
    an instruction edit's first image), ``componentOf`` an instruction edit's other reference images, ``inputTo``
    the mask (C2PA 2.x: an input to the model that made the asset)."""
    kind = media_type(data) or ("image/gif" if data[:4] == b"GIF8" else "image/bmp" if data[:2] == b"BM"
                                else "application/octet-stream")
    return {"title": title, "format": kind, "relationship": relationship,
            "sha256": hashlib.sha256(data).hexdigest()}


def record_inputs(request: Request, per_image: list[list[dict[str, Any]]]) -> None:
    """An edit route's input images, recorded for the provenance stage: image ``i`` of each batch takes the
    ingredients ``per_image[i % len(per_image)]`` (A1111's init_images cycle over the batch; one list for every
    image of an OpenAI edit or an instruction edit)."""
    request.state.provenance_inputs = per_image


def server_facts(request: Request) -> dict[str, Any]:
    """The facts every image of this request shares."""
    app = request.app
    caps: Capabilities = app.state.engine.capabilities()
    info = app.state.engine.info
    engines = caps.artifacts.engines
    return {"sdserve_version": sdserve_version(), "request_id": request_id_of(request.scope),
            "readiness": app.state.server_state.state, "accelerated": caps.accelerated,
            "model": {"id": info.name, "family": info.family, "unet_sha256": info.digest or None,
                      "folder_manifest_sha256": _digest(str(Path(caps.model) / MANIFEST)),
                      "verification": caps.artifacts.model_manifest},
            "artifacts": {"manifest_sha256": _digest(str(Path(engines.path) / MANIFEST)) if engines else None,
                          "profiles": len(engines.profiles) if engines else 0},
            "providers": {name: (s.providers_used or ("none",))[0] for name, s in caps.sessions.items()},
            "versions": _versions(caps), "device": caps.device, "gpu": _gpu(caps)}


def image_facts(batch: Batch, out: Generated, index: int, include_prompt: bool) -> dict[str, Any]:
    """One image's own facts: how it was sampled, and (when the profile opts in) what was asked for."""
    spec: ImageSpec = batch.images[index] if index < len(batch.images) else batch.images[0]
    result = out.result
    width, height = result.images[index].image.size  # the returned size (Hires fix: the second pass's)
    facts: dict[str, Any] = {
        "model_served": out.model, "provider": result.provider, "index": index, "seed": result.images[index].seed,
        "mode": batch.mode, "width": width, "height": height, "steps": batch.steps,
        "steps_done": result.steps_done or batch.steps, "interrupted": result.interrupted,
        "sampler": batch.scheduler, "guidance_scale": spec.guidance_scale, "batch_images": result.executed,
        # the adapter set that ran (x-sdserve-loras): file hashes and multipliers, names only as the library had them
        "loras": [{"name": u.name, "sha256": u.sha256, "te_multiplier": u.te, "unet_multiplier": u.unet}
                  for u in batch.loras]}
    if batch.mode != "txt2img":
        facts["strength"] = batch.strength
    if result.cache is not None:  # no longer the seed-reproducible uncached image: the manifest says so
        use = result.cache
        facts["step_cache"] = {"method": use.spec.method, "threshold": use.spec.threshold,
                               "warmup": use.spec.warmup, "final": use.spec.final, "max_reuse": use.spec.max_reuse,
                               "reused": use.reused, "evaluations": use.evaluations}
    if include_prompt:
        facts["prompt"], facts["negative_prompt"] = spec.prompt, spec.negative_prompt
    return facts


async def sign_images(request: Request, response: Response, runs: list[tuple[Batch, Generated]],
                      images: list[bytes] | None = None) -> tuple[list[bytes], str]:
    """The final bytes of every image of ``runs`` (default: their encoded images, in order), watermarked when the
    profile asks and signed, off the event loop, and the warning to give when they could not be signed (else "").
    Sets x-sdserve-provenance (and x-sdserve-watermark) and adds ``watermark;dur=`` and ``sign;dur=`` to
    Server-Timing. require mode: SigningError (500) when an image cannot be signed."""
    provenance: Provenance = request.app.state.service.provenance
    items = [(batch, out, i) for batch, out in runs for i in range(len(out.pngs))]
    final = images if images is not None else [p for _, out in runs for p in out.pngs]
    marks: list[Marked] = []
    if provenance.settings.watermark:
        start = time.perf_counter()
        marks = await run_in_threadpool(provenance.mark, final, request_id_of(request.scope))
        final = [mark.data for mark in marks]
        response.headers[WATERMARK_HEADER] = ",".join(mark.header for mark in marks)
        _timing(response, "watermark", time.perf_counter() - start)
    if provenance.mode == "off":
        stamped = provenance.stamp(final, [], "")
    else:
        shared = server_facts(request)
        include = provenance.settings.include_prompt
        facts = [{**shared, **image_facts(batch, out, i, include)} for batch, out, i in items]
        inputs: list[list[dict[str, Any]]] = getattr(request.state, "provenance_inputs", None) or []
        if inputs:  # the edit's input images, as C2PA ingredients (and in sdserve's assertion)
            for n, (_, _, i) in enumerate(items):
                facts[n]["ingredients"] = inputs[i % len(inputs)]
        for n, mark in enumerate(marks):
            facts[n]["watermark"] = mark.record(n)
        stamped = await run_in_threadpool(provenance.stamp, final, facts, sdserve_version())
    response.headers[HEADER] = stamped.status
    if stamped.seconds:
        _timing(response, "sign", stamped.seconds)
    return stamped.images, stamped.warning


def _timing(response: Response, name: str, seconds: float) -> None:
    timing = response.headers.get("Server-Timing")
    entry = f"{name};dur={seconds * 1000:.1f}"
    response.headers["Server-Timing"] = f"{timing}, {entry}" if timing else entry


async def stamp(request: Request, response: Response, out: Generated, batch: Batch) -> Generated:
    """``out`` with its images signed (OpenAI routes: after the trace headers, which it extends; a warning joins
    ``out.warnings``). The last step before answering, so the signature covers the bytes the client gets."""
    images, warning = await sign_images(request, response, [(batch, out)])
    return dataclasses.replace(out, pngs=images, warnings=out.warnings + ([warning] if warning else []))


async def stamp_a1111(request: Request, response: Response, outs: list[Generated], batches: list[Batch],
                      images: list[bytes] | None = None) -> list[bytes]:
    """A1111 routes: the final images (default: every out's, in order; after any infotext or paste-back) signed;
    a warning is appended to x-sdserve-warnings."""
    signed, warning = await sign_images(request, response, list(zip(batches, outs, strict=True)), images)
    if warning:
        current = response.headers.get(headers.WARNINGS)
        headers.put(response.headers, headers.WARNINGS, f"{current}; {warning}" if current else warning)
    return signed

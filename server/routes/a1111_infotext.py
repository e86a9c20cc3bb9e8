"""The ``info`` JSON of an A1111 txt2img response, with ``infotexts``: the A1111 parameters line per image.

Keys follow AUTOMATIC1111/stable-diffusion-webui ``modules/processing.py`` ``Processed.js()``; the infotext follows
``create_infotext`` there: the prompt, ``Negative prompt: ...`` when there is one, then ``Steps: N, Sampler: S,
Schedule type: T, CFG scale: C, Seed: X, Size: WxH, Model hash: H, Model: M, Version: V``. LibreChat's Stable
Diffusion tool (api/app/clients/tools/structured/StableDiffusion.js) reads ``info.infotexts[0]``, ``info.seed``,
``info.width`` and ``info.height``; image viewers read the same line from a PNG's ``parameters`` text chunk.
"""

from __future__ import annotations

import json
import time
from typing import Any

import engines.families as families
from engines.types.model import ModelInfo
from engines.types.request import Batch, CacheUse
from server.caching import infotext_value
from server.infotext_parse import parse_infotext as parse_infotext  # read side: server/infotext_parse.py
from server.infotext_parse import read_infotext as read_infotext
from server.service import Generated

VERSION = "sdserve 0.1.0"
_LABELS = {"karras": "Karras", "exponential": "Exponential", "uniform": "Uniform", "sgm_uniform": "SGM Uniform"}


def schedule_label(scheduler: str) -> str:
    """The A1111 schedule type label of an API scheduler name ("dpmpp_2m_karras" -> "Karras")."""
    for suffix in sorted(_LABELS, key=len, reverse=True):
        if scheduler.endswith("_" + suffix):
            return _LABELS[suffix]
    return "Automatic"


def quote(value: object) -> str:
    """A value as A1111's infotext_utils.quote writes it: JSON-quoted when it holds a comma, newline or colon."""
    text = str(value)
    return json.dumps(text, ensure_ascii=False) if any(c in text for c in ",\n:") else text


def infotext(prompt: str, negative: str, params: dict[str, Any]) -> str:
    """One A1111 parameters line: prompt, negative prompt line when non-empty, then ``key: value`` pairs."""
    negative_line = f"\nNegative prompt: {negative}" if negative else ""
    return f"{prompt}{negative_line}\n" + ", ".join(f"{key}: {quote(value)}" for key, value in params.items())


def image_params(batch: Batch, seed: int, model: ModelInfo, sampler: str,
                 extra: dict[str, Any] | None = None, cache: CacheUse | None = None) -> dict[str, Any]:
    """The parameters of one image, in create_infotext's order (``extra``: e.g. the Hires fix's, before Version;
    ``cache``: the step cache that ran, as ``Step cache``)."""
    short = model.digest[:10]
    # A1111's Lora extension adds "Lora hashes" (name: short hash); here the first 12 hex of the file's sha256.
    loras = {"Lora hashes": ", ".join(f"{u.name}: {u.sha256[:12]}" for u in batch.loras)} if batch.loras else {}
    guidance = f"{batch.images[0].guidance_scale:g}"
    # A guidance-distilled model (FLUX.1 dev) as Forge writes it: no true CFG (1) and the embedded guidance, so a
    # Forge client sending the infotext back gets the same image (docs/api.md, "Guidance on the A1111 routes").
    distilled = families.facts(model.family).distilled_guidance
    cfg = {"CFG scale": "1", "Distilled CFG Scale": guidance} if distilled else {"CFG scale": guidance}
    return {"Steps": batch.steps, "Sampler": sampler, "Schedule type": schedule_label(batch.scheduler),
            **cfg, "Seed": seed,
            "Size": f"{batch.width}x{batch.height}", **({"Model hash": short} if short else {}),
            "Model": model.name, **loras, **({"Step cache": infotext_value(cache)} if cache else {}),
            **(extra or {}), "Version": VERSION}


def generation_info(prompt: str, negative: str, batches: list[Batch], outs: list[Generated], model: ModelInfo,
                    sampler: str, extra: dict[str, Any], params: dict[str, Any] | None = None) -> dict[str, Any]:
    """The info dict of one txt2img response (``extra``: sdserve's own keys, e.g. warnings and interruption;
    ``params``: extra infotext parameters, e.g. the Hires fix's)."""
    first = batches[0]
    seeds = [g.seed for out in outs for g in out.result.images]
    cfg = first.images[0].guidance_scale
    short = model.digest[:10]
    cache = outs[0].result.cache if outs else None
    params_of = [image_params(first, seed, model, sampler, params, cache) for seed in seeds]
    count = len(seeds)
    return {"prompt": prompt, "all_prompts": [prompt] * count, "negative_prompt": negative,
            "all_negative_prompts": [negative] * count, "seed": seeds[0], "all_seeds": seeds, "subseed": -1,
            "all_subseeds": [-1] * count, "subseed_strength": 0, "width": first.width, "height": first.height,
            "sampler_name": sampler, "scheduler": schedule_label(first.scheduler), "cfg_scale": cfg,
            "steps": first.steps, "batch_size": len(first.images), "n_iter": len(batches), "restore_faces": False,
            "face_restoration_model": None, "sd_model_name": model.name, "sd_model_hash": short or None,
            "sd_vae_name": None, "sd_vae_hash": None, "seed_resize_from_w": -1, "seed_resize_from_h": -1,
            "denoising_strength": None, "extra_generation_params": {"Schedule type": schedule_label(first.scheduler)},
            "index_of_first_image": 0, "infotexts": [infotext(prompt, negative, p) for p in params_of],
            "styles": [], "job_timestamp": time.strftime("%Y%m%d%H%M%S"), "clip_skip": 1,
            "is_using_inpainting_conditioning": False, "version": VERSION, **extra}

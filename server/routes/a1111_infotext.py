"""The ``info`` JSON of an A1111 txt2img response, with ``infotexts``: the A1111 parameters line per image.

Keys follow AUTOMATIC1111/stable-diffusion-webui ``modules/processing.py`` ``Processed.js()``; the infotext follows
``create_infotext`` there: the prompt, ``Negative prompt: ...`` when there is one, then ``Steps: N, Sampler: S,
Schedule type: T, CFG scale: C, Seed: X, Size: WxH, Model hash: H, Model: M, Version: V``. LibreChat's Stable
Diffusion tool (api/app/clients/tools/structured/StableDiffusion.js) reads ``info.infotexts[0]``, ``info.seed``,
``info.width`` and ``info.height``; image viewers read the same line from a PNG's ``parameters`` text chunk.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

from PIL import Image

from engines.protocol import Batch, ModelInfo
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
                 extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The parameters of one image, in create_infotext's order (``extra``: e.g. the Hires fix's, before Version)."""
    short = model.digest[:10]
    # A1111's Lora extension adds "Lora hashes" (name: short hash); here the first 12 hex of the file's sha256.
    loras = {"Lora hashes": ", ".join(f"{u.name}: {u.sha256[:12]}" for u in batch.loras)} if batch.loras else {}
    return {"Steps": batch.steps, "Sampler": sampler, "Schedule type": schedule_label(batch.scheduler),
            "CFG scale": f"{batch.images[0].guidance_scale:g}", "Seed": seed,
            "Size": f"{batch.width}x{batch.height}", **({"Model hash": short} if short else {}),
            "Model": model.name, **loras, **(extra or {}), "Version": VERSION}


def generation_info(prompt: str, negative: str, batches: list[Batch], outs: list[Generated], model: ModelInfo,
                    sampler: str, extra: dict[str, Any], params: dict[str, Any] | None = None) -> dict[str, Any]:
    """The info dict of one txt2img response (``extra``: sdserve's own keys, e.g. warnings and interruption;
    ``params``: extra infotext parameters, e.g. the Hires fix's)."""
    first = batches[0]
    seeds = [g.seed for out in outs for g in out.result.images]
    cfg = first.images[0].guidance_scale
    short = model.digest[:10]
    params_of = [image_params(first, seed, model, sampler, params) for seed in seeds]
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


# Reading an infotext back (POST /sdapi/v1/png-info), as A1111's modules/images.py read_info_from_image and
# modules/infotext_utils.py parse_generation_parameters do.

PARAM = re.compile(r'\s*(\w[\w \-/]+):\s*("(?:\\.|[^\\"])+"|[^,]*)(?:,|$)')
"""One ``key: value`` pair of the parameters line (a value JSON-quoted when it holds a comma)."""
IMAGE_SIZE = re.compile(r"^(\d+)x(\d+)$")
DEFAULTS: dict[str, Any] = {"Clip skip": "1", "Hires resize-1": 0, "Hires resize-2": 0,
                            "Hires sampler": "Use same sampler", "Hires checkpoint": "Use same checkpoint",
                            "Hires prompt": "", "Hires negative prompt": "", "Mask mode": "Inpaint masked",
                            "Masked content": "original", "Inpaint area": "Whole picture", "Masked area padding": 32,
                            "RNG": "GPU", "Schedule type": "Automatic", "Schedule max sigma": 0,
                            "Schedule min sigma": 0, "Schedule rho": 0, "VAE Encoder": "Full", "VAE Decoder": "Full",
                            "FP8 weight": "Disable"}
"""What parse_generation_parameters fills in for a parameter the text does not name."""
IGNORED_INFO_KEYS = frozenset({"jfif", "jfif_version", "jfif_unit", "jfif_density", "dpi", "exif", "loop",
                               "background", "timestamp", "duration", "progressive", "progression", "icc_profile",
                               "chromaticity", "photoshop"})
"""Image info keys read_info_from_image drops from ``items``."""
_COMMENT_CODECS = {b"ASCII\x00\x00\x00": "ascii", b"JIS\x00\x00\x00\x00\x00": "shift_jis",
                   b"UNICODE\x00": "utf-16-be"}
"""EXIF UserComment character codes (piexif.helper.UserComment.load)."""


def _unquote(text: str) -> str:
    if len(text) < 2 or text[0] != '"' or text[-1] != '"':
        return text
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, str) else text


def parse_infotext(text: str) -> dict[str, Any]:
    """The parameters dict of an infotext: Prompt, Negative prompt, every ``key: value`` of the last line (a
    WIDTHxHEIGHT value split into ``key-1``/``key-2``), and A1111's defaults for the ones it does not name."""
    *lines, last = text.strip().split("\n")
    if len(PARAM.findall(last)) < 3:
        lines.append(last)
        last = ""
    prompt: list[str] = []
    negative: list[str] = []
    for line in (line.strip() for line in lines):
        if line.startswith("Negative prompt:"):
            negative.append(line[len("Negative prompt:"):].strip())
        else:
            (negative if negative else prompt).append(line)
    found: dict[str, Any] = {"Prompt": "\n".join(prompt), "Negative prompt": "\n".join(negative)}
    for key, value in PARAM.findall(last):
        value = _unquote(value)
        size = IMAGE_SIZE.match(value)
        if size is not None:
            found[f"{key}-1"], found[f"{key}-2"] = size.group(1), size.group(2)
        else:
            found[key] = value
    return found | {k: v for k, v in DEFAULTS.items() if k not in found}


def read_infotext(image: Image.Image) -> tuple[str, dict[str, Any]]:
    """(the infotext, the image's other info items) of a decoded image: the PNG ``parameters`` text, else the
    EXIF UserComment (JPEG, WebP), else a GIF comment; "" when there is none. Items are JSON-safe (bytes
    decoded as UTF-8, other values as text)."""
    items = dict(image.info or {})
    text = items.pop("parameters", None)
    if "exif" in items:
        items.pop("exif")
        comment = image.getexif().get_ifd(0x8769).get(0x9286)
        if isinstance(comment, bytes) and comment:
            codec = _COMMENT_CODECS.get(comment[:8])
            text = comment[8:].decode(codec, errors="ignore") if codec else comment.decode("utf8", errors="ignore")
    elif "comment" in items:
        comment = items["comment"]
        text = comment.decode("utf8", errors="ignore") if isinstance(comment, bytes) else str(comment)
    safe: dict[str, Any] = {str(k): v if isinstance(v, str | int | float | bool) else
            v.decode("utf8", errors="replace") if isinstance(v, bytes) else str(v)
            for k, v in items.items() if k not in IGNORED_INFO_KEYS}
    return (text if isinstance(text, str) else ""), safe

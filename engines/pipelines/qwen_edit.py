"""Qwen-Image-Edit-Plus (2509 and 2511) instruction edits on the Qwen-Image pipeline, as diffusers'
``QwenImageEditPlusPipeline`` (0.42, with transformers 5) does them. The transformer, the schedule, the true CFG with
norm rescaling and the decode are Qwen-Image's (engines/pipelines/qwen.py); what an edit adds, per input image
(engines/types/request.py ``EditImage.references``, each its own size, up to ``REFERENCES``):

1. The condition image: resized (Lanczos) to ``calculate_dimensions(384², aspect)``, then the Qwen2-VL image
   processor's steps (``smart_resize`` to multiples of 28 within its pixel bounds, bicubic; rescale and normalise
   with its mean/std; 14×14 patches, the temporal patch of 2 repeating the frame, laid out by 2×2 merge blocks),
   run through the vision tower (``vision/``: window order, 2D rotary angles and the window mask computed here, as
   transformers' ``get_vision_window_index`` and ``get_vision_position_ids`` do).
2. The prompt: the edit template with ``Picture i: <|vision_start|><|image_pad|>…<|vision_end|>`` per image before
   the instruction, each pad repeated once per merged patch; the text encoder puts the image embeddings on those
   tokens and runs the language model at positions 0…S-1 on the three M-RoPE axes (what the reference computes:
   diffusers passes no ``mm_token_type_ids``, so transformers does not build 3D positions); the first
   ``EDIT_DROP`` (64) states are dropped. The negative prompt sees the same images.
3. The reference latents: each image resized (Lanczos) to ``calculate_dimensions(1024², aspect)``, the VAE's mean
   (normalised latents: folded in at export), 2×2-packed, all images' tokens after the noisy ones
   (engines/pipelines/flow_extra.py), their output dropped; the rotary tables give image ``i`` frame ``i`` (the
   noisy latents frame 0), rows and columns centred as Qwen-Image's, text positions after the largest half-side of
   all of them (``QwenEmbedRope`` over ``img_shapes``).

2511 is the same pipeline on a transformer with ``zero_cond_t``: the reference tokens are modulated at timestep 0,
the noisy ones at the step's; its exported graph takes ``modulate_index`` (0 for each noisy token, 1 for each
reference token: ``position_feeds``), and a folder whose config and graph disagree on it is refused at load.

The output size: the request's, or ``edit_size`` (``calculate_dimensions(1024², aspect of the last image)``,
floored to 16).
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from engines.errors import InvalidRequestError, ModelLoadError
from engines.lora.active import Adapters
from engines.numerics.qwen_tokenizer import load_unpadded
from engines.pipelines.flow import DitConditioning, pack_latents, run
from engines.pipelines.flow_extra import ExtraTokens
from engines.pipelines.kontext import reference_pixels
from engines.pipelines.ort_model import OrtModel
from engines.pipelines.qwen import ROPE_THETA, QwenPipeline
from engines.pipelines.unet_edits import ENCODER_OUTPUT
from engines.pipelines.unet_family import read_json
from engines.types.model import ModelInfo
from engines.types.request import Batch

TEMPLATE = ("<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
            "background), then explain how the user's text instruction should alter or modify the image. Generate a "
            "new image that meets the user's requirements while maintaining consistency with the original input "
            "where appropriate.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n")
"""QwenImageEditPlusPipeline's ``prompt_template_encode``."""
PICTURE = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"
EDIT_DROP = 64
"""Its ``prompt_template_encode_start_idx``."""
CONDITION_AREA = 384 * 384
VAE_AREA = 1024 * 1024
REFERENCES = 3
MAX_ASPECT = 8.0
"""The widest input image (long side over short side): diffusers sets no bound; past it the production TensorRT
plan's profiles (engines/build/trtplan_edit.py) hold no engine for the image, so it is refused naming ``image``."""
"""Input images per edit: diffusers sets no limit; Qwen-Image-Edit-2509's card names 1 to 3 as the trained range."""
MAX_SEQUENCE_LENGTH = 1024
"""The edit pipeline's ``tokenizer_max_length`` (the template, image tokens included, is never cut)."""
MODULATE_INDEX = "modulate_index"
"""The 2511 transformer's input (engines/build/qwen_edit.py): int64 [image tokens], 0 noisy, 1 reference."""


def calculate_dimensions(area: int, ratio: float) -> tuple[int, int]:
    """diffusers' rule: (width, height) of ``area`` pixels at ``ratio`` (w / h), each rounded to 32."""
    width = math.sqrt(area * ratio)
    height = width / ratio
    return round(width / 32) * 32, round(height / 32) * 32


def reference_sizes(sizes: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    """The (width, height) each input image's latents are encoded at (``extra_tokens``): ``VAE_AREA`` at its
    aspect; what admission charges an edit's reference tokens by (ModelInfo.instruct_references)."""
    return tuple(calculate_dimensions(VAE_AREA, w / h) for w, h in sizes)


def edit_size(sizes: tuple[tuple[int, int], ...], multiple: int = 16) -> tuple[int, int]:
    """The output (width, height) when a call names no size: 1024² at the last input image's aspect, floored to
    ``multiple`` (QwenImageEditPlusPipeline.__call__)."""
    w, h = sizes[-1]
    width, height = calculate_dimensions(VAE_AREA, w / h)
    return width // multiple * multiple, height // multiple * multiple


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The Qwen2-VL image processor's (height, width): multiples of ``factor`` near the aspect, within the bounds."""
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = max(factor, math.floor(height / beta / factor) * factor), max(factor, math.floor(width / beta / factor)
                                                                                 * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


class VisionInputs:
    """One condition image as the vision tower takes it: patches, window order, rotary tables, window mask."""

    def __init__(self, image: Image.Image, processor: dict[str, Any], vision: dict[str, Any]) -> None:
        patch, merge, temporal = int(vision["patch_size"]), int(vision["spatial_merge_size"]), \
            int(vision["temporal_patch_size"])
        size = processor.get("size") or {}
        low = int(processor.get("min_pixels") or size.get("shortest_edge", 56 * 56))
        high = int(processor.get("max_pixels") or size.get("longest_edge", 28 * 28 * 1280))
        h, w = smart_resize(image.height, image.width, patch * merge, low, high)
        pixels = np.asarray(image.convert("RGB").resize((w, h), Image.Resampling.BICUBIC))
        scaled = (pixels.astype(np.float64) * float(processor.get("rescale_factor", 1 / 255))).astype(np.float32)
        x = (scaled - np.asarray(processor["image_mean"], np.float32)) / np.asarray(processor["image_std"], np.float32)
        gh, gw = h // patch, w // patch
        blocks = x.transpose(2, 0, 1).reshape(3, gh // merge, merge, patch, gw // merge, merge, patch)
        blocks = blocks.transpose(1, 4, 2, 5, 0, 3, 6)[:, :, :, :, :, None]
        self.pixels = np.ascontiguousarray(np.broadcast_to(blocks, (*blocks.shape[:5], temporal, patch, patch))
                                           .reshape(gh * gw, 3 * temporal * patch * patch), dtype=np.float32)
        self.tokens = gh * gw // (merge * merge)
        self.window_index, bounds = _window_index(gh // merge, gw // merge,
                                                  int(vision["window_size"]) // merge // patch)
        head = int(vision["hidden_size"]) // int(vision["num_heads"])
        rows = np.arange(gh)[:, None].repeat(gw, 1).reshape(gh // merge, merge, gw // merge, merge)
        cols = np.arange(gw)[None, :].repeat(gh, 0).reshape(gh // merge, merge, gw // merge, merge)
        theta = float((vision.get("rope_parameters") or {}).get("rope_theta", vision.get("rope_theta", 10000.0)))
        inv = 1.0 / theta ** (np.arange(0, head // 2, 2, dtype=np.float32) / np.float32(head // 2))
        angles = np.concatenate([np.outer(a.transpose(0, 2, 1, 3).reshape(-1).astype(np.float32), inv.astype(
            np.float32)) for a in (rows, cols)], axis=1)
        angles = np.concatenate([angles, angles], axis=1).astype(np.float32)
        unit = merge * merge
        order = angles.reshape(-1, unit, head)[self.window_index].reshape(-1, head)
        self.cos, self.sin = np.cos(order), np.sin(order)
        n = gh * gw
        self.mask = np.full((n, n), -1e9, np.float32)
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            self.mask[start * unit:end * unit, start * unit:end * unit] = 0.0


def _window_index(gh: int, gw: int, window: int) -> tuple[np.ndarray, list[int]]:
    """transformers' ``get_vision_window_index`` for one image of one frame: the merged patches in window order and
    the windows' bounds (in merged patches)."""
    pad_h, pad_w = window - gh % window, window - gw % window
    index = np.full((gh + pad_h, gw + pad_w), -1, np.int64)
    index[:gh, :gw] = np.arange(gh * gw).reshape(gh, gw)
    nh, nw = (gh + pad_h) // window, (gw + pad_w) // window
    windows = index.reshape(nh, window, nw, window).transpose(0, 2, 1, 3).reshape(nh * nw, -1)
    order, bounds = [], [0]
    for cells in windows:
        kept = cells[cells >= 0]
        if len(kept):
            order.append(kept)
            bounds.append(bounds[-1] + len(kept))
    return np.concatenate(order), bounds


def _angles(positions: np.ndarray, dim: int) -> np.ndarray:
    """``QwenEmbedRope.rope_params`` in float32 for one axis."""
    exponent = np.arange(0, dim, 2).astype(np.float32) / np.float32(dim)
    inv = (np.float32(1.0) / np.power(np.float32(ROPE_THETA), exponent)).astype(np.float32)
    return np.outer(positions.astype(np.float32), inv).astype(np.float32)


def edit_rope(shapes: list[tuple[int, int]], text: int, axes_dim: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Rotary (cos, sin) tables over text then every image's tokens (``shapes``: packed (rows, cols), the noisy
    latents first): image ``i`` at frame ``i``, rows and columns centred; text after the largest half-side."""
    parts = []
    for frame, (gh, gw) in enumerate(shapes):
        rows, cols = np.arange(gh) - (gh - gh // 2), np.arange(gw) - (gw - gw // 2)
        parts.append(np.stack([np.full(gh * gw, frame), np.repeat(rows, gw), np.tile(cols, gh)], 1))
    start = max(max(gh // 2, gw // 2) for gh, gw in shapes)
    words = np.repeat(np.arange(start, start + text)[:, None], 3, axis=1)
    positions = np.concatenate([words, *parts])
    angles = np.concatenate([_angles(positions[:, a], d) for a, d in enumerate(axes_dim)], axis=1)
    return np.repeat(np.cos(angles), 2, axis=1), np.repeat(np.sin(angles), 2, axis=1)


class QwenEditPipeline(QwenPipeline):
    """Qwen-Image-Edit-Plus: Qwen-Image with the input images seen by the vision tower and their latents beside the
    noisy ones."""

    def load_text(self, folder: Path, models: dict[str, OrtModel]) -> None:
        self.text_encoder, self.vision = models["text_encoder"], models["vision"]
        self.text_encoders.append(self.text_encoder)
        self.edit_tokenizer, self.pad_id = load_unpadded(folder / "tokenizer" / "tokenizer.json", "Qwen",
                                                         f"in {folder}")
        self.processor = read_json(folder / "processor" / "preprocessor_config.json")
        self.vision_config = read_json(folder / "vision" / "config.json")
        self.width = int(read_json(folder / "text_encoder" / "config.json")["hidden_size"])
        self.max_sequence_length = MAX_SEQUENCE_LENGTH
        self.zero_cond = MODULATE_INDEX in self.transformer.inputs
        """2511: the reference tokens modulated at timestep 0 (the graph takes ``modulate_index``)."""
        if self.zero_cond != bool(read_json(folder / "transformer" / "config.json").get("zero_cond_t", False)):
            raise ModelLoadError(f"{folder}: the transformer's inputs {sorted(self.transformer.inputs)} do not match "
                                 f"its config (zero_cond_t={not self.zero_cond}): export it again")

    def _references(self, batch: Batch) -> list[tuple[np.ndarray, ...]]:
        refs = [spec.edit.references if spec.edit is not None else () for spec in batch.images]
        for r in refs:
            if not 1 <= len(r) <= REFERENCES:
                raise InvalidRequestError(f"Qwen-Image-Edit takes 1 to {REFERENCES} input images per edit, not "
                                          f"{len(r)}", param="image")
            for a in r:
                if max(a.shape[0], a.shape[1]) > MAX_ASPECT * min(a.shape[0], a.shape[1]):
                    raise InvalidRequestError(f"an input image of {a.shape[1]}x{a.shape[0]} is wider than "
                                              f"{MAX_ASPECT:g}:1, the most this server's Qwen-Image-Edit takes",
                                              param="image")
        sizes = {tuple(calculate_dimensions(VAE_AREA, a.shape[1] / a.shape[0]) for a in r) for r in refs}
        if len(sizes) > 1:
            raise InvalidRequestError("the input images of one batch must resize to the same sizes (they give "
                                      f"{sorted(sizes)})", param="image")
        return refs

    def check_inputs(self, batch: Batch) -> None:
        super().check_inputs(batch)
        if batch.mode == "instruct":
            if self.editor is None:
                raise InvalidRequestError(f"edits are not served by this model: {self.edits_unavailable}",
                                          param="image")
            self._references(batch)

    def _image_embeds(self, refs: tuple[np.ndarray, ...]) -> tuple[np.ndarray, list[int]]:
        """The vision tower's embeddings of each condition image, concatenated, and each one's token count."""
        embeds, counts = [], []
        for ref in refs:
            w, h = calculate_dimensions(CONDITION_AREA, ref.shape[1] / ref.shape[0])
            image = Image.fromarray(np.ascontiguousarray(ref[..., :3])).resize((w, h), Image.Resampling.LANCZOS)
            inputs = VisionInputs(image, self.processor, self.vision_config)
            embeds.append(run(self.vision, {"pixel_values": inputs.pixels, "window_index": inputs.window_index,
                                            "rope_cos": inputs.cos, "rope_sin": inputs.sin,
                                            "window_mask": inputs.mask}, ["image_embeds"], None)[0])
            counts.append(inputs.tokens)
        return np.concatenate(embeds).astype(np.float32), counts

    def _states(self, prompt: str, embeds: np.ndarray, counts: list[int], adapters: Adapters | None) -> np.ndarray:
        pictures = "".join(PICTURE.format(i + 1).replace("<|image_pad|>", "<|image_pad|>" * n)
                           for i, n in enumerate(counts))
        ids = np.asarray([self.edit_tokenizer.encode(TEMPLATE.format(pictures + prompt)).ids], np.int64)
        positions = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int64), (3, 1, ids.shape[1])).copy()
        feeds = {"input_ids": ids, "image_embeds": embeds, "position_ids": positions}
        return run(self.text_encoder, feeds, ["last_hidden_state"], adapters)[0][0, EDIT_DROP:]

    def encode(self, batch: Batch, length: int, cfg: bool, adapters: Adapters | None) -> DitConditioning:
        """Per row its prompt with its images (negatives first under CFG), zero-padded to ``length`` with a key
        mask; a prompt whose states pass ``length`` is refused (diffusers never cuts the edit template)."""
        refs = self._references(batch) if batch.mode == "instruct" else [()] * len(batch.images)
        rows = ([(s.negative_prompt, r) for s, r in zip(batch.images, refs, strict=True)] if cfg else []) + \
            [(s.prompt, r) for s, r in zip(batch.images, refs, strict=True)]
        seen: dict[int, tuple[np.ndarray, list[int]]] = {}
        states = np.zeros((len(rows), length, self.width), dtype=np.float32)
        mask = np.zeros((len(rows), length), dtype=np.float32)
        for row, (prompt, images) in enumerate(rows):
            if id(images) not in seen:
                seen[id(images)] = self._image_embeds(images) if images else (np.zeros((1, self.width), np.float32), [])
            hidden = self._states(prompt, *seen[id(images)], adapters)
            if len(hidden) > length:
                raise InvalidRequestError(f"the prompt with its images is {len(hidden)} tokens, past the text "
                                          f"encoder's {length}", param="prompt")
            states[row, :len(hidden)] = hidden
            mask[row, :len(hidden)] = 1.0
        flags = (False,) * len(batch.images)
        return DitConditioning(states, None, flags, flags, mask)

    def extra_tokens(self, batch: Batch) -> ExtraTokens | None:
        """Every input image's packed latents (the VAE's mean at its VAE size), image after image, with ids
        (frame, row, column): frame ``i`` for image ``i``."""
        if batch.mode != "instruct" or self.editor is None:
            return None
        refs = self._references(batch)
        encoder = self.editor.encoder
        out = ENCODER_OUTPUT if ENCODER_OUTPUT in encoder.outputs else encoder.outputs[0]
        tokens, ids = [], []
        for i in range(len(refs[0])):
            w, h = calculate_dimensions(VAE_AREA, refs[0][i].shape[1] / refs[0][i].shape[0])
            pixels = np.stack([reference_pixels(r[i], w, h) for r in refs])
            moments = run(encoder, {next(iter(encoder.inputs)): pixels}, [out], None)[0].astype(np.float32)
            latents = moments[:, :self.geometry.latent_channels]  # the mode; normalised at export
            tokens.append(pack_latents(latents))
            gh, gw = latents.shape[2] // 2, latents.shape[3] // 2
            ids.append(np.stack([np.full(gh * gw, i + 1), np.repeat(np.arange(gh), gw), np.tile(np.arange(gw), gh)],
                                1).astype(np.float32))
        return ExtraTokens(np.concatenate(tokens, axis=1), np.concatenate(ids))

    def position_feeds(self, cond: DitConditioning, h: int, w: int) -> dict[str, np.ndarray]:
        """The rotary tables over text, the noisy tokens and each input image's tokens."""
        shapes = [(h // 2, w // 2)]
        if cond.extra is not None:
            ids = cond.extra.ids
            for frame in sorted(set(ids[:, 0].astype(int))):
                rows = ids[ids[:, 0] == frame]
                shapes.append((int(rows[:, 1].max()) + 1, int(rows[:, 2].max()) + 1))
        cos, sin = edit_rope(shapes, cond.states.shape[1], self.axes_dim)
        if not self.zero_cond:
            return {"rope_cos": cos, "rope_sin": sin}
        noisy = shapes[0][0] * shapes[0][1]
        index = np.concatenate([np.zeros(noisy, np.int64), np.ones(sum(a * b for a, b in shapes[1:]), np.int64)])
        return {"rope_cos": cos, "rope_sin": sin, MODULATE_INDEX: index}

    def model_info(self, name: str, digest: str = "") -> ModelInfo:
        info = super().model_info(name, digest)
        if self.editor is None:
            return info
        return replace(info, modes=(*info.modes, "instruct"), instruct_images=REFERENCES,
                       instruct_size=partial(edit_size, multiple=self.size_multiple),
                       instruct_references=reference_sizes)

    def describe(self) -> str:
        return (f"Qwen-Image-Edit-Plus {'2511' if self.zero_cond else '2509'} (flow matching, true CFG, instruction "
                f"edits with 1 to {REFERENCES} input images)")

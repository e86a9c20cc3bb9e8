"""Z-Image txt2img and img2img on ONNX Runtime (no torch), as diffusers' ``ZImagePipeline`` and
``ZImageImg2ImgPipeline`` (0.42) do it, on the flow-matching base (engines/pipelines/flow.py). The folder is the
layout engines/build/zimage.py writes (its docstring has the transformer's fixed-size inputs).

1. Text: each prompt in Qwen3's chat template (``TEMPLATE``: one user turn, the assistant's turn opened, thinking
   enabled), truncated with the template to ``max_sequence_length`` (512) tokens as the tokenizer truncates it; the
   Qwen3 model's second-to-last hidden states of the prompt's tokens. Rows are zero-padded to that length with a
   mask marking the prompt's tokens: the transformer rounds each up to a multiple of 32 as diffusers pads a caption
   (engines/build/zimage.py), and a fixed length lets the rows of any requests share a transformer call.
2. Latents: 16 channels, unpacked (the transformer patchifies 2x2 itself); the schedule is ``linspace(1, 1/steps)``
   in float32 (``get_default_z_image_sigmas``) shifted by the scheduler (a static shift: 3 for Turbo).
3. Transformer: the scheduler's timestep ``t`` as it is (``TIMESTEP_SCALE`` 1: the graph computes
   ``(1000 - t) / 1000``), the size's token tables (``image_tables``, ``text_tables``), the negated prediction out.
4. CFG where ``guidance_scale > 0`` (diffusers' ``do_classifier_free_guidance``): ``pos + g (pos - neg)``, which is
   the base's ``neg + w (pos - neg)`` with ``w = g + 1``; ``cfg_normalization`` off and ``cfg_truncation`` 1 (the
   pipeline's defaults: no step is cut). Turbo runs with guidance 0: one row per image.
5. Decode: ``latents / scaling + shift`` through the VAE (the base's).
6. img2img: the base's (engines/pipelines/flow_edits.py), as ``ZImageImg2ImgPipeline`` does it: the VAE sample
   ``(x - shift) * scaling`` noised to the first kept step's sigma, ``int(steps - steps * strength)`` steps cut from
   this schedule; no hook differs (tests/integration/test_zimage_img2img_parity.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engines.errors import ModelLoadError
from engines.lora.active import Adapters
from engines.numerics.flow_graph import flow_coefficients
from engines.numerics.flow_schedule import FlowSchedule, flow_schedule
from engines.numerics.qwen_tokenizer import load_unpadded
from engines.pipelines.flow import DitConditioning, FlowPipeline, run
from engines.pipelines.ort_model import OrtModel
from engines.types.request import Batch

TEMPLATE = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
"""What ``apply_chat_template([{"role": "user", ...}], add_generation_prompt=True, enable_thinking=True)`` gives
with Qwen3's template."""
SEQ_MULTI_OF = 32
ROPE_THETA = 256.0


def _angles(positions: np.ndarray, dim: int, theta: float) -> np.ndarray:
    """RopeEmbedder's angles: float64 frequencies and products, rounded to float32 (``precompute_freqs_cis``)."""
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    return np.outer(positions.astype(np.float64), freqs).astype(np.float32)


def _tables(positions: np.ndarray, axes: list[int], theta: float) -> tuple[np.ndarray, np.ndarray]:
    angles = np.concatenate([_angles(positions[:, i], d, theta) for i, d in enumerate(axes)], axis=1)
    return np.repeat(np.cos(angles), 2, axis=1), np.repeat(np.sin(angles), 2, axis=1)


def image_tables(h: int, w: int, axes: list[int], theta: float = ROPE_THETA) -> tuple[np.ndarray, ...]:
    """(image_index int64, image_pad, rope cos, rope sin) over latents h x w's 2x2 tokens padded to a multiple of
    32: the index of each padded token's source (the last real one for padding), 1 at padding, and the rotary tables
    of positions (0, row, col) (padding (0, 0, 0)); the transformer sets the first axis per row."""
    rows, cols = h // 2, w // 2
    n = rows * cols
    total = n + (-n) % SEQ_MULTI_OF
    positions = np.zeros((total, 3), np.int64)
    positions[:n, 1], positions[:n, 2] = np.repeat(np.arange(rows), cols), np.tile(np.arange(cols), rows)
    index = np.minimum(np.arange(total), n - 1).astype(np.int64)
    pad = (np.arange(total) >= n).astype(np.float32)
    cos, sin = _tables(positions, axes, theta)
    return index, pad, cos, sin


def text_tables(tokens: int, axes: list[int], theta: float = ROPE_THETA) -> tuple[np.ndarray, np.ndarray]:
    """Rotary tables of caption positions (1 + j, 0, 0)."""
    positions = np.zeros((tokens, 3), np.int64)
    positions[:, 0] = np.arange(1, tokens + 1)
    return _tables(positions, axes, theta)


def default_sigmas(steps: int) -> np.ndarray:
    """``torch.linspace(1.0, 1 / steps, steps)`` in float32 as torch's CPU kernel computes it (from the start for the
    first half, from the end for the rest, each a fused multiply-add)."""
    start, end = np.float32(1.0), np.float32(1.0 / steps)
    if steps == 1:
        return np.array([start], np.float32)
    step = (end - start) / np.float32(steps - 1)
    i = np.arange(steps)
    half = steps // 2
    fused = np.float64  # torch's kernel fuses the multiply-add: one rounding, as a float64 product and sum give
    return np.where(i < half, fused(start) + fused(step) * i,
                    fused(end) - fused(step) * (steps - i - 1)).astype(np.float32)


class ZImageTokenizer:
    """Prompts -> templated, right-padded ids, each row's length and whether it was cut."""

    def __init__(self, folder: Path) -> None:
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{folder} has no tokenizer.json (`sdserve engines export` writes it)")
        self._tok, self.pad_id = load_unpadded(path, "Qwen3", f"in {folder}")

    def __call__(self, prompts: list[str], limit: int) -> tuple[np.ndarray, list[int], tuple[bool, ...]]:
        encodings = self._tok.encode_batch([TEMPLATE.format(p) for p in prompts])
        lengths = [min(len(e.ids), limit) for e in encodings]
        ids = np.full((len(prompts), max(lengths)), self.pad_id, dtype=np.int64)
        for row, enc, n in zip(ids, encodings, lengths, strict=True):
            row[:n] = enc.ids[:n]
        return ids, lengths, tuple(len(e.ids) > limit for e in encodings)


class ZImagePipeline(FlowPipeline):
    """Z-Image (Turbo and base) txt2img and img2img: a Qwen3 text encoder, the single-stream transformer, CFG as
    ``pos + g (pos - neg)`` when the guidance is above 0."""

    TIMESTEP_SCALE = 1.0
    """The transformer graph takes the scheduler's ``t`` and computes ``(1000 - t) / 1000`` itself."""
    FIRST_BLOCK = False
    """The first-block cache's parts are not exported for Z-Image."""

    def load_text(self, folder: Path, models: dict[str, OrtModel]) -> None:
        self.text_encoder, self.tokenizer = models["text_encoder"], ZImageTokenizer(folder / "tokenizer")
        self.text_encoders.append(self.text_encoder)

    def schedule(self, steps: int, h: int, w: int) -> FlowSchedule:
        mu = self.flow.mu((h // 2) * (w // 2)) if self.flow.use_dynamic_shifting else None
        return flow_schedule(self.flow, steps, sigmas=default_sigmas(steps), mu=mu)

    def encode(self, batch: Batch, length: int, cfg: bool, adapters: Adapters | None) -> DitConditioning:
        """The prompts' states zero-padded to the fixed length, with the mask of their tokens."""
        negatives = [s.negative_prompt for s in batch.images] if cfg else []
        k = len(negatives)
        ids, lengths, cut = self.tokenizer(negatives + [s.prompt for s in batch.images], length)
        ids = self.checked_tokens(batch, "text encoder (max_sequence_length)", ids, cut, length, k)
        hidden = run(self.text_encoder, {"input_ids": ids}, ["prompt_embeds"], adapters)[0]
        states = np.zeros((len(ids), length, hidden.shape[-1]), dtype=np.float32)
        mask = np.zeros((len(ids), length), dtype=np.float32)
        for row, kept in enumerate(lengths):
            states[row, :kept] = hidden[row, :kept]
            mask[row, :kept] = 1.0
        return DitConditioning(states, None, cut[k:], cut[:k] if cfg else (False,) * len(batch.images), mask)

    def position_feeds(self, cond: DitConditioning, h: int, w: int) -> dict[str, np.ndarray]:
        axes = [int(a) for a in self.config.get("axes_dims", (32, 48, 48))]
        theta = float(self.config.get("rope_theta", ROPE_THETA))
        index, pad, cos, sin = image_tables(h, w, axes, theta)
        text_cos, text_sin = text_tables(cond.states.shape[1], axes, theta)
        return {"image_index": index, "image_pad": pad, "image_rope_cos": cos, "image_rope_sin": sin,
                "text_rope_cos": text_cos, "text_rope_sin": text_sin}

    def uses_cfg(self, guidance: np.ndarray) -> bool:
        """diffusers' ``do_classifier_free_guidance``: a guidance scale above 0."""
        return self.family.cfg and bool((guidance > 0.0).any())

    def coefficients(self, sigma: float, sigma_next: float, guidance: np.ndarray, cfg: bool) -> np.ndarray:
        """``pos + g (pos - neg)`` is the base's combination with weight ``g + 1`` (1: the positive alone)."""
        return flow_coefficients(sigma, sigma_next, guidance + 1.0 if cfg else guidance, cfg)

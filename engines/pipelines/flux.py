"""Flux.1 (dev and schnell) on the flow-matching base, as diffusers' FluxPipeline (0.42) does it.

- Text: CLIP-L's pooled output and T5's states (``max_sequence_length``: dev 512, schnell 256); no negative prompt
  (as diffusers without ``true_cfg_scale``, and Forge/ComfyUI's Flux defaults), no classifier-free guidance.
- Latents: 16 channels packed 2x2 into 64-channel tokens (its registry row's ``packed``) with position ids (``img_ids``:
  (0, row, col); ``txt_ids``: zeros), whose rotary tables are computed here in float64 and fed in fp32.
- Guidance: dev takes the guidance scale as a transformer input (``guidance``), schnell has none.
- Schedule: evenly spaced sigmas, shifted by ``mu`` of the packed token count when the config asks; the timestep
  goes in as ``t / 1000``. Decode: ``latents / scaling_factor + shift_factor``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from engines.lora.active import Adapters
from engines.numerics.flow_schedule import FlowSchedule, flow_schedule, flux_sigmas
from engines.numerics.t5_tokenizer import T5Tokenizer
from engines.numerics.tokenizer import ClipTokenizer
from engines.pipelines import controlnet_dit
from engines.pipelines.contract import Begun
from engines.pipelines.flow import DitConditioning, DitDenoising, FlowPipeline, run
from engines.pipelines.ort_model import OrtModel
from engines.types.request import Batch

ROPE_THETA = 10000.0
"""FluxTransformer2DModel's rotary base (FluxPosEmbed(theta=10000))."""


def flux_rope(ids: np.ndarray, axes_dim: Sequence[int], theta: float = ROPE_THETA) -> tuple[np.ndarray, np.ndarray]:
    """Rotary (cos, sin) tables [tokens, sum(axes_dim)] for position ids [tokens, axes]: per axis, angles
    ``pos * theta^(-2i/dim)`` in float64, each value repeated twice (interleaved pairs), cast to float32."""
    cos, sin = [], []
    pos = ids.astype(np.float32).astype(np.float64)
    for axis, dim in enumerate(axes_dim):
        freqs = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
        angles = np.outer(pos[:, axis], freqs)
        cos.append(np.repeat(np.cos(angles), 2, axis=1).astype(np.float32))
        sin.append(np.repeat(np.sin(angles), 2, axis=1).astype(np.float32))
    return np.concatenate(cos, axis=-1), np.concatenate(sin, axis=-1)


def image_ids(grid_h: int, grid_w: int) -> np.ndarray:
    """Flux's ``img_ids``: (0, row, col) for each packed latent token, row-major, float32 [h*w, 3]."""
    ids = np.zeros((grid_h, grid_w, 3), dtype=np.float32)
    ids[..., 1] = np.arange(grid_h, dtype=np.float32)[:, None]
    ids[..., 2] = np.arange(grid_w, dtype=np.float32)[None, :]
    return ids.reshape(grid_h * grid_w, 3)


class FluxPipeline(FlowPipeline):
    """Flux.1 dev (guidance embedded) and schnell (timestep-distilled)."""

    def load_text(self, folder: Path, models: dict[str, OrtModel]) -> None:
        self.clip_tokenizer, self.clip = ClipTokenizer(folder / "tokenizer"), models["text_encoder"]
        self.t5, self.t5_tokenizer = models["text_encoder_2"], T5Tokenizer(folder / "tokenizer_2")
        self.text_encoders += [self.t5, self.clip]
        self.max_sequence_length = min(self.family.max_sequence_length, self.t5_tokenizer.model_max_length)

    def prompt_tokens(self) -> int:
        return self.clip_tokenizer.max_length

    def encode(self, batch: Batch, length: int, cfg: bool, adapters: Adapters | None) -> DitConditioning:
        """CLIP-L's pooled output and T5's states of each prompt (the negative prompt is not used)."""
        prompts = [s.prompt for s in batch.images]
        tokens = self.clip_tokenizer(prompts)
        ids = self.checked_tokens(batch, "CLIP text encoder", tokens.ids, tokens.truncated,
                                  self.clip_tokenizer.max_length)
        pooled = run(self.clip, {next(iter(self.clip.inputs)): ids}, ["pooler_output"], adapters)[0]
        t5 = self.t5_tokenizer(prompts, length)
        t5_ids = self.checked_tokens(batch, "T5 encoder (max_sequence_length)", t5.ids, t5.truncated, length)
        states = run(self.t5, {next(iter(self.t5.inputs)): t5_ids}, ["last_hidden_state"], adapters)[0]
        cut = tuple(a or b for a, b in zip(tokens.truncated, t5.truncated, strict=True))
        return DitConditioning(states, pooled, cut, (False,) * len(prompts))

    controls: controlnet_dit.FluxControlNets | None = None
    """The ControlNets served with this model (controlnet_dit.attach), None without."""

    def begin(self, batch: Batch, latents: np.ndarray | None = None, adapters: Adapters | None = None,
              max_sequence_length: int | None = None) -> Begun:
        """The flow pipeline's begin, and the request's ControlNet units (engines/pipelines/controlnet_dit.py)."""
        begun = super().begin(batch, latents, adapters, max_sequence_length)
        controlnet_dit.start(self, batch, begun.state)
        return begun

    def run_denoiser(self, states: Sequence[DitDenoising]) -> None:
        """Controlled states run their ControlNets and the residual transformer; the others join as before."""
        plain = controlnet_dit.run_controlled(self, states) if self.controls is not None else list(states)
        if plain:
            super().run_denoiser(plain)

    def schedule(self, steps: int, h: int, w: int) -> FlowSchedule:
        """Evenly spaced sigmas, shifted by ``mu`` of the packed token count when the config says."""
        return flow_schedule(self.flow, steps, sigmas=flux_sigmas(steps), mu=self.flow.mu((h // 2) * (w // 2)))

    def position_feeds(self, cond: DitConditioning, h: int, w: int) -> dict[str, np.ndarray]:
        """The rope tables for this size: text tokens (ids zero) first, then the packed image tokens."""
        ids = np.concatenate([np.zeros((cond.states.shape[1], 3), np.float32), image_ids(h // 2, w // 2)])
        cos, sin = flux_rope(ids, self.axes_dim)
        return {"rope_cos": cos, "rope_sin": sin}

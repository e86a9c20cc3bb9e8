"""FLUX.2 [klein] txt2img on ONNX Runtime (no torch), as diffusers' ``Flux2KleinPipeline`` (0.42) does it, on the
flow-matching base (engines/pipelines/flow.py). The folder is the layout engines/build/flux2.py writes.

1. Text: each prompt in Qwen3's chat template (one user turn, the assistant's turn opened with thinking disabled:
   ``TEMPLATE``), right-padded with ``<|endoftext|>`` to ``max_sequence_length`` (512) with an attention mask, and
   cut there (diffusers' ``padding="max_length", truncation=True``); the exported encoder stacks the hidden states
   of layers 9, 18 and 27 per token. Every position goes to the transformer, padding included (unmasked), so the
   text sequence has a fixed length and the rows of any requests share a transformer call.
2. Latents: the VAE's 32 channels 2×2-patchified into 128 (its batch-norm layout) at 1/16 of the image side; the
   transformer flattens them into tokens inside its graph, so the loop runs them unpacked ([B, 128, h, w]). Noise
   is drawn in that shape, as diffusers draws it.
3. Schedule: sigmas from 1 to 1/steps, shifted by the empirical ``mu`` of the token count and the step count
   (``empirical_mu``: ``compute_empirical_mu``); timestep ``t / 1000``; no guidance embedding.
4. Rotary tables from the position ids (T, H, W, L): text (0, 0, 0, l), image (0, row, col, 0), in float64 as
   ``Flux2PosEmbed`` computes them (theta from the config, 2000).
5. CFG: the base checkpoints (``is_distilled`` false) run ``neg + s (cond - neg)`` for a guidance scale above 1, the
   negative prompt empty by default (diffusers always uses ""); the distilled ones never do (diffusers ignores the
   scale). Decode: the VAE decoder undoes the batch norm and unpatchifies itself (folded in at export).

Input images: ``Flux2KleinPipeline`` takes them as reference tokens (instruction edits, engines/pipelines/
flux2_refs.py, 1 to 4 images); a folder exported with its ``vae_encoder/`` serves those edits and img2img.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engines.lora.active import Adapters
from engines.numerics.flow_schedule import FlowSchedule, flow_schedule, flux_sigmas
from engines.numerics.qwen_tokenizer import load_unpadded
from engines.pipelines.flow import DitConditioning, FlowPipeline, Geometry, run
from engines.pipelines.flux import flux_rope
from engines.pipelines.flux2_refs import Flux2References
from engines.pipelines.ort_model import OrtModel
from engines.pipelines.unet_family import read_json
from engines.types.request import Batch

TEMPLATE = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
"""What ``apply_chat_template([{"role": "user", ...}], add_generation_prompt=True, enable_thinking=False)`` gives."""
TEMPLATE_TOKENS = 12
"""The template's own tokens in the released vocabulary (a prompt may use the rest of the length)."""


def empirical_mu(image_seq_len: int, steps: int) -> float:
    """``compute_empirical_mu``: the shift of FLUX.2's schedule, a line in the step count between its fits at 10
    and 200 steps (the 200-step fit alone past 4300 tokens)."""
    a1, b1 = 8.73809524e-05, 1.89833333
    a2, b2 = 0.00016927, 0.45666666
    if image_seq_len > 4300:
        return float(a2 * image_seq_len + b2)
    m_200, m_10 = a2 * image_seq_len + b2, a1 * image_seq_len + b1
    a = (m_200 - m_10) / 190.0
    return float(a * steps + (m_200 - 200.0 * a))


def position_ids(text: int, grid_h: int, grid_w: int) -> np.ndarray:
    """[text + h·w, 4] ids: the text's (0, 0, 0, l), then the latent tokens' (0, row, col, 0), row-major."""
    words = np.zeros((text, 4), np.float32)
    words[:, 3] = np.arange(text)
    image = np.zeros((grid_h, grid_w, 4), np.float32)
    image[..., 1] = np.arange(grid_h)[:, None]
    image[..., 2] = np.arange(grid_w)[None, :]
    return np.concatenate([words, image.reshape(-1, 4)])


class Flux2Pipeline(Flux2References, FlowPipeline):
    """FLUX.2 [klein] (distilled and base): Qwen3's stacked states, a fixed-length unmasked text sequence."""

    FIRST_BLOCK = False
    """The first-block cache's parts are not exported for FLUX.2."""

    def load_text(self, folder: Path, models: dict[str, OrtModel]) -> None:
        path = folder / "tokenizer" / "tokenizer.json"
        self.tokenizer, self.pad_id = load_unpadded(path, "Qwen3", path)
        self.text_encoder = models["text_encoder"]
        self.text_encoders.append(self.text_encoder)
        self.distilled = bool(read_json(folder / "model_index.json").get("is_distilled", False))
        """The step-distilled checkpoints: no CFG whatever the guidance scale (diffusers ignores it)."""

    def prompt_tokens(self) -> int:
        return self.max_sequence_length - TEMPLATE_TOKENS

    def read_geometry(self, folder: Path) -> Geometry:
        """AutoencoderKLFlux2: scale 2^(levels-1), its latents 2×2-patchified (4 × ``latent_channels``, one more
        2x); the batch norm is folded into the exported decoder, so the decode graph scales by 1."""
        vae = read_json(folder / "vae_decoder" / "config.json")
        scale = 2 ** (len(vae.get("block_out_channels", [0] * 4)) - 1) * 2
        return Geometry(scale, 4 * int(vae.get("latent_channels", 32)), 1.0, 0.0, scale)

    def patch_size(self) -> int:
        return 1

    def schedule(self, steps: int, h: int, w: int) -> FlowSchedule:
        return flow_schedule(self.flow, steps, sigmas=flux_sigmas(steps), mu=empirical_mu(h * w, steps))

    def uses_cfg(self, guidance: np.ndarray) -> bool:
        return not self.distilled and bool((guidance > 1.0).any())

    def describe(self) -> str:
        return f"{self.family.name} (flow matching, " + ("step-distilled: no guidance)" if self.distilled else
                                                         "classifier-free guidance)")

    def encode(self, batch: Batch, length: int, cfg: bool, adapters: Adapters | None) -> DitConditioning:
        """The stacked states of each templated prompt at the fixed length (negatives first under CFG)."""
        negatives = [s.negative_prompt for s in batch.images] if cfg else []
        k = len(negatives)
        encodings = self.tokenizer.encode_batch([TEMPLATE.format(p) for p in negatives + [s.prompt for s in
                                                                                           batch.images]])
        ids = np.full((len(encodings), length), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(encodings), length), dtype=np.int64)
        for row, enc in enumerate(encodings):
            n = min(len(enc.ids), length)
            ids[row, :n], mask[row, :n] = enc.ids[:n], 1
        cut = tuple(len(e.ids) > length for e in encodings)
        self.checked_tokens(batch, "text encoder (max_sequence_length)", ids, cut, length, k)
        states = run(self.text_encoder, {"input_ids": ids, "attention_mask": mask}, ["prompt_embeds"], adapters)[0]
        return DitConditioning(states, None, cut[k:], cut[:k] if cfg else (False,) * len(batch.images))

    def position_feeds(self, cond: DitConditioning, h: int, w: int) -> dict[str, np.ndarray]:
        """The rotary tables of this size over the joint sequence (text then image tokens)."""
        theta = float(self.config.get("rope_theta", 2000))
        cos, sin = flux_rope(position_ids(cond.states.shape[1], h, w), self.axes_dim, theta)
        return {"rope_cos": cos, "rope_sin": sin}

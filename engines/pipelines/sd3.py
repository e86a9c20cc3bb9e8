"""Stable Diffusion 3 / 3.5 on the flow-matching base, as diffusers' StableDiffusion3Pipeline (0.42) does it.

- Text: CLIP-L and CLIP-G penultimate states side by side, zero-padded to the T5 width, then the T5 states after
  them on the sequence axis; the two pooled projections concatenated.
- Classifier-free guidance with a negative prompt (rows [negatives..., prompts...]).
- Latents: [B, 16, H, W], patched inside the transformer (``patch_size``), the timestep as ``t``; the scheduler's
  own spacing with its static shift. Decode: ``latents / scaling_factor + shift_factor``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engines.errors import InferenceError
from engines.lora.active import Adapters
from engines.numerics.t5_tokenizer import T5Tokenizer
from engines.numerics.tokenizer import ClipTokenizer
from engines.pipelines.flow import DitConditioning, FlowPipeline, run
from engines.pipelines.ort_model import OrtModel
from engines.types.request import Batch


class SD3Pipeline(FlowPipeline):
    """SD 3 and SD 3.5 (QK norm, dual attention: the same inputs)."""

    TIMESTEP_SCALE = 1.0

    def load_text(self, folder: Path, models: dict[str, OrtModel]) -> None:
        self.clips = [(ClipTokenizer(folder / "tokenizer"), models["text_encoder"]),
                      (ClipTokenizer(folder / "tokenizer_2"), models["text_encoder_2"])]
        self.t5, self.t5_tokenizer = models["text_encoder_3"], T5Tokenizer(folder / "tokenizer_3")
        self.text_encoders += [self.t5, *(model for _, model in self.clips)]
        self.max_sequence_length = min(self.family.max_sequence_length, self.t5_tokenizer.model_max_length)

    def prompt_tokens(self) -> int:
        return self.clips[0][0].max_length

    def text_tokens(self) -> int:
        """CLIP's tokens, then T5's, on the sequence axis."""
        return self.max_sequence_length + self.clips[0][0].max_length

    def patch_size(self) -> int:
        return int(self.config.get("patch_size", 2))

    def native_size(self) -> int:
        """The transformer's ``sample_size`` × the VAE factor (128 × 8 = 1024 for the released models)."""
        sample = self.config.get("sample_size")
        return int(sample) * self.geometry.vae_scale_factor if sample else 1024

    def encode(self, batch: Batch, length: int, cfg: bool, adapters: Adapters | None) -> DitConditioning:
        n = len(batch.images)
        negatives = [s.negative_prompt for s in batch.images] if cfg else []
        prompts = negatives + [s.prompt for s in batch.images]
        k = len(negatives)
        states, pooled, cut = [], [], [False] * len(prompts)
        for tokenizer, model in self.clips:
            tokens = tokenizer(prompts)
            ids = self.checked_tokens(batch, "CLIP text encoder", tokens.ids, tokens.truncated, tokenizer.max_length,
                                      k)
            penultimate = next(o for o in model.outputs if o.startswith("hidden_states."))
            embeds, hidden = run(model, {next(iter(model.inputs)): ids}, ["text_embeds", penultimate], adapters)
            states.append(hidden)
            pooled.append(embeds)
            cut = [a or b for a, b in zip(cut, tokens.truncated, strict=True)]
        t5 = self.t5_tokenizer(prompts, length)
        t5_ids = self.checked_tokens(batch, "T5 encoder (max_sequence_length)", t5.ids, t5.truncated, length, k)
        t5_states = run(self.t5, {next(iter(self.t5.inputs)): t5_ids}, ["last_hidden_state"], adapters)[0]
        clip = np.concatenate(states, axis=-1)
        width = t5_states.shape[-1]
        if clip.shape[-1] > width:
            raise InferenceError(f"CLIP states ({clip.shape[-1]}) are wider than the T5's ({width})")
        clip = np.pad(clip, ((0, 0), (0, 0), (0, width - clip.shape[-1])))
        cut = [a or b for a, b in zip(cut, t5.truncated, strict=True)]
        return DitConditioning(np.concatenate([clip, t5_states], axis=1), np.concatenate(pooled, axis=-1),
                               tuple(cut[k:]), tuple(cut[:k]) if cfg else (False,) * n)



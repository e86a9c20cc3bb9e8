"""FLUX.1 Kontext [dev]: instruction edits on the Flux.1 pipeline, as diffusers' FluxKontextPipeline (0.42) does them.

The transformer is Flux.1's (FluxTransformer2DModel, guidance embedded: the guidance scale is an input, no CFG),
the text is Flux.1's (CLIP-L pooled + T5 states) and the schedule is Flux.1's (``mu`` of the noisy tokens only).
What Kontext adds is the reference image (engines/types/request.py ``EditImage.references``: one per edit, as
diffusers' pipeline takes one):

- it is resized (Lanczos, as diffusers' VaeImageProcessor) to the entry of ``PREFERRED_KONTEXT_RESOLUTIONS`` whose
  aspect is nearest its own (its sides first floored to the multiple of 16: ``get_default_height_width``), each side
  floored to the multiple of 16 (``_auto_resize``);
- the VAE encoder's mode (``sample_mode="argmax"``: the mean, no noise drawn), ``(mean - shift) * scaling``,
  2×2-packed: these tokens go after the noisy ones in every transformer call (engines/pipelines/flow_extra.py), with
  the position ids ``(1, row, col)`` (the noisy tokens' are ``(0, row, col)``), and their output is dropped;
- the denoising starts from noise, as txt2img (no strength).

The output size: the request's, or ``kontext_size`` (diffusers' rule where no size is given: the default square
rescaled to ``max_area``, whatever the input's size).
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import numpy as np
from PIL import Image

from engines.errors import InvalidRequestError
from engines.pipelines.flow import DitConditioning, pack_latents, run
from engines.pipelines.flow_edits import ReferenceEdits
from engines.pipelines.flow_extra import ExtraTokens
from engines.pipelines.flux import FluxPipeline, flux_rope, image_ids
from engines.types.model import ModelInfo
from engines.types.request import Batch

PREFERRED_KONTEXT_RESOLUTIONS = (
    (672, 1568), (688, 1504), (720, 1456), (752, 1392), (800, 1328), (832, 1248), (880, 1184), (944, 1104),
    (1024, 1024), (1104, 944), (1184, 880), (1248, 832), (1328, 800), (1392, 752), (1456, 720), (1504, 688),
    (1568, 672))
"""(width, height) Kontext was trained at: diffusers' table (pipeline_flux_kontext.py)."""
MAX_AREA = 1024 ** 2
"""FluxKontextPipeline's ``max_area`` default: the output's pixel count."""
REFERENCES = 1
"""Input images one edit takes: FluxKontextPipeline 0.42 takes one (a list is a batch of prompts' images)."""


def reference_size(width: int, height: int, multiple: int) -> tuple[int, int]:
    """The (width, height) an input image is resized to: the preferred resolution nearest its aspect (its sides
    floored to ``multiple`` first), floored to ``multiple``; ties go to the first entry, as Python's ``min``."""
    w, h = width - width % multiple, height - height % multiple
    if w <= 0 or h <= 0:
        raise InvalidRequestError(f"the input image ({width}x{height}) is smaller than {multiple} pixels a side",
                                  param="image")
    aspect = w / h
    _, w, h = min((abs(aspect - pw / ph), pw, ph) for pw, ph in PREFERRED_KONTEXT_RESOLUTIONS)
    return w // multiple * multiple, h // multiple * multiple


def reference_sizes(sizes: tuple[tuple[int, int], ...], multiple: int = 16) -> tuple[tuple[int, int], ...]:
    """Every input image's ``reference_size``: what admission charges an edit's reference tokens by
    (ModelInfo.instruct_references)."""
    return tuple(reference_size(w, h, multiple) for w, h in sizes)


def kontext_size(sizes: tuple[tuple[int, int], ...], multiple: int = 16, default: int = 1024,
                 max_area: int = MAX_AREA) -> tuple[int, int]:
    """diffusers' output (width, height) when a call names no size: the default square (``default_sample_size`` ×
    the VAE factor) rescaled to ``max_area`` at its aspect and floored to ``multiple``. The input images' sizes do
    not enter it (``sizes`` is the ModelInfo.instruct_size signature)."""
    aspect = default / default
    width, height = round((max_area * aspect) ** 0.5), round((max_area / aspect) ** 0.5)
    return width // multiple * multiple, height // multiple * multiple


def reference_pixels(image: np.ndarray, width: int, height: int) -> np.ndarray:
    """uint8 [h, w, 3] -> float32 [3, height, width] in [-1, 1], resized with Lanczos (the same size: a copy)."""
    resized = Image.fromarray(np.ascontiguousarray(image[..., :3])).resize((width, height), Image.Resampling.LANCZOS)
    pixels = np.asarray(resized, dtype=np.float32) / 255.0
    return (pixels * 2.0 - 1.0).transpose(2, 0, 1)


class KontextPipeline(ReferenceEdits, FluxPipeline):
    """FLUX.1 Kontext [dev]: Flux.1 dev with the reference image's latents beside the noisy ones."""

    FIRST_BLOCK = False
    """The first-block cache's parts are not served with reference tokens (flow.py refuses the pair)."""

    def _reference_sizes(self, batch: Batch) -> list[tuple[int, int]]:
        sizes = []
        for spec in batch.images:
            refs = spec.edit.references if spec.edit is not None else ()
            if len(refs) != REFERENCES:
                raise InvalidRequestError(f"FLUX.1 Kontext takes {REFERENCES} input image per edit, not {len(refs)}",
                                          param="image")
            sizes.append(reference_size(refs[0].shape[1], refs[0].shape[0], self.size_multiple))
        if len(set(sizes)) > 1:
            raise InvalidRequestError("the input images of one batch must resize to one Kontext resolution "
                                      f"(they give {sorted(set(sizes))})", param="image")
        return sizes

    def extra_tokens(self, batch: Batch) -> ExtraTokens | None:
        """The reference images' packed latents (the VAE's mean, scaled) and their ids ``(1, row, col)``."""
        editor = self.reference_encoder(batch)
        if editor is None:
            return None
        width, height = self._reference_sizes(batch)[0]
        refs = [spec.edit.references[0] for spec in batch.images if spec.edit is not None]
        distinct = list({id(ref): ref for ref in refs}.values())  # a request's images share its input: encoded once
        pixels = np.stack([reference_pixels(ref, width, height) for ref in distinct])
        encoder = editor.encoder
        moments = run(encoder, {next(iter(encoder.inputs)): pixels}, [editor.moments_output], None)[0].astype(
            np.float32)
        g = self.geometry
        mean = moments[:, :g.latent_channels]  # DiagonalGaussianDistribution's mode
        latents = (mean - np.float32(g.shift_factor)) * np.float32(g.scaling_factor)
        ids = image_ids(latents.shape[2] // 2, latents.shape[3] // 2)
        ids[:, 0] = 1.0
        row = {id(ref): k for k, ref in enumerate(distinct)}
        return ExtraTokens(pack_latents(latents)[[row[id(ref)] for ref in refs]], ids)

    def position_feeds(self, cond: DitConditioning, h: int, w: int) -> dict[str, np.ndarray]:
        """Flux.1's tables with the reference tokens' ids after the noisy tokens'."""
        noisy = image_ids(h // 2, w // 2)
        ids = np.concatenate([np.zeros((cond.states.shape[1], 3), np.float32),
                              cond.extra.positions(noisy) if cond.extra is not None else noisy])
        cos, sin = flux_rope(ids, self.axes_dim)
        return {"rope_cos": cos, "rope_sin": sin}

    def model_info(self, name: str, digest: str = "") -> ModelInfo:
        info = super().model_info(name, digest)
        if self.editor is None:
            return info
        return replace(info, modes=(*info.modes, "instruct"), instruct_images=REFERENCES,
                       instruct_size=partial(kontext_size, multiple=self.size_multiple),
                       instruct_references=partial(reference_sizes, multiple=self.size_multiple))

    def describe(self) -> str:
        return "FLUX.1 Kontext (flow matching, guidance embedded, instruction edits with one input image)"

"""img2img for the flow-matching DiT families, on the device, as diffusers' FluxImg2ImgPipeline and
StableDiffusion3Img2ImgPipeline (0.42) do it:

- the init image (uint8 -> [-1, 1], engines/pipelines/unet_edits.py ``edit_inputs``) goes up once; the VAE encoder gives
  the latent distribution's moments and the latents are sampled with the image's own stream
  (``mean + exp(0.5 * clamp(logvar, -30, 20)) * eps``, edits.py ``build_sample_graph``);
- the model's latents are ``(sample - shift_factor) * scaling_factor``, noised to the first step's level by the
  flow scheduler's ``scale_noise`` (``sigma * noise + (1 - sigma) * latents``), then 2×2-packed for Flux
  (flow_graph.py ``build_flow_noise_graph``);
- ``strength`` picks the first step as those pipelines' ``get_timesteps``: ``int(steps - steps * strength)``
  (flow_graph.py ``flow_start``).

Per image the seeded stream gives the start noise first (as txt2img), then the encoder's sample noise. Inpainting
is not served for the DiT families (a mask is refused by name).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnxruntime as ort

from engines.errors import InvalidRequestError
from engines.numerics.flow_graph import build_flow_noise_graph
from engines.numerics.rows import shape_feed
from engines.pipelines.ort_model import OrtModel
from engines.pipelines.unet_edits import ENCODER_OUTPUT, build_sample_graph, edit_inputs
from engines.runtime.sessions import Runtime
from engines.types.request import Batch

STATE = np.float32


class DitEditor:
    """The VAE encoder and the edit graphs of one DiT pipeline, every session created at load."""

    def __init__(self, runtime: Runtime, encoder: OrtModel, make: Callable[[bytes, str], OrtModel], scaling: float,
                 shift: float, model_in: type[np.generic], packed: bool) -> None:
        self.runtime, self.encoder, self.packed, self.model_in = runtime, encoder, packed, model_in
        self.sample = make(build_sample_graph(encoder.output_dtype(), 1.0), "dit_latent_sample")
        self.noise = {copies: make(build_flow_noise_graph(scaling, shift, model_in, copies, packed),
                                   f"flow_noise{copies}") for copies in (1, 2)}

    @property
    def moments_output(self) -> str:
        """The encoder output holding the latent distribution's moments (mean, then log-variance)."""
        return ENCODER_OUTPUT if ENCODER_OUTPUT in self.encoder.outputs else self.encoder.outputs[0]

    def _encode(self, batch: Batch, rngs: list[np.random.Generator], shape: tuple[int, ...]) -> ort.OrtValue:
        """The VAE sample of each init image (unscaled), drawn with the image's stream, on the device."""
        name = next(iter(self.encoder.inputs))
        pixels = edit_inputs(batch, False).pixels
        pix = self.runtime.upload("dit_edit_pixels", pixels.astype(self.encoder.input_dtype(name)))
        out = self.moments_output
        moments = self.runtime.buffer("dit_edit_moments", (shape[0], 2 * shape[1], *shape[2:]),
                                      self.encoder.output_dtype())
        self.encoder.run({name: pix}, {out: moments})
        eps = np.stack([r.standard_normal(shape[1:], dtype=STATE) for r in rngs])
        sample = self.runtime.buffer("dit_edit_sample", shape, STATE)
        self.sample.run({"moments": moments, "eps": eps}, {"latents": sample})
        return sample

    def prepare(self, batch: Batch, noise: np.ndarray, rngs: list[np.random.Generator], sigma: float,
                copies: int) -> tuple[ort.OrtValue, ort.OrtValue]:
        """(start latents float32, first transformer input) of an img2img batch: ``noise`` [B,C,h,w] is the start
        noise already drawn from ``rngs``; ``sigma`` the first step's noise level."""
        shape = tuple(noise.shape)
        n, c, h, w = shape
        sample = self._encode(batch, rngs, shape)
        feeds: dict[str, ort.OrtValue | np.ndarray] = {
            "sample": sample, "noise": self.runtime.upload("dit_edit_noise", noise.astype(STATE)),
            "sigma": self.runtime.upload("dit_edit_sigma", np.array([sigma], dtype=STATE))}
        out_shape: tuple[int, ...] = shape
        if self.packed:
            out_shape = (n, (h // 2) * (w // 2), 4 * c)
            feeds["patch_shape"] = shape_feed([n, c, h // 2, 2, w // 2, 2])
            feeds["token_shape"] = shape_feed(out_shape)
        start = self.runtime.buffer("dit_latents0", out_shape, STATE)
        model_in = self.runtime.buffer("dit_in", (copies * n, *out_shape[1:]), self.model_in)
        self.noise[copies].run(feeds, {"next": start, "model_in": model_in})
        return start, model_in


class ReferenceEdits:
    """The instruction-edit checks of a flow pipeline that reads its input images as extra tokens (FLUX.1 Kontext:
    kontext.py, FLUX.2: flux2_refs.py). Listed before the pipeline's base class, whose ``check_inputs`` it extends;
    the pipeline says how its images are sized (``_reference_sizes``)."""

    editor: DitEditor | None
    edits_unavailable: str

    def _reference_sizes(self, batch: Batch) -> list[tuple[int, int]]:
        """The encoded (width, height) of the batch's input images; refuses a batch whose images do not fit."""
        raise NotImplementedError

    def check_inputs(self, batch: Batch) -> None:
        super().check_inputs(batch)  # type: ignore[misc]  # the pipeline base's: after this class in the MRO
        if batch.mode == "instruct":
            if self.editor is None:
                raise InvalidRequestError(f"edits are not served by this model: {self.edits_unavailable}",
                                          param="image")
            self._reference_sizes(batch)

    def reference_encoder(self, batch: Batch) -> DitEditor | None:
        """The editor whose VAE encoder reads an instruction edit's images; None for any other batch."""
        return self.editor if batch.mode == "instruct" else None

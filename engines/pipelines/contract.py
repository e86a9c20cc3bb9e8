"""The pipeline contract: what the engine asks of a family's pipeline (engines/pipelines/unet.py for the UNet
families, dit_pipeline.py for the flow-matching transformers), so it holds one type instead of a union and
branches on no pipeline class. A pipeline composes its stages (encode, prepare the latents, denoise step by step,
decode) in ``__call__``; the component sessions it exposes are what LoRA adapts and what placement audits."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from engines.types.request import Batch, StepHook

if TYPE_CHECKING:
    from engines.lora.active import Adapters
    from engines.pipelines.unet import Begun, OrtModel, PipelineOutput
    from engines.runtime.sessions import Runtime


class Stepwise(Protocol):
    """A pipeline whose stages run one denoiser evaluation at a time for many batches (step-level batching,
    server/stepper.py): each batch begins (encode, noise, edit preparation), ticks (one joined denoiser call over
    every running batch, then each batch's own step graph) and finishes (decode, a few images at a time or all at
    once)."""

    def begin(self, batch: Batch, latents: np.ndarray | None = None, adapters: Adapters | None = None) -> Begun: ...

    def run_denoiser(self, states: Sequence[Any]) -> None:
        """One denoiser evaluation for each state (``Begun.state`` of this pipeline) at its next evaluation."""

    def advance(self, state: Any) -> bool:
        """The state's own step after the denoiser wrote its output; True when a sampler step completed."""

    def decode(self, run: Begun, images: int) -> None:
        """Decode up to ``images`` more of a run's images (kept with it) once its denoising is over or stopped."""

    def finish(self, run: Begun) -> PipelineOutput:
        """Decode what ``decode`` did not yet and return the batch."""

    def joinable(self) -> bool:
        """Whether rows at different timesteps share one denoiser call (else one call per timestep value)."""


class Pipeline(Protocol):
    @property
    def runtime(self) -> Runtime: ...

    @property
    def editor(self) -> object | None:
        """What serves edits (img2img, inpainting), None when the folder has no VAE encoder."""

    @property
    def default_size(self) -> int: ...

    @property
    def denoiser(self) -> OrtModel:
        """The UNet or the transformer: the session whose provider a response names."""

    def adaptable(self) -> list[OrtModel]:
        """The sessions a LoRA can change: the text encoders and the denoiser."""

    def check_inputs(self, batch: Batch) -> None:
        """Refuse (InvalidRequestError naming the field) what this model cannot serve."""

    def __call__(self, batch: Batch, *, latents: np.ndarray | None = None, on_step: StepHook | None = None,
                 adapters: Adapters | None = None) -> PipelineOutput: ...

    def stepwise(self) -> Stepwise | None:
        """The stages step-level batching drives, or None when this pipeline runs a batch whole (then a step-level
        server runs its batches one at a time between ticks)."""

"""The pipeline contract, at the bottom of the pipelines wing: what the engine asks of an architecture's pipeline
(engines/pipelines/unet.py for the UNet families, flow.py and its subclasses for the flow-matching transformers), so
it holds one type instead of a union and branches on no pipeline class, and the run state every pipeline returns
(``Begun``, typed by what the stages read of it). A pipeline composes its stages (encode, prepare the latents,
denoise step by step, decode) in ``__call__``; the component sessions it exposes are what LoRA adapts and what
placement audits."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from engines.errors import InvalidRequestError
from engines.types.model import ModelInfo
from engines.types.request import Batch, CacheUse, StepHook, Timings

if TYPE_CHECKING:
    from engines.lora.active import Adapters
    from engines.pipelines.ort_model import OrtModel
    from engines.runtime.sessions import Runtime


class RunState(Protocol):
    """A batch's denoising state between evaluations (the UNet's ``Denoising``, the flow base's ``DitDenoising``):
    what the loop and step-level batching read of it."""

    next_eval: int
    """The evaluation the next tick runs (``evaluations`` when the denoising is over)."""
    done: int
    """Sampler steps completed."""

    @property
    def evaluations(self) -> int: ...


class Conditioned(Protocol):
    """A batch's text conditioning: its truncation flags come back with the images."""

    @property
    def truncated(self) -> tuple[bool, ...]: ...

    @property
    def negative_truncated(self) -> tuple[bool, ...]: ...


def check_common(batch: Batch, size_multiple: int) -> None:
    """The checks every pipeline's ``check_inputs`` makes first (InvalidRequestError naming the field): at least
    one image, width and height positive multiples of the model's size multiple, at least one step."""
    if not batch.images:
        raise InvalidRequestError("a batch needs at least one image", param="n")
    for name, value in (("width", batch.width), ("height", batch.height)):
        if value <= 0 or value % size_multiple:
            raise InvalidRequestError(f"{name} {value} must be a positive multiple of {size_multiple}",
                                      param="size")
    if batch.steps < 1:
        raise InvalidRequestError(f"steps {batch.steps} must be at least 1", param="steps")


def image_rng(seed: int) -> np.random.Generator:
    """Per-image noise stream: the initial latents first, then Euler-ancestral step noise, in order."""
    return np.random.default_rng(seed)


@dataclass(frozen=True)
class PipelineOutput:
    images: np.ndarray
    """uint8 [B, H, W, 3]."""
    truncated: tuple[bool, ...]
    """Per image: its prompt was longer than the text encoder takes."""
    negative_truncated: tuple[bool, ...]
    timings: Timings
    steps_done: int
    """Denoising steps that ran (fewer when ``on_step`` stopped the batch)."""
    steps_total: int = 0
    """Steps the batch was to run: ``steps``, or an edit's ``int(steps * strength)``."""
    latents: np.ndarray | None = None
    """float32 [B, C, h, w] final latents, brought down only when an image asked (ImageSpec.keep_latents)."""
    cache: CacheUse | None = None
    """What the batch's step cache reused (None: no cache ran)."""


@dataclass
class Begun:
    """One batch between its stages (``begin``, ticks of ``run_denoiser`` + ``advance``, ``finish``): what step-level
    batching holds per running request."""

    batch: Batch
    state: Any
    """The pipeline's denoising state (a ``RunState``: the UNet's Denoising, the flow base's DitDenoising), typed
    ``Any`` here so each pipeline reads its own fields; ``run_state`` gives the contract's view."""
    cond: Conditioned
    prepared: Any
    """An edit's prepared image (the UNet pipeline's ``Prepared``), or None."""
    steps_total: int
    started: tuple[float, float, float]
    """perf_counter at the start, after encoding, after preparing the latents."""
    denoise_s: float = 0.0
    stopped: bool = False
    decoded: list[np.ndarray] = field(default_factory=list)
    """The images decoded so far (``decode``: a few at a time under step-level batching), in order."""
    decode_s: float = 0.0

    @property
    def run_state(self) -> RunState:
        return self.state  # type: ignore[no-any-return]

    @property
    def finished(self) -> bool:
        state = self.run_state
        return self.stopped or state.next_eval >= state.evaluations

    def next_rows(self, images: int) -> tuple[int, int]:
        """The rows the next decode of at most ``images`` images takes: (start, stop)."""
        start = sum(len(part) for part in self.decoded)
        return start, min(len(self.batch.images), start + max(1, images))

    def all_decoded(self) -> np.ndarray:
        return self.decoded[0] if len(self.decoded) == 1 else np.concatenate(self.decoded)


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

    def model_info(self, name: str, digest: str = "") -> ModelInfo:
        """What the engine reports and validates requests against (``/v1/models``, ``/capabilities``)."""

    def describe(self) -> str:
        """One line for the load log: the family and what sets it apart."""

    def __call__(self, batch: Batch, *, latents: np.ndarray | None = None, on_step: StepHook | None = None,
                 adapters: Adapters | None = None) -> PipelineOutput: ...

    def stepwise(self) -> Stepwise | None:
        """The stages step-level batching drives, or None when this pipeline runs a batch whole (then a step-level
        server runs its batches one at a time between ticks)."""

"""The engine protocol: the only way server/ reaches inference."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from PIL import Image


@dataclass(frozen=True)
class ImageSpec:
    """One image to generate; per-image settings may differ inside a batch."""

    prompt: str
    negative_prompt: str = ""
    seed: int = 0
    guidance_scale: float = 7.5


@dataclass(frozen=True)
class Batch:
    """Images that share shape, step count and scheduler, so they run as one batch."""

    images: tuple[ImageSpec, ...]
    width: int = 64
    height: int = 64
    steps: int = 20
    scheduler: str = "euler"


@dataclass(frozen=True)
class GeneratedImage:
    image: Image.Image
    seed: int
    prompt_truncated: bool = False


@dataclass(frozen=True)
class BatchResult:
    images: tuple[GeneratedImage, ...]
    provider: str
    """The execution provider that ran the UNet."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds per phase: text_encoder, denoise, vae_decode, total."""


@dataclass(frozen=True)
class ModelInfo:
    """What the loaded model can serve; the server validates requests against it."""

    name: str
    size_multiple: int
    """Width and height must be multiples of this (VAE factor x UNet downsampling)."""
    default_size: int
    schedulers: tuple[str, ...]
    max_prompt_tokens: int
    digest: str = ""
    """sha256 of the UNet file from the model's manifest ("" when there is no manifest)."""


@dataclass(frozen=True)
class CanaryCheck:
    """One watchdog canary: its latency against the boot baseline, its output against the boot output."""

    shape: str
    seconds: float
    baseline_s: float
    distance: float
    tolerance: float
    problem: str | None = None


class Engine(Protocol):
    """Lifecycle verbs of an inference engine."""

    def preflight(self) -> dict[str, Any]:
        """Check the runtime and device before any model loads; returns the findings."""

    def load(self) -> None:
        """Build sessions under the provider policy; raises NotReadyError when the policy cannot be met."""

    def self_test(self) -> dict[str, Any]:
        """Run canaries on the loaded model; raises when the output or latency is wrong."""

    def generate(self, batch: Batch) -> BatchResult:
        """Run one batch; raises InvalidRequestError for requests the model cannot serve."""

    def canary(self) -> CanaryCheck:
        """Run one canary now (the watchdog calls this while no request runs)."""

    def prompt_overflows(self, texts: list[str]) -> list[bool]:
        """Per text: whether it is longer than the text encoder takes (it would be truncated)."""

    def check_health(self) -> None:
        """Raise NotReadyError when the engine can no longer serve on its proven path."""

    def capabilities(self) -> dict[str, Any]:
        """The capability snapshot: providers, options, checks, verdict."""

    @property
    def info(self) -> ModelInfo:
        """The loaded model's serving limits."""

    def close(self) -> None:
        """Release sessions and device buffers."""

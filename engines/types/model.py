"""What the loaded model serves: its limits and family (ModelInfo), the working memory a request shape needs
(admission asks it), and the adapter library's files and merged-set cache."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from engines.types.request import Mode


@dataclass(frozen=True)
class LoraInfo:
    """One file of the adapter library, usable or not (``problem`` says why not)."""

    name: str
    alias: str
    path: str
    """Relative to the library folder (the server's own paths are not shown)."""
    sha256: str
    size: int
    metadata: dict[str, str]
    problem: str
    components: dict[str, int]
    """Per session (unet, text_encoder...), how many of its weights the file changes."""


@dataclass(frozen=True)
class LoraStats:
    """The merged-set cache, for /metrics and /capabilities."""

    hits: int = 0
    misses: int = 0
    """Sets merged (not found in the cache)."""
    evictions: int = 0
    uncacheable: int = 0
    """Sets larger than the whole budget: merged for their batch, never kept."""
    cached_sets: int = 0
    cached_bytes: int = 0
    merge_seconds_total: float = 0.0
    last_merge_seconds: float = 0.0
    merged_bytes_total: int = 0
    """Bytes of weights the merges wrote: with ``merge_seconds_total``, the throughput admission prices a set by."""


@dataclass(frozen=True)
class MemoryNeed:
    """A request's estimated peak working memory beyond the loaded model (engines/health/request_memory.py)."""

    peak_bytes: int
    stage: str
    """The stage at the peak (``denoiser``, ``VAE decode``, ``VAE encode``, ``text encoder``)."""
    stages: tuple[tuple[str, int], ...]
    """Every stage's bytes; the stages run one after another, so the peak is the largest, not their sum."""
    why: str = ""
    """What dominates the peak stage, in words (e.g. its attention's score matrices over N tokens)."""


class MemoryModel(Protocol):
    """The loaded model's working memory by request shape, as admission asks it."""

    @property
    def factor(self) -> int:
        """Image pixels per latent pixel along each side (the VAE's downsampling)."""

    def need(self, width: int, height: int, denoise_images: int, images: int, encode: bool = False,
             references: tuple[tuple[int, int], ...] = (), controls: int = 0) -> MemoryNeed:
        """Peak bytes of a batch at ``width`` x ``height``: ``denoise_images`` in one denoiser call (requests
        sharing it included), ``images`` through the text encoders and the VAE; ``encode``: the VAE encoder runs
        too (edits, a Hires fix second pass from pixels); ``references``: an instruction edit's input images as the
        model encodes them (ModelInfo.references), each through the VAE encoder and its latents joining every
        denoiser row as extra tokens; ``controls``: the batch's ControlNet units (their residuals join the denoiser
        stage)."""


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
    """sha256 of the UNet file from the model's manifest, read once at load ("" when there is no manifest)."""
    family: str = "sd1"
    """sd1 | sd2 | sdxl | turbo (engines/pipelines/unet_family.py); ``default_size`` is its native size."""
    prediction_type: str = "epsilon"
    text_encoders: int = 1
    vae_scaling_factor: float = 0.18215
    cfg_default: bool = True
    """Whether the family's default guidance runs classifier-free guidance (Turbo: no, guidance 0)."""
    default_steps: int = 20
    default_guidance: float = 7.5
    modes: tuple[Mode, ...] = ("txt2img",)
    """What the model serves: txt2img, img2img, inpaint (edits need the VAE encoder)."""
    edits_unavailable: str = ""
    """Why edits are not served ("" when they are): e.g. the folder has no vae_encoder."""
    inpainting_unet: bool = False
    """A 9-channel inpainting UNet (edits: inpainting only)."""
    edit_schedulers: tuple[str, ...] = ()
    """The schedulers that serve edits."""
    instruct_images: int = 0
    """An instruction-edit model (Qwen-Image-Edit, FLUX.1 Kontext, FLUX.2 with reference images): the most input
    images one edit takes, as its diffusers pipeline accepts; 0: edits are img2img and inpainting only. With it, an
    edit without a mask is an instruction edit (mode ``instruct``, EditImage.references)."""
    instruct_size: Callable[[tuple[tuple[int, int], ...]], tuple[int, int]] | None = field(default=None,
                                                                                          compare=False)
    """An instruction-edit model's output (width, height) from its input images' (width, height), by its diffusers
    pipeline's rule (a target area at the input's aspect, a preferred-resolution table), used when the request
    names no size; None: the batch's size as for img2img."""
    instruct_references: Callable[[tuple[tuple[int, int], ...]], tuple[tuple[int, int], ...]] | None = field(
        default=None, compare=False)
    """An instruction-edit model's reference images' (width, height) as it encodes them, from the input images'
    (Kontext: its preferred resolution; Qwen-Image-Edit: 1024² at each one's aspect): their latents join every
    denoiser row as extra tokens, which admission charges (memory and step cost); None: no reference tokens."""
    token_patch: int = 0
    """A DiT's pixels per image-token edge (VAE factor x patch: 16); 0 for a UNet (cost scaled by pixels)."""
    text_tokens: int = 0
    """A DiT's text tokens in its joint attention (Flux: T5's length; SD 3: 77 CLIP + T5's length)."""
    hidden_size: int = 0
    """A DiT's transformer width (heads x head dim)."""
    prompt_limits: tuple[tuple[int, str], ...] = ()
    """The tokens each text encoder reads of a prompt, as a truncation warning names them: (77, "CLIP tokens"),
    (512, "T5 tokens (max_sequence_length)") for Flux; (): ``max_prompt_tokens`` CLIP tokens (the UNet families)."""
    reads_negative: Callable[[float], bool] | None = field(default=None, compare=False)
    """Whether the pipeline reads an image's negative prompt at its guidance scale (its classifier-free guidance
    runs on it); guidance-distilled models never do. None: not reported (no warning)."""
    memory: MemoryModel | None = None
    """The working memory a request needs at its shape (admission refuses what cannot fit the memory budget);
    None when the engine cannot estimate it."""

    def references(self, sizes: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
        """The encoded sizes of an instruction edit's input images of ``sizes`` (() without references)."""
        return self.instruct_references(sizes) if self.instruct_references is not None and sizes else ()

    def reference_tokens(self, sizes: tuple[tuple[int, int], ...]) -> int:
        """The latent tokens the input images of ``sizes`` add to each denoiser row (0: a UNet, none)."""
        if not self.token_patch:
            return 0
        return sum((w // self.token_patch) * (h // self.token_patch) for w, h in self.references(sizes))

    def work(self, width: int, height: int, extra_tokens: int = 0) -> float:
        """Relative compute of one denoising step at ``width`` x ``height``: what admission scales a measured
        per-step cost by to a size it has not measured. A UNet: the pixel count (a lower bound: its attention
        grows faster). A DiT: per block ``N * (12 d + 2 N)`` with N = image + text tokens (the QKV/out/MLP
        projections are 12 N d^2 FLOPs, joint attention 2 N^2 d; divided by d): the text tokens make it grow slower
        than pixels at small sizes and the attention faster at large ones. ``extra_tokens``: an instruction edit's
        reference tokens in the same sequence (``reference_tokens``)."""
        if not self.token_patch:
            return float(width * height)
        n = (width // self.token_patch) * (height // self.token_patch) + self.text_tokens + extra_tokens
        return float(n * (12 * self.hidden_size + 2 * n))

    @property
    def work_basis(self) -> str:
        return "pixel count" if not self.token_patch else \
            f"joint-attention tokens (N(12d+2N), d={self.hidden_size}, {self.text_tokens} text tokens)"

    def family_summary(self) -> dict[str, str | int | float | bool]:
        """The family fields as /v1/models, /sdapi/v1/sd-models and /capabilities report them."""
        return {"family": self.family, "native_size": self.default_size, "prediction_type": self.prediction_type,
                "text_encoders": self.text_encoders, "vae_scaling_factor": self.vae_scaling_factor,
                "cfg_default": self.cfg_default, "default_steps": self.default_steps,
                "default_guidance": self.default_guidance, "modes": ",".join(self.modes),
                "inpainting_unet": self.inpainting_unet,
                **({"edits_unavailable": self.edits_unavailable} if self.edits_unavailable else {})}

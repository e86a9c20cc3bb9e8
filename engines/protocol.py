"""The engine protocol: the only way server/ reaches inference, with typed requests, results and reports.

Nothing crossing this boundary is a ``dict[str, Any]``: the capability snapshot, the self-test report, the GPU
signature and ORT log events are frozen types, and their JSON shape is their ``model_dump(mode="json")``
(engines/schemas/capabilities.schema.json is tested against it).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import numpy as np
from PIL import Image
from pydantic import BaseModel, ConfigDict

THUMB = 8
"""Canary fingerprints are THUMB x THUMB block means."""


def fingerprint(image: np.ndarray) -> np.ndarray:
    """8x8 block means of an HxWx3 uint8 image, in pixel units (0..255): the canary fingerprint that selftest.json
    records, the watchdog compares and `sdserve gate` compares across rollouts."""
    h, w = image.shape[:2]
    rows, cols = np.linspace(0, h, THUMB + 1).astype(int), np.linspace(0, w, THUMB + 1).astype(int)
    pixels = image.astype(np.float64)
    return np.array([[pixels[rows[i]:rows[i + 1], cols[j]:cols[j + 1]].mean(axis=(0, 1)) for j in range(THUMB)]
                     for i in range(THUMB)])


# Requests and results


LatentFill = Literal["original", "noise", "nothing"]


@dataclass(frozen=True, eq=False)
class EditImage:
    """One image's edit input, already at the batch's width and height (server/images_in.py decodes, orients and
    resizes uploads). Compared by identity: it holds arrays."""

    image: np.ndarray
    """uint8 [H, W, 3] RGB."""
    mask: np.ndarray | None = None
    """uint8 [H, W]: where to repaint, as diffusers' mask (binarized at 0.5: >= 128 repaints; the output blends
    the repainted pixels in by mask/255 where ``Batch.overlay``); None: img2img."""
    fill: LatentFill = "original"
    """Inpainting: what the masked part of the init latents starts from (A1111's inpainting_fill 2 and 3, done
    in modules/processing.py StableDiffusionProcessingImg2Img.init): "original" the encoded image, "noise" the
    image's own seeded start noise (latent noise), "nothing" zeros (latent nothing)."""
    latents: np.ndarray | None = None
    """float32 [C, h, w]: init latents as the denoiser sees them (scaled), used instead of encoding ``image``
    (Hires fix's latent upscale, A1111's latent_scale_mode); None: ``image`` is encoded."""


@dataclass(frozen=True)
class ImageSpec:
    """One image to generate; per-image settings may differ inside a batch."""

    prompt: str
    negative_prompt: str = ""
    seed: int = 0
    guidance_scale: float = 7.5
    edit: EditImage | None = None
    """img2img (no mask) or inpainting input; None: txt2img. Every image of a batch has the same mode."""
    keep_latents: bool = False
    """Return this image's final latents (GeneratedImage.latents): a Hires fix first pass with a latent upscale."""


Mode = Literal["txt2img", "img2img", "inpaint"]

CACHE_METHODS = ("output", "first-block")
"""Step cache methods: ``output`` reuses the denoiser's last output for every family (engines/pipelines/
step_cache.py); ``first-block`` runs the DiT transformer's first block and skips the rest (first_block.py)."""
CACHE_MIN_STEPS = 9
"""A cache never runs on a request with fewer steps: few-step models (Turbo, schnell) gain nothing and every
evaluation counts."""


@dataclass(frozen=True)
class StepCache:
    """A request's step cache (off unless the server's policy or the request turns it on, and only after the gate
    passed for this model and shape). Images under a cache are no longer the seed-reproducible uncached images."""

    method: str = "output"
    threshold: float = 0.2
    """``output``: the accumulated estimate of the output's relative change (EasyCache's rule) under which the last
    output is reused; ``first-block``: the first block's relative residual change (diffusers' hook)."""
    warmup: float = 0.15
    """The first fraction of evaluations always computed (ComfyUI's EasyCache ``start_percent``)."""
    final: float = 0.05
    """The last fraction of evaluations always computed (at least one)."""
    max_reuse: int = 3
    """Consecutive evaluations that may reuse before one is computed."""

    def label(self) -> str:
        """How a response, infotext and manifest name it: ``output:0.2``."""
        return f"{self.method}:{self.threshold:g}"


@dataclass(frozen=True)
class CacheUse:
    """What a step cache did for one request: its configuration and the denoiser evaluations it reused."""

    spec: StepCache
    reused: int
    evaluations: int


@dataclass(frozen=True)
class LoraUse:
    """One LoRA of a request's adapter set, resolved against the library (the server checks names first)."""

    name: str
    sha256: str
    te: float = 1.0
    """Multiplier on the text encoders (A1111's te_multiplier)."""
    unet: float = 1.0
    """Multiplier on the denoiser, UNet or DiT transformer (A1111's unet_multiplier)."""

    def label(self) -> str:
        """``name:te:unet`` (``name:mult`` when both are equal), as ``<lora:...>`` writes it."""
        return f"{self.name}:{self.te:g}" + ("" if self.te == self.unet else f":{self.unet:g}")


def lora_key(uses: tuple[LoraUse, ...]) -> tuple[tuple[str, float, float], ...]:
    """An adapter set's cache and batching key: sorted (file sha256, te multiplier, denoiser multiplier)."""
    return tuple(sorted((u.sha256, u.te, u.unet) for u in uses))


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
class Batch:
    """Images that share shape, step count and scheduler, so they run as one batch."""

    images: tuple[ImageSpec, ...]
    width: int = 64
    height: int = 64
    steps: int = 20
    scheduler: str = "euler"
    truncate_prompts: bool = True
    """Over-long prompts: truncate (reported per image) or refuse with InvalidRequestError (tokenized once)."""
    original_size: tuple[int, int] | None = None
    """SDXL micro-conditioning: the (height, width) the image claims to come from; None = the target size."""
    crops_coords_top_left: tuple[int, int] = (0, 0)
    """SDXL micro-conditioning: the (top, left) crop it claims; (0, 0) as diffusers."""
    strength: float = 1.0
    """Edits: diffusers' ``strength`` in (0, 1]: ``int(steps * strength)`` steps run, from the noise level where
    the full schedule would be after the others (``get_timesteps``). txt2img ignores it."""
    overlay: bool = True
    """Inpainting: paste the init image back outside the mask (as A1111 does; diffusers does not): pixels the
    mask leaves (mask 0) come back exactly as sent."""
    loras: tuple[LoraUse, ...] = ()
    """The adapter set: requests batch together only with the same set (engines/lora/manager.py set_key)."""
    cache: StepCache | None = None
    """The request's step cache (None: every denoiser evaluation runs)."""

    @property
    def lora_key(self) -> tuple[tuple[str, float, float], ...]:
        """What makes two requests' LoRA weights the same (``lora_key``)."""
        return lora_key(self.loras)

    @property
    def mode(self) -> Mode:
        """txt2img, img2img or inpaint, from the first image (check_inputs refuses mixed batches)."""
        edit = self.images[0].edit if self.images else None
        return "txt2img" if edit is None else "img2img" if edit.mask is None else "inpaint"


@dataclass(frozen=True)
class GeneratedImage:
    image: Image.Image
    seed: int
    prompt_truncated: bool = False
    negative_prompt_truncated: bool = False
    latents: np.ndarray | None = None
    """float32 [C, h, w] final latents (scaled), when the image asked for them (ImageSpec.keep_latents)."""


@dataclass(frozen=True)
class Timings:
    """Seconds per phase of one executed batch."""

    text_encoder: float = 0.0
    denoise: float = 0.0
    vae_decode: float = 0.0
    total: float = 0.0
    vae_encode: float = 0.0
    """Edits: encoding the init (and masked) images on the device."""


StepHook = Callable[[int, int], bool]
"""Called after each denoising step with (steps done, steps in total); returning False stops the batch at this step
boundary: the images are decoded from the latents so far (A1111's interrupt)."""


@dataclass(frozen=True)
class BatchResult:
    images: tuple[GeneratedImage, ...]
    provider: str
    """The execution provider that ran the UNet."""
    timings: Timings = Timings()
    batch_images: int = 0
    """Images in the batch that actually executed (micro-batching may merge requests; step-level batching: the most
    images any denoiser call of this request ran with); 0 = len(images)."""
    steps_done: int = 0
    """Denoising steps that ran; fewer than the batch's steps when a StepHook stopped it."""
    interrupted: bool = False
    adapted: tuple[str, ...] = ()
    """The components that ran with the batch's merged LoRA weights bound (sorted); empty without LoRA."""
    first_step_s: float = 0.0
    """Seconds from the request's arrival in the queue to the end of its first denoiser evaluation (the server's
    batcher sets it; 0 from the engine)."""
    cache: CacheUse | None = None
    """The step cache that ran (its evaluations reused), None when every evaluation was computed."""

    @property
    def executed(self) -> int:
        return self.batch_images or len(self.images)


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

    def need(self, width: int, height: int, denoise_images: int, images: int, encode: bool = False) -> MemoryNeed:
        """Peak bytes of a batch at ``width`` x ``height``: ``denoise_images`` in one denoiser call (requests
        sharing it included), ``images`` through the text encoders and the VAE; ``encode``: the VAE encoder runs
        too (edits, a Hires fix second pass from pixels)."""


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
    token_patch: int = 0
    """A DiT's pixels per image-token edge (VAE factor x patch: 16); 0 for a UNet (cost scaled by pixels)."""
    text_tokens: int = 0
    """A DiT's text tokens in its joint attention (Flux: T5's length; SD 3: 77 CLIP + T5's length)."""
    hidden_size: int = 0
    """A DiT's transformer width (heads x head dim)."""
    memory: MemoryModel | None = None
    """The working memory a request needs at its shape (admission refuses what cannot fit the memory budget);
    None when the engine cannot estimate it."""

    def work(self, width: int, height: int) -> float:
        """Relative compute of one denoising step at ``width`` x ``height``: what admission scales a measured
        per-step cost by to a size it has not measured. A UNet: the pixel count (a lower bound: its attention
        grows faster). A DiT: per block ``N * (12 d + 2 N)`` with N = image + text tokens (the QKV/out/MLP
        projections are 12 N d^2 FLOPs, joint attention 2 N^2 d; divided by d): the text tokens make it grow slower
        than pixels at small sizes and the attention faster at large ones."""
        if not self.token_patch:
            return float(width * height)
        n = (width // self.token_patch) * (height // self.token_patch) + self.text_tokens
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


@dataclass(frozen=True)
class CanaryCheck:
    """One watchdog canary: its latency against the boot baseline, its output against the boot output."""

    shape: str
    seconds: float
    baseline_s: float
    distance: float
    tolerance: float
    problem: str | None = None
    steps: int = 0
    """Denoising steps the canary ran (its per-step time is seconds / steps)."""
    provider: str = ""
    """The provider the canary's batch reported (a change since boot is evidence, not load)."""


@dataclass
class Faults:
    """Fault injection behind an explicit interface (never monkey-patching): created only when the dev profile sets
    ``debug.fault_injection``, so production cannot be slowed down by a request."""

    latency_s: float = 0.0
    """Extra seconds added to every batch, inside the execution lock (a slow GPU, as the server sees it)."""
    output_shift: float = 0.0
    """Pixel units added to the canary's output (a fast path that computes something else: fingerprint drift)."""
    nan_canary: bool = False
    """The canary's decode yields NaN/inf (refused as the pipeline refuses it)."""
    provider: str = ""
    """Reported in place of the session's provider (a provider that changed under the server); empty: none."""
    step_latency_s: float = 0.0
    """Extra seconds added to every denoiser tick of step-level batching, inside the execution lock (a slow
    denoiser: requests arriving meanwhile join the running ones at the next boundary)."""


# Telemetry, signature and ORT log events


@dataclass(frozen=True)
class GpuSample:
    sm_percent: float
    """SM (kernel) utilization, %."""
    memory_percent: float
    """Memory-controller utilization, %."""
    power_w: float
    power_limit_w: float
    memory_used_bytes: int = 0
    memory_total_bytes: int = 0
    """The device's memory (0: unknown): with ``memory_used_bytes``, what is free (admission's device budget)."""


class TelemetrySource(Protocol):
    def sample(self, device_index: int) -> GpuSample: ...


SignatureVerdict = Literal["idle", "healthy_compute", "memory_bound", "livelock", "fallback_suspected", "inconclusive"]


@dataclass(frozen=True)
class Signature:
    """The GPU signature over a window of samples: computing, spinning, idle or CPU fallback."""

    verdict: SignatureVerdict
    reason: str
    sm_percent: float
    memory_percent: float
    power_w: float


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


EventKind = Literal["provider_library_missing", "provider_creation_failed", "driver_too_old", "cpu_fallback",
                    "nodes_not_on_preferred_provider", "memcpy_nodes_added", "engine_rebuild", "arena_growth",
                    "artifact_mismatch"]


Severity = Literal["error", "warning", "info"]


class OrtEvent(_Frozen):
    """A classified ONNX Runtime log line."""

    kind: EventKind
    severity: Severity
    """error: the fast path is broken; warning: it is degraded; info: worth knowing."""
    line: str
    detail: str = ""


# The self-test report


class ShapeResult(_Frozen):
    shape: str
    latencies_s: tuple[float, ...]
    p50_s: float
    p95_s: float
    budget_s: float | None
    gpu_util_percent: float | None
    gpu_util_floor: float | None
    distances: dict[str, float] = {}
    """canary name -> max |fingerprint difference| in pixel units."""
    failures: tuple[str, ...] = ()


class SelfTestReport(_Frozen):
    passed: bool
    shapes: tuple[ShapeResult, ...]
    fingerprints: str
    """'checked against ...', 'not recorded', or 'recorded now'."""
    seconds: float


# The capability snapshot


class Verdict(_Frozen):
    status: Literal["pass", "fail", "cpu-dev"]
    reasons: tuple[str, ...]


class Policy(_Frozen):
    providers: tuple[str, ...]
    plugin: dict[str, str | bool | dict[str, str]] | None = None
    """The plugin EP the sessions run on (runtime.plugin), when the policy names one."""
    allow_cpu: bool
    enable_fallback: bool
    disable_cpu_ep_fallback: bool
    placement_audit: bool
    cpu_allowlist: tuple[str, ...]


class CheckResult(_Frozen):
    name: str
    category: Literal["gpu", "version"]
    status: Literal["pass", "fail", "skip"]
    observed: str
    expected: str
    remediation: str = ""


class LibraryClosure(_Frozen):
    library: str
    missing: dict[str, str]
    """soname -> the package that ships it."""
    resolved: dict[str, str]


class GpuDevice(_Frozen):
    index: int
    name: str
    compute_capability: str
    memory_total_bytes: int
    memory_used_bytes: int


class NvmlInfo(_Frozen):
    available: bool
    error: str = ""
    driver_version: str = ""
    cuda_driver_version: str = ""
    devices: tuple[GpuDevice, ...] = ()


class FoundVersion(_Frozen):
    version: str | None
    source: str = ""


class PluginInfo(_Frozen):
    """A plugin execution provider as preflight found it (engines/runtime/plugins.py)."""

    name: str
    package: str
    package_version: str | None
    """pip metadata of the package."""
    library: str
    library_version: str | None
    """What the loaded library reports (its EP devices' metadata)."""
    devices: tuple[dict[str, str], ...]
    error: str = ""


class Observations(_Frozen):
    """What preflight found on this node."""

    onnxruntime: str
    onnxruntime_cuda_build: str
    available_providers: tuple[str, ...]
    provider_libraries: dict[str, LibraryClosure]
    nvml: NvmlInfo
    cudnn: FoundVersion
    tensorrt: FoundVersion
    plugin: PluginInfo | None = None
    tensorrt_install: str = ""
    """"installed", "placeholder" (a pip TensorRT metapackage without the real libraries) or "not installed"."""


class Placement(_Frozen):
    """Which provider runs each node of one session; what landed on the CPU and whether the policy allows it."""

    session: str
    nodes_by_provider: dict[str, int]
    cpu_ops: dict[str, int]
    """op_type -> count of nodes on the CPU provider."""
    disallowed_on_cpu: dict[str, int]
    compute_on_cpu: dict[str, int]
    examples: tuple[str, ...]
    attention: dict[str, int]
    """provider -> count of fused attention nodes."""
    ok: bool
    shape_path: dict[str, int] = {}
    """op_type -> CPU nodes computing only on shape values (allowed by the data-flow audit)."""
    activation_on_cpu: tuple[str, ...] = ()
    """'OpType name' of CPU nodes on an activation's path (refused in production)."""
    unmatched: tuple[str, ...] = ()
    """CPU node names the partitioned graph does not hold (refused: fail closed)."""


class SessionInfo(_Frozen):
    providers_requested: tuple[str, ...]
    providers_used: tuple[str, ...]
    ort_events: tuple[OrtEvent, ...]
    ort_log: tuple[str, ...]
    placement: Placement | None


class PlacementSummary(_Frozen):
    nodes_by_provider: dict[str, int]
    compute_on_cpu: dict[str, int]
    ok: bool


class IoInfo(_Frozen):
    binding: str
    device: str
    host_staging: str
    buffers_reused_per_shape: bool


class EngineArtifacts(_Frozen):
    path: str
    profiles: tuple[dict[str, str | int | list[int] | dict[str, str]], ...]
    cache_read_only: bool
    build_placement: dict[str, dict[str, int]] = {}
    """Per component, the source graph's nodes by provider when the build compiled it (the EP-context model
    that serves it is one EPContext node)."""


class Artifacts(_Frozen):
    model_manifest: str = "not checked"
    engines: EngineArtifacts | None = None


class Attention(_Frozen):
    fused: bool
    on_gpu: bool
    by_session: dict[str, dict[str, int]]


class Capabilities(_Frozen):
    """The capability snapshot (GET /capabilities, `sdserve doctor --json`): what was proven about the fast path."""

    schema_version: Literal[1] = 1
    generated_at: str
    accelerated: bool
    """True only when every check passed, every session runs on a GPU provider and no compute op is on the CPU."""
    verdict: Verdict
    device: Literal["cuda", "cpu"]
    device_id: int
    model: str
    policy: Policy
    provider_options: dict[str, dict[str, str]]
    checks: tuple[CheckResult, ...]
    observations: Observations | None
    sessions: dict[str, SessionInfo]
    placement_summary: dict[str, PlacementSummary]
    io: IoInfo
    arena: dict[str, str | bool | float | int]
    artifacts: Artifacts
    attention: Attention
    self_test: SelfTestReport | None
    family: dict[str, str | int | float | bool] = {}
    """The served model's family (ModelInfo.family_summary); empty before the model loads."""
    lora: dict[str, object] = {}
    """The adapter library and the merged-set cache (engines/lora/manager.py): folder, files, recent sets; empty
    when no [runtime.lora] dir is configured."""
    image: dict[str, str] = {}
    """The container image this server runs in, from the ``SDSERVE_IMAGE_*`` environment the image sets (``variant``:
    ``trt``, or ``notrt`` for an image built without the TensorRT libraries); empty outside an image."""


class StepRun(Protocol):
    """One admitted batch denoised step by step beside others (step-level batching): Engine.begin makes it,
    Engine.tick advances it one denoiser evaluation, Engine.decode decodes a part of it, Engine.finish decodes the
    rest and returns it, Engine.discard drops it."""

    @property
    def steps_done(self) -> int: ...

    @property
    def steps_total(self) -> int: ...

    @property
    def finished(self) -> bool:
        """Every evaluation ran: the next call for it is ``finish``."""


class Engine(Protocol):
    """Lifecycle verbs of an inference engine."""

    def preflight(self) -> tuple[CheckResult, ...]:
        """Check the runtime and device before any model loads; raises when the policy cannot be met."""

    def load(self) -> None:
        """Build sessions under the provider policy; raises NotReadyError when the policy cannot be met."""

    def self_test(self) -> SelfTestReport:
        """Run canaries on the loaded model; raises SelfTestError when the output or latency is wrong."""

    def generate(self, batch: Batch, on_step: StepHook | None = None) -> BatchResult:
        """Run one batch; raises InvalidRequestError for requests the model cannot serve. ``on_step`` reports
        progress after every step and may stop the batch there."""

    def step_key(self, batch: Batch) -> Hashable | None:
        """Batches with equal keys may share denoiser calls step by step (same model size, latent shape and LoRA
        set; prompts, seeds, steps, samplers, guidance and strengths may differ); None: this batch runs whole
        through ``generate``."""

    def begin(self, batch: Batch) -> StepRun:
        """Encode ``batch`` and prepare its denoising state (its own device buffers); raises like ``generate``."""

    def tick(self, runs: Sequence[StepRun]) -> None:
        """One denoiser evaluation for every run (equal step keys, none finished), in one call where the model
        allows, then each run's own step."""

    def decode(self, run: StepRun, images: int) -> None:
        """Decode up to ``images`` more of a run's images (kept with it) once its denoising is over: a decode
        split in parts, so a short request waits for one part at most, not a whole batch's."""

    def finish(self, run: StepRun, stopped: bool = False) -> BatchResult:
        """Decode ``run`` where its denoising is (all steps, or where ``stopped`` cut it: an interrupt), what
        ``decode`` did not yet, and free its state."""

    def discard(self, run: StepRun) -> None:
        """Free a run that will not be finished (deadline, cancelled, stop)."""

    def canary(self) -> CanaryCheck:
        """Run one canary now (the watchdog calls this while no request runs)."""

    def record_fingerprints(self) -> Path:
        """Run every canary shape once and store the outputs' fingerprints next to the model."""

    def check_health(self) -> None:
        """Raise NotReadyError when the engine can no longer serve on its proven path."""

    def capabilities(self) -> Capabilities:
        """The capability snapshot: providers, options, checks, verdict."""

    def telemetry(self) -> TelemetrySource | None:
        """The device's telemetry (NVML on a GPU); None on the CPU or when NVML cannot start."""

    def signature(self, samples: list[GpuSample], requests_running: bool) -> Signature:
        """Classify a window of telemetry samples (healthy compute, livelock, idle, fallback suspected)."""

    def ort_events(self) -> list[OrtEvent]:
        """Classified ONNX Runtime log lines printed since the last call (after boot)."""

    @property
    def info(self) -> ModelInfo:
        """The loaded model's serving limits."""

    def loras(self) -> tuple[LoraInfo, ...]:
        """The adapter library's files (empty without [runtime.lora] dir)."""

    def refresh_loras(self) -> tuple[LoraInfo, ...]:
        """Scan the adapter library again (new, changed and removed files)."""

    def lora_cost_s(self, uses: tuple[LoraUse, ...]) -> float:
        """Seconds an adapter set costs before its batch's first step: 0 when cached (or none), else its merge,
        priced by the bytes it writes. InvalidRequestError (param ``loras``) for a set over the LoRA budget."""

    def lora_stats(self) -> LoraStats:
        """The merged-set cache's cumulative figures (all zero without a LoRA library)."""

    def close(self) -> None:
        """Release sessions and device buffers."""

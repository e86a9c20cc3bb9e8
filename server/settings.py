"""Profiles: typed, bounded, documented, frozen settings loaded from configs/<profile>.toml.

Environment overrides exist only for deployment settings (host, port, model folder, device id), all with the
``SDSERVE_`` prefix; nothing in the environment can allow the CPU or loosen a check.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

import engines.families as families
from engines.config import SCHEDULER_NAMES, RuntimeSettings, SignatureThresholds, parse_size, read_toml
from engines.errors import ConfigError
from engines.types.request import CACHE_MIN_STEPS
from server.tenant_config import TenantConfig, check_tenants

ENV_PREFIX = "SDSERVE_"
CONFIG_DIR = Path(os.environ.get(f"{ENV_PREFIX}CONFIG_DIR", Path(__file__).resolve().parent.parent / "configs"))
"""configs/ of the checkout, or SDSERVE_CONFIG_DIR (a deployment setting: the image puts them in /etc/sdserve)."""


class ServerSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = "127.0.0.1"
    """Interface to bind."""
    port: int = Field(8000, ge=0, le=65535)
    """TCP port; 0 picks a free one and logs it."""
    max_connections: int = Field(1000, ge=8, le=1_000_000)
    """Open TCP connections at most (lowered at start to fit under RLIMIT_NOFILE). One more closes the oldest
    connection that has waited a second without a complete request head, else one whose reply is stuck, else the
    oldest still sending its body (never a younger one without its head: it may be a probe), else is refused at
    once with 503 (server/connections.py)."""
    header_timeout_s: float = Field(10.0, gt=0, le=300)
    """Seconds a connection may take to send a complete request head (a new connection, or a kept-alive one
    between requests); then it is closed."""
    body_timeout_s: float = Field(30.0, gt=0, le=3600)
    """Seconds a request body may take to arrive in full after its head; then 408 (JSON) and the connection
    closes. A connection still sending its body can be evicted by the connection cap like an idle one."""
    write_timeout_s: float = Field(30.0, gt=0, le=3600)
    """Seconds a reply may stay unread in the server's buffer once the client stops taking it (or after the
    response ends); then the connection is cut off and the buffer dropped. A connection whose reply is stuck can
    be evicted by the connection cap like an idle one."""
    max_unread_reply_mb: int = Field(256, ge=1, le=1 << 20)
    """MiB of reply bytes all connections together may hold that their clients have not taken (stalled readers);
    past it the connections holding them longest are cut off, before ``write_timeout_s``."""
    probe_slots: int = Field(16, ge=1, le=1024)
    """Connections accepted beyond ``max_connections`` when every connection is busy, for probes only: one
    ``GET``/``HEAD`` of /health or /ready each, answered and closed; anything else on them is a 503."""
    metrics_cache_s: float = Field(0.0, ge=0, le=60)
    """/metrics is rendered in a worker thread, one rendering at a time; a scrape gets the newest rendering that
    started at most this many seconds before it arrived. 0: one started after it arrived (a burst of scrapes
    shares a few renderings, none stale); raise it to bound renderings to about one per this many seconds."""
    public_base_url: str = ""
    """Base of the absolute links response_format=url returns (e.g. https://img.example.com). Empty: the request's
    Host header is used, but only when its host name is in ``allowed_hosts`` (else the url request is a 400)."""
    allowed_hosts: tuple[str, ...] = ()
    """Host names (no port) a request's Host header may carry for response_format=url links when
    ``public_base_url`` is empty. Empty: the bound address (``host``) and the localhost names (localhost,
    127.0.0.1, [::1]). Any other Host is refused rather than reflected into a link."""
    url_store_max_bytes: int = Field(64 << 20, ge=1 << 20, le=16 << 30)
    """PNG bytes kept for response_format=url (oldest dropped first), besides the 256-image count bound."""
    cors_origins: tuple[str, ...] = ()
    """Browser origins allowed to call the API (e.g. "https://chat.example.com", or "*"); empty: CORS off (no
    CORS headers, preflights are answered like any other request). ``sdserve serve --cors-allow-origins`` (A1111's
    flag: a comma-separated list) replaces it."""
    cors_origin_regex: str = Field("", max_length=1000)
    """Browser origins allowed, as one regular expression the whole origin must match (e.g.
    "https://.*\\.example\\.com"), besides ``cors_origins``; empty: none. ``--cors-allow-origins-regex``."""
    log_prompts: bool = False
    """Put the prompt in the access-log line. Off: prompts are never logged."""

    @model_validator(mode="after")
    def _base_url(self) -> ServerSettings:
        url = self.public_base_url
        if url and (not url.startswith(("http://", "https://")) or any(c in url for c in "?#\\ ")
                    or not url.isascii()):
            raise ValueError(f"server.public_base_url {url!r} must be an http(s) URL without query or fragment")
        for name in self.allowed_hosts:
            if not _HOST_NAME.fullmatch(name):
                raise ValueError(f"server.allowed_hosts: {name!r} must be a host name or address without a port, "
                                 "e.g. images.internal, 10.0.0.5 or [fd00::5]")
        if self.cors_origin_regex:
            try:
                re.compile(self.cors_origin_regex)
            except re.error as exc:
                raise ValueError(f"server.cors_origin_regex {self.cors_origin_regex[:64]!r} is not a regular "
                                 f"expression: {exc}") from None
        for origin in self.cors_origins:
            scheme, _, host = origin.partition("://")
            if origin != "*" and (scheme not in ("http", "https") or not host or not origin.isascii()
                                  or any(c in host for c in "/?#\\ *")):
                raise ValueError(f"server.cors_origins: {origin!r} must be \"*\" or an origin like "
                                 "https://chat.example.com (scheme, host, optional port; no path)")
        return self

    def link_hosts(self) -> frozenset[str]:
        """The Host names a response_format=url link may be built from (``allowed_hosts`` or its default)."""
        if self.allowed_hosts:
            return frozenset(h.lower() for h in self.allowed_hosts)
        bound = f"[{self.host}]" if ":" in self.host else self.host
        return frozenset({bound.lower(), *LOCAL_HOSTS})


_HOST_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252})|\[[0-9A-Fa-f:.]{2,45}\]")
LOCAL_HOSTS = ("localhost", "127.0.0.1", "[::1]")
"""The names a client on this machine reaches the server by (the default of server.allowed_hosts)."""

class ApiSettings(BaseModel):
    """How client-facing names map onto what this server serves."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_aliases: tuple[str, ...] = ()
    """OpenAI ``model`` names that run the served model (e.g. "dall-e-2", "gpt-image-1", so clients' defaults
    work); the response's x-sdserve-model header names the model that ran. Any other name is a 400."""
    quality_steps: dict[str, int] = {}
    """OpenAI ``quality`` values honoured, each as a number of denoising steps (e.g. {standard = 20, hd = 40});
    "auto" means the profile's default steps. Any other value is a 400 listing these."""
    infotext: bool = True
    """Write A1111's generation parameters (prompt, negative prompt, steps, sampler, seed, size, model) into every
    image: a PNG ``parameters`` text chunk, the EXIF UserComment of JPEG/WebP; on the A1111 and OpenAI routes.
    False keeps prompts out of the files (their privacy); the A1111 ``info`` JSON still carries the text."""

    @model_validator(mode="after")
    def _check(self) -> ApiSettings:
        for alias in self.model_aliases:
            if not alias.strip() or len(alias) > 128:
                raise ValueError(f"api.model_aliases: {alias!r} must be a non-empty name of at most 128 characters")
        for quality, steps in self.quality_steps.items():
            if quality == "auto" or not 1 <= steps <= 200:
                raise ValueError(f"api.quality_steps.{quality}: steps must be 1..200 and \"auto\" is built in "
                                 "(the profile's default steps)")
        return self


class Limits(BaseModel):
    """Upper bounds a request may ask for; the model's own constraints apply on top."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_n: int = Field(4, ge=1, le=16)
    """Images per request."""
    max_steps: int = Field(50, ge=1, le=200)
    """Denoising steps per request."""
    max_width: int = Field(1024, ge=16, le=4096)
    max_height: int = Field(1024, ge=16, le=4096)
    max_prompt_chars: int = Field(4000, ge=1, le=100_000)
    """Characters per prompt (the tokenizer keeps 77 tokens; this bounds the work of tokenizing)."""
    prompt_overflow: Literal["truncate", "reject"] = "truncate"
    """A prompt longer than the text encoder's 77 tokens: truncate it (and say so in the response) or 400."""
    max_upload_bytes: int = Field(16 << 20, ge=1 << 20, le=256 << 20)
    """Request bodies on the edit routes (/v1/images/edits, /v1/images/variations, /sdapi/v1/img2img: uploads or
    base64 images); larger ones get 413 before they are read whole. Other routes keep queue.max_body_bytes."""
    max_image_pixels: int = Field(16_777_216, ge=65_536, le=268_435_456)
    """Pixels an uploaded image (or mask) may declare (width x height, read from its header before decoding):
    more is a 400, so a decompression bomb is never decoded."""
    max_request_pixels: int = Field(33_554_432, ge=65_536, le=4_294_967_296)
    """Pixels all images and masks of one request may declare together (read from their headers before any is
    decoded); more is a 400 naming the image that crossed it. The default: one image and its mask at
    ``max_image_pixels``. Must be at least ``max_image_pixels``."""
    max_jpeg_scans: int = Field(100, ge=1, le=10_000)
    """Scans a JPEG upload may hold (counted in its bytes before decoding): each scan of a progressive JPEG is a
    decoding pass over the whole image, so 30,000 tiny scans cost half a minute of CPU. Encoders write about 10."""
    decode_concurrency: int = Field(4, ge=1, le=256)
    """Images decoded at once in this process; one more is a 429 with Retry-After, never a wait."""
    edit_strength: float = Field(0.75, gt=0.0, le=1.0)
    """img2img strength when a request gives none (diffusers' img2img default is 0.8, A1111's 0.75); inpainting
    with a mask defaults to 1.0, as diffusers' inpainting pipeline."""
    variation_strength: float = Field(0.7, gt=0.0, le=1.0)
    """/v1/images/variations: img2img of the image with an empty prompt at this strength."""
    memory_budget_mb: int = Field(0, ge=0, le=16 << 20)
    """Working memory one batch may take beyond the loaded model, in MiB: a request whose estimated peak (its
    size, images, the batch it may share a denoiser call with, its stages: engines/health/request_memory.py)
    exceeds it is refused (400/422 naming the limit, the estimate and the field), never run into the kernel's
    OOM killer. 0: measured at boot, after the self-test: on a GPU the device memory still free; on the CPU the
    cgroup memory limit (else the host's RAM) minus this process's resident memory."""

    @model_validator(mode="after")
    def _request_budget(self) -> Limits:
        if self.max_request_pixels < self.max_image_pixels:
            raise ValueError(f"limits.max_request_pixels {self.max_request_pixels} is below max_image_pixels "
                             f"{self.max_image_pixels}: raise it to at least that (one image at the limit)")
        return self


class Defaults(BaseModel):
    """Values used when a request leaves a field out."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    steps: int = Field(20, ge=1, le=200)
    guidance_scale: float = Field(7.5, ge=0.0, le=30.0)
    scheduler: str = "euler"

    @model_validator(mode="after")
    def _known_scheduler(self) -> Defaults:
        if self.scheduler not in SCHEDULER_NAMES:
            raise ValueError(f"defaults.scheduler {self.scheduler!r} is not one of {sorted(SCHEDULER_NAMES)}")
        return self


class Serving(BaseModel):
    """The shapes this deployment serves; the self-test warms and checks each one."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    sizes: tuple[str, ...] = ()
    """Allowed WIDTHxHEIGHT sizes. Empty: any multiple of the model's factor within limits (canaries then run at
    the model's native size)."""
    batch_sizes: tuple[int, ...] = (1,)
    """Batch sizes warmed and checked at boot."""
    openai_sizes: bool = False
    """Also serve OpenAI's sizes (1024x1024, 1536x1024, 1024x1536, 1792x1024, 1024x1792: what OpenAI clients send
    by default) when the served model's family is trained at 1024x1024 (SDXL, FLUX.1, SD 3.x), beyond ``sizes`` and the
    width/height limits. Never resized: a model of another family refuses them (the message says why)."""
    openai_sizes_hires: bool = False
    """Serve OpenAI's sizes on a model trained at a smaller size (SD 1.x/2.x) through Hires fix: a first pass at
    the model's native pixel count (same aspect; an edit's or variation's first pass is the edit), a Lanczos upscale,
    then an img2img pass at the requested size at ``limits.edit_strength`` (said in x-sdserve-warnings and the
    response), on the OpenAI routes (generations, edits, variations). Off: those sizes are a 400 naming this
    option. Off by default: the second pass at 1024x1024 costs several first passes and memory beyond the served
    sizes, which the operator should choose knowingly."""

    @model_validator(mode="after")
    def _check(self) -> Serving:
        for size in self.sizes:
            parse_size(size)
        if not self.batch_sizes or any(b < 1 or b > 16 for b in self.batch_sizes):
            raise ValueError(f"serving.batch_sizes {self.batch_sizes} must be 1..16 and not empty")
        return self


class SelfTestSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    canaries_file: str = "canaries.toml"
    """Canary suite, relative to configs/ unless absolute."""
    slo_file: str = "slo.toml"
    """SLO windows, relative to configs/ unless absolute; the profile's table is used."""
    timed_runs: int = Field(3, ge=1, le=50)
    """Timed batches per shape after the warm-up (p50/p95 come from these)."""
    fingerprint_tolerance: float = Field(4.0, ge=0, le=255)
    """Max |difference| of 8x8 canary thumbnails (pixel units) against the recording, same platform."""
    cross_platform_tolerance: float = Field(24.0, ge=0, le=255)
    """The same when the recording came from another provider/ORT/machine."""
    require_fingerprints: bool = False
    """Refuse to become ready without recorded fingerprints (`sdserve selftest --record`)."""


class WatchdogSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = True
    interval_s: float = Field(30.0, ge=0.1, le=3600)
    """Seconds between watchdog checks."""
    idle_before_canary_s: float = Field(2.0, ge=0, le=600)
    """A canary runs only when no request has run for this long (it yields to real traffic)."""
    drift_factor: float = Field(2.0, gt=1.0, le=100)
    """A canary slower than this multiple of its boot baseline is a strike."""
    drift_consecutive: int = Field(3, ge=1, le=100)
    """Strikes in a row that mark the server degraded."""
    recover_after: int = Field(2, ge=1, le=100)
    """Clean checks in a row that bring a degraded server back to ready."""
    telemetry_window_s: float = Field(1.0, ge=0.1, le=60)
    """Seconds of telemetry sampled per check for the signature classifier."""
    latency_unready: Literal["never", "corroborated"] = "corroborated"
    """May slowness alone turn /ready 503? never (dev): slowness is measured, reported (/ready's ``load``,
    /performance, metrics) and alerted, never a flip. corroborated: only when the canary's per-step time is at least
    ``unready_drift_factor`` x its boot baseline for ``drift_consecutive`` checks in a row and no contention
    (CPU pressure, steal, other GPU processes) was observed in any of them. Evidence that the fast path broke
    (provider change, bad canary output, GPU signature, ORT errors, changed files) flips /ready in every profile."""
    unready_drift_factor: float = Field(5.0, gt=1.0, le=1000)
    """The hard slowdown factor for ``latency_unready = "corroborated"`` (``drift_factor`` only marks "slow")."""
    contention_cpu_pressure_percent: float = Field(20.0, ge=0, le=100)
    """Host CPU pressure (PSI "some", % of the window) at or over which slowness counts as explained by load."""
    contention_steal_percent: float = Field(5.0, ge=0, le=100)
    """CPU steal (% of CPU time) at or over which slowness counts as explained by load."""
    contention_load_per_cpu: float = Field(1.5, gt=0, le=1000)
    """Load average per CPU that explains slowness where the kernel exposes no CPU pressure."""
    canary_max_skips: int = Field(1, ge=0, le=100)
    """Checks in a row the canary may yield to traffic; then it runs between two batches anyway, so output faults
    are caught within ``canary_max_skips + 1`` intervals under any load."""

    @model_validator(mode="after")
    def _factors(self) -> WatchdogSettings:
        if self.unready_drift_factor < self.drift_factor:
            raise ValueError(f"watchdog.unready_drift_factor {self.unready_drift_factor} is below drift_factor "
                             f"{self.drift_factor}: the unready bound must be the harder one")
        return self


class QueueSettings(BaseModel):
    """Request path: bounded queue, micro-batching, deadlines, drain."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_size: int = Field(32, ge=1, le=10_000)
    """Requests allowed to wait; one more gets 429 at once."""
    batching: Literal["step", "micro"] = "step"
    """``step``: requests join and leave the running batch at step boundaries (server/stepper.py), so a short
    request never waits out a long one; ``micro``: compatible requests merge into one batch that runs to the end
    (server/batcher.py)."""
    max_batch: int = Field(4, ge=1, le=64)
    """Images per executed batch (micro) or per denoiser call (step): compatible requests are merged up to this
    (the TensorRT profiles and the memory plan are sized for it)."""
    max_running: int = Field(32, ge=1, le=4096)
    """Step-level batching: images encoded and denoising at once (their latents and history stay on the device, a
    few MB per image); each tick runs at most ``max_batch`` of them, the least work left first."""
    decode_images: int = Field(1, ge=1, le=64)
    """Step-level batching: images one decode operation takes; a request's decode is split in parts of this many,
    so a short request arriving meanwhile waits for one part, not the whole batch's decode (more: fewer, larger
    VAE calls)."""
    max_queue_delay_ms: float = Field(10.0, ge=0, le=10_000)
    """Micro-batching: how long the oldest request waits for compatible ones to join its batch (step-level
    batching needs no wait: a request joins at the next tick)."""
    request_timeout_s: float = Field(300.0, gt=0, le=3600)
    """Default deadline; a request not started by then gets 504 (header x-sdserve-timeout-s may shorten it)."""
    drain_timeout_s: float = Field(30.0, ge=0, le=3600)
    """On SIGTERM: how long queued and running work may take to finish before the rest gets 503."""
    max_body_bytes: int = Field(1 << 20, ge=1024, le=64 << 20)
    """Request bodies larger than this get 413."""


class AuthSettings(BaseModel):
    """Optional API keys, stored as sha256 hex digests (never the keys). Env SDSERVE_API_KEYS_SHA256 (comma list)
    adds digests at deploy time."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    api_key_sha256: tuple[str, ...] = ()
    """Accepted keys' sha256 hex digests; empty = auth off."""
    per_key_concurrency: int = Field(8, ge=1, le=10_000)
    """Generation requests one key may have in flight; more get 429."""
    exempt_paths: tuple[str, ...] = ("/health", "/ready", "/metrics")
    """Paths served without a key (probes and scraping)."""
    tenants: tuple[TenantConfig, ...] = ()
    """Tenants ([[auth.tenants]]): a label, its keys' digests, a weight and limits (server/tenant_config.py). Their
    digests are accepted keys too; an accepted key in no tenant is its own tenant, named by its key id."""
    tenants_file: str = ""
    """A TOML (``[[tenants]]``) or JSON (``{"tenants": [...]}``) file of more tenants, or a folder of such files
    (a mounted Kubernetes Secret: its ``*.toml``/``*.json`` keys); re-read without a restart when it changes. Set,
    it turns auth on. Unreadable or invalid at boot: exit 10; on a reload: the previous tenants stay, the error is
    logged and shown in /capabilities."""
    tenants_reload_s: float = Field(5.0, ge=0.1, le=3600)
    """How often the tenants file is checked for a change (its modification time, size and inode)."""

    @property
    def enabled(self) -> bool:
        """Auth is on: some key is accepted, or a tenants file may name some."""
        return bool(self.api_key_sha256 or self.tenants_file or any(t.digests for t in self.tenants))

    @model_validator(mode="after")
    def _hex(self) -> AuthSettings:
        for digest in self.api_key_sha256:
            if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise ValueError("auth.api_key_sha256 entries must be lowercase sha256 hex digests (64 chars), "
                                 "e.g. printf %s \"$KEY\" | sha256sum")
        check_tenants(self.tenants)
        return self


class DebugSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    fault_injection: bool = False
    """Mount /debug/faults (latency and telemetry injection). Dev profile only."""


class ProvenanceSettings(BaseModel):
    """Signed C2PA Content Credentials on every image (server/provenance.py). The key and chain are the
    operator's: PEM files named here or by ``SDSERVE_PROVENANCE_KEY_FILE`` / ``SDSERVE_PROVENANCE_CHAIN_FILE``, or
    the PEM text itself in ``SDSERVE_PROVENANCE_KEY`` / ``SDSERVE_PROVENANCE_CHAIN`` (a Kubernetes Secret). The key
    is never logged nor shown; /capabilities shows the certificate's subject and fingerprint only."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Literal["off", "sign", "require"] = "off"
    """off: images carry no manifest. sign: every image is signed when a usable key and chain are configured;
    without one, or when signing an image fails, the image is served unsigned and says so
    (``x-sdserve-provenance: unsigned; reason=...``, a warning, the metric). require: boot exits 13
    (PROVENANCE_KEY_INVALID) without a usable key and chain, and an image that fails to sign is a 500, never
    served unsigned. ``SDSERVE_PROVENANCE_MODE`` may raise the mode at deploy time, never lower it."""
    key_file: str = ""
    """PEM private key of the signing certificate (EC P-256/P-384/P-521, Ed25519 or RSA); unencrypted, readable
    by the server only. ``SDSERVE_PROVENANCE_KEY_FILE`` overrides it; both empty: the PEM text in
    ``SDSERVE_PROVENANCE_KEY``."""
    chain_file: str = ""
    """PEM certificate chain: the signing (end-entity) certificate first, then its intermediates; it must not be
    self-signed (C2PA). ``SDSERVE_PROVENANCE_CHAIN_FILE`` overrides it; both empty: the PEM text in
    ``SDSERVE_PROVENANCE_CHAIN``."""
    include_prompt: bool = False
    """Write the prompt and negative prompt into the signed manifest. Off (privacy): the manifest says how the
    image was made, not what was asked for."""
    watermark: bool = False
    """Mark every returned image of at least 256x256 pixels with an invisible DWT-DCT watermark (the scheme of
    ``invisible-watermark``'s ``dwtDct``, server/watermark.py) carrying a 64-bit id of the request and image,
    before it is signed, so the mark outlives a stripped manifest. Smaller images are served unmarked and say so
    (``x-sdserve-watermark: skipped:too_small``, the manifest, the metric). Independent of ``mode``."""


PROVENANCE_MODES = ("off", "sign", "require")
"""In order of strictness: the environment may move a profile's mode right, never left."""


class CacheSettings(BaseModel):
    """Step caching (engines/numerics/step_cache.py, first_block.py): skip denoiser evaluations whose output
    barely changes. Off by default; served only for shapes whose quality gate passed on this model at boot."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    policy: Literal["off", "opt-in", "on"] = "off"
    """off: never (a request asking gets 422); opt-in: a request asks with ``step_cache: true``; on: every
    request with at least 9 steps at a gated shape, unless it sends ``step_cache: false``."""
    method: Literal["output", "first-block"] = "output"
    """output: reuse the denoiser's last output (every family); first-block: the DiT transformer's first block
    decides and the rest is skipped (Flux, SD 3, exported with the split transformer)."""
    threshold: float = Field(0.2, gt=0, le=5)
    """output: EasyCache's accumulated relative change under which the output is reused (ComfyUI's default 0.2);
    first-block: the first block's relative residual change (diffusers' FirstBlockCacheConfig takes 0.05)."""
    warmup: float = Field(0.15, ge=0, lt=1)
    """The first fraction of evaluations always computed."""
    final: float = Field(0.05, ge=0, lt=1)
    """The last fraction of evaluations always computed (at least one)."""
    max_reuse: int = Field(3, ge=1, le=100)
    """Consecutive evaluations that may reuse before one is computed."""
    gate_steps: int = Field(30, ge=CACHE_MIN_STEPS, le=200)
    """Steps of the gate's canary runs (cached and uncached, same seeds)."""
    gate_min_mean_psnr_db: float = Field(30.0, ge=0, le=100)
    """The gate passes a shape when the canaries' mean PSNR (cached vs uncached) reaches this (Cache-DiT's DBCache
    on FLUX.1-dev: 33.8 dB at 1.8x) ..."""
    gate_min_worst_psnr_db: float = Field(25.0, ge=0, le=100)
    """... and its worst canary reaches this."""

    @model_validator(mode="after")
    def _cross(self) -> CacheSettings:
        if self.warmup + self.final >= 1:
            raise ValueError(f"cache.warmup + cache.final ({self.warmup} + {self.final}) leave no evaluation to "
                             "reuse")
        return self


PROFILES = ("dev", "production", "cuda", "openvino")
"""Profiles shipped in configs/ (cuda: the CUDA provider alone, no TensorRT; openvino: the plugin-EP accelerator CI
proves the fail-closed path against)."""
GPU_PROFILES = ("production", "cuda")
"""Profiles that never run on the CPU (``runtime.allow_cpu = true`` is refused at validation)."""


class Settings(BaseModel):
    """One profile."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    profile: Literal["dev", "production", "cuda", "openvino"] = "production"
    on_boot_failure: Literal["exit", "stay_unready"] = "exit"
    """exit: a failed boot check ends the process with its exit code; stay_unready: keep serving /ready 503."""
    matrix_file: str = "matrix.toml"
    """Version matrix, relative to configs/ unless absolute."""
    runtime: RuntimeSettings = RuntimeSettings()
    signature: SignatureThresholds = SignatureThresholds()
    server: ServerSettings = ServerSettings()
    limits: Limits = Limits()
    defaults: Defaults = Defaults()
    serving: Serving = Serving()
    selftest: SelfTestSettings = SelfTestSettings()
    watchdog: WatchdogSettings = WatchdogSettings()
    queue: QueueSettings = QueueSettings()
    auth: AuthSettings = AuthSettings()
    debug: DebugSettings = DebugSettings()
    api: ApiSettings = ApiSettings()
    provenance: ProvenanceSettings = ProvenanceSettings()
    cache: CacheSettings = CacheSettings()
    family_defaults: dict[str, Defaults] = {}
    """Request defaults per model family ([family_defaults.turbo], [family_defaults.sdxl], ...), used instead of
    [defaults] when the served model is of that family. Turbo has built-in ones (1 step, guidance 0)."""

    def defaults_for(self, family: str) -> Defaults:
        """The request defaults for a model of ``family``: the profile's table for it, else the built-in one,
        else [defaults]. Built-in ones exist where [defaults] would be wrong for the family (engines/families.py
        ``own_defaults``): few-step (Turbo) models are distilled for 1-4 steps without CFG (their model cards: 1
        step, guidance 0); the flow-matching DiT families sample with Euler at their model cards' steps and guidance
        (Flux dev 28 / 3.5 embedded, schnell 4 / none, SD 3 28 / 7.0, SD 3.5 28 / 4.5)."""
        own = families.REGISTRY.get(family)
        built_in = Defaults(steps=own.steps, guidance_scale=own.guidance, scheduler=own.scheduler) \
            if own is not None and own.own_defaults else None
        return self.family_defaults.get(family) or built_in or self.defaults

    @model_validator(mode="after")
    def _cross(self) -> Settings:
        if self.profile in GPU_PROFILES and self.runtime.allow_cpu:
            raise ValueError(f"{self.profile} profile with runtime.allow_cpu = true: {self.profile} never runs on "
                             "the CPU; use the dev profile")
        if self.debug.fault_injection and self.profile != "dev":
            raise ValueError("debug.fault_injection is allowed in the dev profile only")
        if self.defaults.steps > self.limits.max_steps:
            raise ValueError(f"defaults.steps {self.defaults.steps} exceeds limits.max_steps {self.limits.max_steps}")
        for family, defaults in self.family_defaults.items():
            if family not in families.REGISTRY:
                raise ValueError(f"family_defaults.{family}: unknown family; expected one of "
                                 f"{list(families.REGISTRY)}")
            if defaults.steps > self.limits.max_steps:
                raise ValueError(f"family_defaults.{family}.steps {defaults.steps} exceeds limits.max_steps "
                                 f"{self.limits.max_steps}")
        return self


def _env_overrides(data: dict[str, object]) -> dict[str, object]:
    server = dict(data.get("server", {}))  # type: ignore[call-overload]
    runtime = dict(data.get("runtime", {}))  # type: ignore[call-overload]
    if f"{ENV_PREFIX}HOST" in os.environ:
        server["host"] = os.environ[f"{ENV_PREFIX}HOST"]
    if f"{ENV_PREFIX}PORT" in os.environ:
        server["port"] = os.environ[f"{ENV_PREFIX}PORT"]
    if f"{ENV_PREFIX}DEVICE_ID" in os.environ:
        runtime["device_id"] = os.environ[f"{ENV_PREFIX}DEVICE_ID"]
    if os.environ.get(f"{ENV_PREFIX}LORA_DIR"):
        runtime["lora"] = {**runtime.get("lora", {}), "dir": os.environ[f"{ENV_PREFIX}LORA_DIR"]}
    if os.environ.get(f"{ENV_PREFIX}CONTROLNET_DIR"):
        runtime["controlnet"] = {**runtime.get("controlnet", {}), "dir": os.environ[f"{ENV_PREFIX}CONTROLNET_DIR"]}
    auth = dict(data.get("auth", {}))  # type: ignore[call-overload]
    if os.environ.get(f"{ENV_PREFIX}API_KEYS_SHA256"):
        extra = [d.strip() for d in os.environ[f"{ENV_PREFIX}API_KEYS_SHA256"].split(",") if d.strip()]
        auth["api_key_sha256"] = [*auth.get("api_key_sha256", []), *extra]
    return {**data, "server": server, "runtime": runtime, "auth": auth,
            "provenance": _provenance_env(dict(data.get("provenance", {})))}  # type: ignore[call-overload]


def _provenance_env(provenance: dict[str, object]) -> dict[str, object]:
    """Deployment overrides of [provenance]: the key and chain files, and a stricter mode (never a looser one)."""
    for field in ("key_file", "chain_file"):
        if os.environ.get(f"{ENV_PREFIX}PROVENANCE_{field.upper()}"):
            provenance[field] = os.environ[f"{ENV_PREFIX}PROVENANCE_{field.upper()}"]
    wanted = os.environ.get(f"{ENV_PREFIX}PROVENANCE_MODE")
    if wanted:
        current = str(provenance.get("mode", "off"))
        if wanted not in PROVENANCE_MODES or PROVENANCE_MODES.index(wanted) < PROVENANCE_MODES.index(current):
            raise ConfigError(f"{ENV_PREFIX}PROVENANCE_MODE={wanted!r}: the environment may raise [provenance] mode "
                              f"{current!r} to a stricter one ({', '.join(PROVENANCE_MODES)}), never lower it")
        provenance["mode"] = wanted
    return provenance


def load_settings(profile: str = "production", config: Path | None = None) -> Settings:
    """Load ``config`` or ``configs/<profile>.toml``; raises ConfigError naming the file and the field."""
    path = config or CONFIG_DIR / f"{profile}.toml"
    data = read_toml(path, "profile file", " (profiles: dev, production, openvino)")
    if config is None and data.get("profile", profile) != profile:
        raise ConfigError(f"{path} declares profile {data.get('profile')!r}, expected {profile!r}")
    try:
        return Settings.model_validate(_env_overrides(data))
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"{path}: {problems}") from None

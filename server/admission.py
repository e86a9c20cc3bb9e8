"""Admission by cost: a request's compute is estimated before it is queued, from measured seconds per stage at its
shape (the boot self-test, then live batches): images x (encode + steps x step + decode), each stage learned on its
own so requests of few steps (whose encode and decode dominate) do not inflate another's per-step cost. A request
that cannot finish before its deadline even alone is refused at once (4xx naming the deadline and the estimate); one
that could, but not behind the work the scheduler would run before it (``Batcher.ahead_seconds``), gets a prompt
429 with Retry-After. Nothing is computed to be thrown away.

The model is general over what a job costs (size x steps x images), so edits (img2img, inpainting: fewer steps
by their strength) go through the same door.

Admission by memory: each batch's peak working memory is estimated by the engine from its size, its images, the
images it may share a denoiser call with (``[queue] max_batch``) and its stages (engines.types.model.MemoryModel);
a batch whose estimate exceeds the memory budget (``[limits] memory_budget_mb``, else measured at boot:
``memory_budget``) is refused at once with a 4xx naming the budget, the estimate and the field to lower, instead
of growing the process into the OOM killer or a failed allocation."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engines.errors import InvalidRequestError
from engines.types.health import GpuSample
from engines.types.model import MemoryModel, MemoryNeed
from engines.types.request import Batch, Timings
from server.errors import QueueFullError

ALPHA = 0.3
"""EWMA weight of a new live sample (per-image stage seconds at one size)."""


@dataclass(frozen=True)
class Cost:
    """What a job asks of the engine."""

    width: int
    height: int
    steps: int
    images: int
    tokens: int = 0
    """An instruction edit's reference tokens in each denoiser row (ModelInfo.reference_tokens): a step costs
    the work of the longer sequence."""

    @property
    def size(self) -> str:
        return f"{self.width}x{self.height}"


@dataclass(frozen=True)
class Estimate:
    seconds: float
    per_image_step_s: float
    basis: str
    """"measured at 64x64" or "scaled from 64x64 by pixel count" (a lower bound: attention grows faster)."""


Key = tuple[int, ...]
"""(width, height), or (width, height, reference tokens) for an instruction edit: what the cost tables are measured
by (an edit's step runs a longer sequence than a generation's of the same size, so it is learned apart and never
inflates it)."""


def _key(width: int, height: int, tokens: int = 0) -> Key:
    return (width, height, tokens) if tokens else (width, height)


def input_sizes(batch: Batch) -> tuple[tuple[int, int], ...]:
    """An instruction edit's input images' (width, height) as sent (its first edit's: a batch is one request's
    input); () for any other batch."""
    edit = next((s.edit for s in batch.images if s.edit is not None and s.edit.references), None)
    return tuple((ref.shape[1], ref.shape[0]) for ref in edit.references) if edit is not None else ()


class CostModel:
    """Seconds per stage by size and reference tokens: per image-step (the denoiser), per image encoded (text
    encoders and an edit's image encode) and per image decoded. Seeded from the self-test (p50 of its timed canaries
    over batch x steps, text encoding and decoding folded into the step cost, so conservative; its edit canary seeds
    the edits' shape), then an EWMA per stage of live batches at that key, from their stage timings (a batch without
    them folds its total into the step cost, as the seed)."""

    def __init__(self, work: Callable[..., float] | None = None, basis: str = "pixel count") -> None:
        self.per_image_step: dict[Key, float] = {}
        self.per_image_encode: dict[Key, float] = {}
        """Seconds to encode one image's prompt (and an edit's init image); 0 where only folded totals came."""
        self.per_image_decode: dict[Key, float] = {}
        """Seconds to decode one image; 0 where only folded totals came."""
        self.work = work or (lambda w, h, tokens=0: float(w * h))
        """Relative compute of one step at a size and its reference tokens (engines.types.model.ModelInfo.work):
        what an unmeasured key's cost is scaled by from the nearest measured one."""
        self.basis = basis
        self.reference_tokens: Callable[[tuple[tuple[int, int], ...]], int] = lambda sizes: 0
        """The loaded model's reference tokens from an edit's input sizes (ModelInfo.reference_tokens)."""

    def scale_by(self, work: Callable[..., float], basis: str,
                 reference_tokens: Callable[[tuple[tuple[int, int], ...]], int] | None = None) -> None:
        """The loaded model's work per step (set once the engine is loaded: a DiT scales by its tokens) and its
        instruction edits' reference tokens."""
        self.work, self.basis = work, basis
        if reference_tokens is not None:
            self.reference_tokens = reference_tokens

    def cost_of(self, batch: Batch, steps: int | None = None, images: int | None = None) -> Cost:
        """``batch`` as a Cost (its steps and images unless given), with its reference tokens."""
        return Cost(batch.width, batch.height, batch.steps if steps is None else steps,
                    len(batch.images) if images is None else images, self.reference_tokens(input_sizes(batch)))

    def seed(self, width: int, height: int, batch: int, steps: int, seconds: float, tokens: int = 0) -> None:
        if seconds > 0 and batch > 0 and steps > 0 and _key(width, height, tokens) not in self.per_image_step:
            self.per_image_step[_key(width, height, tokens)] = seconds / (batch * steps)

    def observe(self, cost: Cost, seconds: float, timings: Timings | None = None) -> None:
        """A live batch of ``cost`` (steps: those that ran) took ``seconds``; ``timings``: its stages, learned each
        on its own when its denoise was timed (else ``seconds`` is folded into the step cost)."""
        if seconds <= 0 or cost.steps <= 0 or cost.images <= 0:
            return
        key = _key(cost.width, cost.height, cost.tokens)
        if timings is None or timings.denoise <= 0:
            _ewma(self.per_image_step, key, seconds / (cost.steps * cost.images))
            return
        _ewma(self.per_image_step, key, timings.denoise / (cost.steps * cost.images))
        _ewma(self.per_image_encode, key, (timings.text_encoder + timings.vae_encode) / cost.images)
        _ewma(self.per_image_decode, key, timings.vae_decode / cost.images)

    def observe_step(self, width: int, height: int, images: int, seconds: float, tokens: int = 0) -> None:
        """One live denoising step of ``images`` images at this size took ``seconds`` (a step-batching tick): the
        step cost is learned as requests run, so a size's first request is priced from its own ticks after one,
        not for its whole run from another size's seed scaled by work (the self-test canaries fold text encoding
        and decoding into their step cost: at 256x256 scaled from 64x64 that was ~4.5x the real step on the CPU,
        enough to rank large jobs urgent under the deadline guard on a guess). ``tokens``: the tick's reference
        tokens per row (rows of one tick share them: flow_extra groups rows by their extra tokens)."""
        if seconds > 0 and images > 0:
            _ewma(self.per_image_step, _key(width, height, tokens), seconds / images)

    def estimate(self, cost: Cost) -> Estimate | None:
        """None until anything was measured (then nothing is refused on a guess)."""
        if not self.per_image_step:
            return None
        key = _key(cost.width, cost.height, cost.tokens)
        if key in self.per_image_step:
            per, ratio, basis = self.per_image_step[key], 1.0, f"measured at {_label(key)}"
        else:
            target = self.work(*key)
            key = min(self.per_image_step, key=lambda k: abs(math.log(self.work(*k) / target)))
            ratio = target / self.work(*key)
            per, basis = self.per_image_step[key] * ratio, f"scaled from {_label(key)} by {self.basis}"
            if cost.tokens:
                basis += f", to {cost.tokens} reference tokens"
        ends = (self.per_image_encode.get(key, 0.0) + self.per_image_decode.get(key, 0.0)) * ratio
        return Estimate(cost.images * (ends + cost.steps * per), per, basis)

    def stages(self) -> dict[str, dict[str, float]]:
        """Seconds per image by stage and size (``step``: per image-step), as /performance may show them."""
        return {name: {_label(k): round(s, 6) for k, s in sorted(table.items())}
                for name, table in (("encode", self.per_image_encode), ("step", self.per_image_step),
                                    ("decode", self.per_image_decode))}

    def total(self, costs: Iterable[Cost]) -> float:
        return sum(e.seconds for e in map(self.estimate, costs) if e is not None)

    def snapshot(self) -> dict[str, float]:
        return {_label(k): round(s, 6) for k, s in sorted(self.per_image_step.items())}


def _label(key: Key) -> str:
    """``WxH``, with `` + N reference tokens`` for an instruction edit's key."""
    w, h, *tokens = key
    return f"{w}x{h}" + (f" + {tokens[0]} reference tokens" if tokens and tokens[0] else "")


def _ewma(table: dict[Key, float], key: Key, sample: float) -> None:
    old = table.get(key)
    table[key] = sample if old is None else (1 - ALPHA) * old + ALPHA * sample


def admit(model: CostModel, costs: list[Cost], ahead_s: float, remaining_s: float, source: str) -> None:
    """Refuse ``costs`` (one request: one job, or an A1111 run's n_iter jobs) that cannot finish in
    ``remaining_s``: alone (InvalidRequestError: the client must ask for less) or behind ``ahead_s`` of work
    already admitted (QueueFullError: 429, retry after that work)."""
    estimates = [e for e in map(model.estimate, costs) if e is not None]
    if not estimates:
        return
    own = sum(e.seconds for e in estimates)
    first, c = estimates[0], costs[0]
    images = sum(x.images for x in costs)
    if own > remaining_s:
        raise InvalidRequestError(
            f"estimated compute {own:.1f}s ({images} image(s) of {c.size} at {c.steps} steps, "
            f"{first.per_image_step_s * 1000:.1f} ms per image-step {first.basis}) exceeds the request deadline "
            f"{remaining_s:.1f}s ({source}): ask for fewer steps, images or a smaller size, or a longer deadline",
            param="steps")
    if ahead_s + own > remaining_s:
        raise QueueFullError(f"estimated wait {ahead_s:.1f}s for the work queued ahead plus {own:.1f}s of compute "
                             f"exceeds the request deadline {remaining_s:.1f}s ({source}): retry later",
                             max(1, math.ceil(ahead_s)))


# ---- memory ---------------------------------------------------------------------------------------------------

GIB = 1 << 30
FIELDS = {"size": "size (A1111: width, height)", "n": "n (A1111: batch_size)"}
"""How a refusal names the field to lower, on both APIs (the param is the OpenAI route's name)."""
HIRES_FIELDS = ("Hires fix target (size, where [serving] openai_sizes_hires serves it through Hires fix; A1111: "
                "hr_scale, or hr_resize_x / hr_resize_y)")
CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))
"""cgroup v2, then v1: the container's memory limit ("max", or v1's page-rounded huge number: none)."""


@dataclass(frozen=True)
class MemoryBudget:
    """What one batch's working memory may take; ``bytes`` None: unknown (nothing is refused on memory)."""

    bytes: int | None = None
    source: str = "not measured"


@dataclass(frozen=True)
class MemoryAsk:
    """One batch as memory admission sees it, with the request fields that set its size and its image count."""

    width: int
    height: int
    images: int
    denoise_images: int
    """Images in the denoiser call it may run in: its own, or ``[queue] max_batch`` shared with others."""
    decode_images: int
    """Images through the text encoders and the VAE with it (its own under step-level batching)."""
    encode: bool = False
    references: tuple[tuple[int, int], ...] = ()
    """An instruction edit's input images as the model encodes them (ModelInfo.references)."""
    size_param: str = "size"
    count_param: str = "n"
    second_pass: bool = False
    """A Hires fix second pass (at the target size): the target is what to lower."""
    controls: int = 0
    """The batch's ControlNet units: their residuals join the denoiser's memory (MemoryModel.need ``controls``)."""


def host_limit() -> tuple[int, str]:
    """The memory this process's container may use: its cgroup limit when one is set, else the host's RAM."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in CGROUP_LIMITS:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < total:
            return int(text), f"the cgroup memory limit ({path.name})"
    return total, "the host's RAM"


def resident_bytes() -> int:
    """This process's resident memory now (/proc/self/statm), 0 where there is no /proc."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def memory_budget(setting_mb: int, device: str, sample: GpuSample | None) -> MemoryBudget:
    """The budget: the setting when non-zero; else on a GPU what NVML says is free after boot (the sessions and
    the warmed arena hold the rest), on the CPU the container's limit less what this process holds after boot."""
    if setting_mb:
        return MemoryBudget(setting_mb << 20, "[limits] memory_budget_mb")
    if device == "cuda":
        if sample is None or sample.memory_total_bytes <= 0:
            return MemoryBudget(None, "no NVML memory reading: set [limits] memory_budget_mb")
        free = max(0, sample.memory_total_bytes - sample.memory_used_bytes)
        return MemoryBudget(free, f"device memory free after boot ({_gib(sample.memory_used_bytes)} of "
                                  f"{_gib(sample.memory_total_bytes)} in use)")
    limit, where = host_limit()
    held = resident_bytes()
    return MemoryBudget(max(0, limit - held), f"{where} {_gib(limit)} less this process's {_gib(held)} after boot")


def admit_memory(model: MemoryModel | None, budget: MemoryBudget, asks: Iterable[MemoryAsk]) -> None:
    """Refuse (InvalidRequestError) the first batch of a request whose estimated peak exceeds ``budget``; the
    param names its image count when fewer images would fit, else its size."""
    if model is None or budget.bytes is None:
        return
    for ask in asks:
        need = model.need(ask.width, ask.height, ask.denoise_images, ask.decode_images, ask.encode, **_refs(ask))
        if need.peak_bytes > budget.bytes:
            raise InvalidRequestError(_memory_message(ask, need, budget), param=_culprit(model, budget, ask))


def _culprit(model: MemoryModel, budget: MemoryBudget, ask: MemoryAsk) -> str:
    """The count when the same size with one image (in the call it may share) fits, else the size."""
    if ask.images <= 1:
        return ask.size_param
    one = model.need(ask.width, ask.height, max(1, ask.denoise_images - ask.images + 1),
                     max(1, ask.decode_images - ask.images + 1), ask.encode, **_refs(ask))
    return ask.count_param if budget.bytes is not None and one.peak_bytes <= budget.bytes else ask.size_param


def _refs(ask: MemoryAsk) -> dict[str, Any]:
    """``references`` and ``controls`` for MemoryModel.need, each named only when there are any (a memory model of
    a family without instruction edits or ControlNet may not take them)."""
    return {**({"references": ask.references} if ask.references else {}),
            **({"controls": ask.controls} if ask.controls else {})}


def _memory_message(ask: MemoryAsk, need: MemoryNeed, budget: MemoryBudget) -> str:
    shared = (f"; it may share a denoiser call of {ask.denoise_images} images with other requests ([queue] "
              "max_batch)" if ask.denoise_images > ask.images else "")
    what = "the Hires fix second pass of " if ask.second_pass else ""
    size = HIRES_FIELDS if ask.second_pass else FIELDS.get(ask.size_param, ask.size_param)
    return (f"estimated peak memory {_gib(need.peak_bytes)} for {what}{ask.images} image(s) at "
            f"{ask.width}x{ask.height} ({need.stage}: {need.why}{shared}) exceeds this server's memory budget "
            f"{_gib(budget.bytes or 0)} ({budget.source}): ask for a smaller {size} or fewer images: "
            f"{FIELDS.get(ask.count_param, ask.count_param)}")


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"

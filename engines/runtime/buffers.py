"""Device buffers, host staging and the shared ORT arenas a Runtime binds its sessions' inputs and outputs to."""

from __future__ import annotations

import logging
import math
import threading
from collections import OrderedDict, deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import onnxruntime as ort

from engines.config import RuntimeSettings
from engines.runtime.pinned import HostAllocator, PageableAllocator, PinnedAllocator
from engines.types.model import MemoryModel

log = logging.getLogger(__name__)
MAX_CACHED = 256
"""The least each cache (device buffers, host staging, per-step tables) keeps per (tag, shape, dtype); least
recently used go first. The bound is ``cache_entries(max_running)``, never less than this."""
ENTRIES_PER_REQUEST = 16
"""Entries one running request holds in one cache under its scope (Runtime.scoped): measured on the tiny model
9-11 device buffers (latents pair, history ring, UNet input and output, text embeddings, noise) and 3 step
tables; the step cache adds 4 comparison buffers, an edit its image and mask. Host staging holds one per upload
tag and table on a GPU."""
CACHE_HEADROOM = 64
"""Entries outside any request's scope: the joined rows (rows_*), decode buffers, the text encoders' outputs."""
MAX_CACHED_BYTES = 256 << 20
"""The most bytes the three caches of one device (device buffers, host staging, per-step tables) hold together,
counted from each entry's shape and dtype (a pinned staging buffer as much as a device one); least recently used
entries go first, across the caches. A running request's buffers it still holds stay alive when evicted (only
the cache's reference goes), so the bound is on what the process keeps between requests: without it every
distinct size served left its staging and buffers behind (up to ``cache_entries`` of each, ~3.6 MB per size on
the tiny model, ~11 MB at 1024x1024 pinned on a GPU). The entry just asked for is never evicted: the held bytes
exceed the bound only by it, when it alone is larger."""
DEFAULT_MAX_RUNNING = 32
"""The scheduler's default ``queue.max_running`` (server/settings.py): the cache size a Runtime built without the
configured value is planned for."""


def cache_entries(max_running: int) -> int:
    """The entries each cache keeps: every running request's (max_running x ENTRIES_PER_REQUEST) and the unscoped
    ones, so a full running set never evicts a buffer it still uses (an evicted pinned staging buffer is freed with
    cudaFreeHost and allocated again with cudaHostAlloc on the next step: both synchronize the device)."""
    return max(MAX_CACHED, max_running * ENTRIES_PER_REQUEST + CACHE_HEADROOM)


NO_SYNC = "disable_synchronize_execution_providers"
"""RunOptions entry (include/onnxruntime/core/session/onnxruntime_run_options_config_keys.h,
kOrtRunOptionsConfigDisableSynchronizeExecutionProviders): "1" and the run does not synchronize the execution
providers at its end (InferenceSession::Run passes sync_stream = false to each provider's OnRunEnd; for the CUDA
provider: no cudaStreamSynchronize on its compute stream). Set only inside ``one_tick`` on a shared stream."""


def gpu_mem_limit(settings: RuntimeSettings, total_memory: int | None) -> int | None:
    """The CUDA arena cap in bytes: gpu_mem_limit_fraction of the device's total (from preflight's NVML reading);
    None when the total is unknown (no NVML), and ORT's default (no cap) applies."""
    return int(total_memory * settings.cuda.gpu_mem_limit_fraction) if total_memory else None


STRATEGY = {"kNextPowerOfTwo": 0, "kSameAsRequested": 1}
"""ArenaExtendStrategy's values (include/onnxruntime/core/framework/arena_extend_strategy.h)."""
_DEVICE_ARENAS: dict[int, dict[str, Any]] = {}
_ARENA_LOCK = threading.Lock()


def device_arena(settings: RuntimeSettings, total_memory: int | None) -> dict[str, Any]:
    """The process's one CUDA arena, registered once per device with ORT's environment (before any device
    OrtValue exists): ``max_mem`` is gpu_mem_limit (0: ORT's "no limit", when NVML gave no total), the extend
    strategy the profile's. Why: ``OrtValue.ortvalue_from_shape_and_type(..., "cuda")`` takes the environment's
    shared allocator when one is registered and otherwise the binding's static per-device arena, created with no
    cap and kNextPowerOfTwo (onnxruntime/python/onnxruntime_pybind_ortvalue.cc, GetCudaAllocator in
    onnxruntime_pybind_state.cc); and a session's device allocations come from its first provider's arena unless
    ``session.use_env_allocators`` swaps in the environment's (UpdateAllocatorsWithEnvAllocators,
    session_state.cc). The result (registered or why not) is shown in /capabilities; TensorRT's engine memory
    stays outside every ORT arena."""
    c = settings.cuda
    with _ARENA_LOCK:
        found = _DEVICE_ARENAS.get(settings.device_id)
        if found is not None:
            return found
        limit = gpu_mem_limit(settings, total_memory) or 0
        state: dict[str, Any] = {"registered": False, "max_mem_bytes": limit,
                                 "arena_extend_strategy": c.arena_extend_strategy, "error": ""}
        if c.shared_arena:
            cfg = ort.OrtArenaCfg({"max_mem": limit, "arena_extend_strategy": STRATEGY[c.arena_extend_strategy]})
            info = ort.OrtMemoryInfo("Cuda", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, settings.device_id,
                                     ort.OrtMemType.DEFAULT)
            try:
                ort.create_and_register_allocator_v2("CUDAExecutionProvider", info, {}, cfg)
                state["registered"] = True
            except Exception as exc:  # no CUDA provider library here: the sessions will say so too
                state["error"] = " ".join(str(exc).split())[-300:]
                log.warning("the shared CUDA arena was not registered: %s", state["error"])
        else:
            state["error"] = "runtime.cuda.shared_arena is off"
        _DEVICE_ARENAS[settings.device_id] = state
        return state


_HOST_ARENA: dict[str, Any] = {}
SHRINK = "memory.enable_memory_arena_shrinkage"
"""RunOptions entry (include/onnxruntime/core/session/onnxruntime_run_options_config_keys.h): after the run, the
listed arenas free every region none of whose chunks is in use (InferenceSession::ShrinkMemoryArenas in
onnxruntime/core/session/inference_session.cc). A device listed without an arena fails the run before it
executes ("Did not find an arena based allocator registered"): ``Runtime.run`` retries it without."""
TRIM_ABOVE_BYTES = 256 << 20
"""A batch whose estimated working memory (engines/health/request_memory.py) reaches this is large: the arena is
shrunk after each of its large stages, so the memory a 1024x1792 request took goes back instead of staying held by
the process, and the next stage starts from what is in use (the arena's regions of one stage seldom fit the next
one's tensors: without a shrink between them the process holds their sum)."""
TRIM_AFTER = {"vae_encoder": "latent", "unet": "first", "vae_scale": "latent", "flow_decode": "latent",
              "vae_decoder": "image"}
"""The runs after which a large batch's arena is shrunk: the VAE encoder (edits); the UNet's first run at a new
shape (ORT plans that shape's memory pattern during it and allocates the pattern as one new block at the next run,
so the first run's regions would stay beside it, doubling the denoiser's hold); the scale graph every decode
starts with (the denoiser is done); the VAE decoder (the batch is done). Value: how the first output's shape reads,
``image`` [n, 3, H, W], else latent pixels [n or rows, C, h, w]."""


def host_arena() -> dict[str, Any]:
    """The process's one CPU arena, registered once with ORT's environment and shared by every CPU session
    (``session.use_env_allocators``), as the CUDA one is (``device_arena``): each session's own arena would keep
    its largest request's activations for good, so the process would hold the sum of every component's peak; one
    arena holds the largest stage, and one shrink after a large batch's decode returns it all."""
    with _ARENA_LOCK:
        if not _HOST_ARENA:
            info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
            try:
                ort.create_and_register_allocator(info, ort.OrtArenaCfg(0, -1, -1, -1))  # ORT's defaults
                _HOST_ARENA.update(registered=True, error="")
            except Exception as exc:  # e.g. registered already by another library in this process
                _HOST_ARENA.update(registered=False, error=" ".join(str(exc).split())[-300:])
                log.warning("the shared CPU arena was not registered: %s", _HOST_ARENA["error"])
        return _HOST_ARENA


MAX_HOST_READS = 256
_Key = tuple[str, tuple[int, ...], str]
"""A cache entry: (scope + tag, shape, dtype name)."""


@dataclass(frozen=True)
class HostRead:
    """One host->device copy: what it was for, and the host memory it read (address, bytes)."""

    tag: str
    address: int
    nbytes: int


class DeviceBuffers:
    """The device tensors, host staging and per-step tables one device's sessions are bound to, reused per (scope,
    tag, shape, dtype); and the run that shrinks the shared arena after a large batch's large stages."""

    def __init__(self, device: str, device_id: int, max_cached: int = MAX_CACHED,
                 max_cached_bytes: int = MAX_CACHED_BYTES) -> None:
        self.device = device
        self.device_id = device_id
        self.max_cached = max_cached
        """Entries each cache keeps (``cache_entries`` of the engine's max_running)."""
        self.max_cached_bytes = max_cached_bytes
        """Bytes the three caches hold together (MAX_CACHED_BYTES)."""
        self.evicted = {"buffers": 0, "staging": 0, "tables": 0}
        """Entries each cache has evicted (churn): stays 0 while the running set fits ``max_cached``."""
        self.held = {"buffers": 0, "staging": 0, "tables": 0}
        """Bytes each cache holds now (its entries' shapes x dtype sizes)."""
        self._order: OrderedDict[tuple[str, _Key], int] = OrderedDict()
        """Every cached entry's bytes, least recently used first, across the three caches."""
        self.stream: Stream | None = None
        """The one stream every session of this runtime runs on (a ComputeStream on CUDA with
        runtime.cuda.shared_compute_stream, the HostStream on the CPU provider); None: each session on its own
        stream, so every run must synchronize."""
        self.syncs = SyncCounter()
        """Synchronisations issued (or, on the CPU, that the code would issue): per run, per tick."""
        self._tick: _Tick | None = None
        self._no_sync: ort.RunOptions | None = None
        self._host: HostAllocator | None = None
        self._staging: OrderedDict[_Key, tuple[np.ndarray, ort.OrtValue]] = OrderedDict()
        self._buffers: OrderedDict[_Key, ort.OrtValue] = OrderedDict()
        self._tables: OrderedDict[_Key, list[ort.OrtValue]] = OrderedDict()
        self.host_reads: deque[HostRead] = deque(maxlen=MAX_HOST_READS)
        """The host memory each host->device copy read from, newest last (accept's staging check reads it)."""
        self.arena: dict[str, Any] = {}
        """The shared device arena's state (device_arena), empty off CUDA."""
        self.host_arena: dict[str, Any] = {}
        """The shared CPU arena's state (host_arena), empty on a GPU or a plugin EP."""
        self.memory: MemoryModel | None = None
        """The model's request memory (set by the engine once loaded): which batches are large enough to trim."""
        self._trim = True
        """Off once a shrink was refused (no arena where the run options named one): never asked again."""
        self._shapes: dict[str, list[int]] = {}
        """The last output shape of each TRIM_AFTER ``first`` component."""
        self.scope = ""
        """Prefix of every buffer, staging and table tag (``scoped``): requests denoised side by side (step-level
        batching) each keep their own device state under their own scope."""

    @contextmanager
    def scoped(self, scope: str) -> Iterator[None]:
        """Tags inside the block name buffers of ``scope`` only: one running request's latents, history, UNet
        input and output never share memory with another's of the same shape. Not thread-safe: the engine runs
        one call at a time (its lock)."""
        outer, self.scope = self.scope, scope
        try:
            yield
        finally:
            self.scope = outer

    def buffer(self, tag: str, shape: tuple[int, ...], dtype: type[np.generic]) -> ort.OrtValue:
        """A device tensor reused across steps and requests of the same shape and scope (bounded LRU; a buffer
        still held by a running request stays alive after it leaves the cache)."""
        key = (self.scope + tag, shape, np.dtype(dtype).name)
        value = self._buffers.get(key)
        if value is None:
            value = ort.OrtValue.ortvalue_from_shape_and_type(list(shape), dtype, self.device, self.device_id)
            self._buffers[key] = value
            self._hold("buffers", key, math.prod(shape) * np.dtype(dtype).itemsize)
        else:
            self._touch("buffers", key)
        return value

    @property
    def host(self) -> HostAllocator:
        """Pinned on a GPU (created on first use, so a failed GPU boot never touches libcudart), pageable on CPU."""
        if self._host is None:
            self._host = PinnedAllocator(self.device_id) if self.device == "cuda" else PageableAllocator()
        return self._host

    def staging(self, tag: str, shape: tuple[int, ...], dtype: type[np.generic]) -> tuple[np.ndarray, ort.OrtValue]:
        """A host array (pinned on a GPU) and a CPU OrtValue over the same memory, reused per shape. Bound as an
        output, ORT copies the device result straight into it; as a copy source it feeds update_inplace."""
        key = (self.scope + tag, shape, np.dtype(dtype).name)
        found = self._staging.get(key)
        if found is None:
            array = self.host.empty(shape, dtype)
            found = self._staging[key] = (array, ort.OrtValue.ortvalue_from_numpy(array))
            self._hold("staging", key, int(array.nbytes))  # bounded like the device buffers; pinned memory is freed
        else:
            self._touch("staging", key)
        return found

    def staged(self, tag: str, shape: tuple[int, ...], dtype: type[np.generic]) -> np.ndarray | None:
        """The host staging array the pipeline used for (tag, shape, dtype), or None when it never staged one:
        a check of what was bound must not create what it checks (``staging`` would allocate a fresh buffer)."""
        found = self._staging.get((self.scope + tag, shape, np.dtype(dtype).name))
        return found[0] if found is not None else None

    def upload(self, tag: str, array: np.ndarray) -> ort.OrtValue:
        """Copy a host array into the reusable device buffer ``tag``; on a GPU through a pinned staging buffer."""
        value = self.buffer(tag, tuple(array.shape), array.dtype.type)
        source = self._host_source(tag, array)
        value.update_inplace(source)
        self.note_host_read(tag, source)
        return value

    def _host_source(self, tag: str, array: np.ndarray) -> np.ndarray:
        """What a copy to the device reads: the array itself on the CPU, a pinned staging copy on a GPU."""
        if self.device == "cpu":
            return np.ascontiguousarray(array)
        stage, _ = self.staging(tag, tuple(array.shape), array.dtype.type)
        np.copyto(stage, array)
        return stage

    def upload_steps(self, tag: str, table: np.ndarray) -> list[ort.OrtValue]:
        """One device tensor per row of ``table`` (per-step scalars: timestep, coefficients, scale), all copied at
        once before the loop, so the steps bind device values instead of copying host arrays every step. Reused
        per (tag, shape, dtype) like ``buffer``; the rows go up from one (pinned, on a GPU) staging copy."""
        key = (self.scope + tag, tuple(table.shape), np.dtype(table.dtype).name)
        values = self._tables.get(key)
        if values is None:
            values = [ort.OrtValue.ortvalue_from_shape_and_type(list(table.shape[1:]), table.dtype.type, self.device,
                                                                self.device_id) for _ in range(len(table))]
            self._tables[key] = values
            self._hold("tables", key, int(table.nbytes))
        else:
            self._touch("tables", key)
        source = self._host_source(tag, table)
        for row, value in enumerate(values):
            value.update_inplace(source[row, ...])
        self.note_host_read(tag, source)
        return values

    @property
    def held_bytes(self) -> int:
        """Bytes the three caches hold together: at most ``max_cached_bytes`` (but for one entry larger alone)."""
        return sum(self.held.values())

    def _caches(self) -> dict[str, OrderedDict[_Key, Any]]:
        return {"buffers": self._buffers, "staging": self._staging, "tables": self._tables}

    def _touch(self, cache: str, key: _Key) -> None:
        self._caches()[cache].move_to_end(key)
        self._order.move_to_end((cache, key))

    def _hold(self, cache: str, key: _Key, nbytes: int) -> None:
        """Count a new entry, then evict: the cache's oldest while it has more than ``max_cached`` entries, the
        oldest of any cache while they hold more than ``max_cached_bytes``; never the new entry."""
        self._order[(cache, key)] = nbytes
        self.held[cache] += nbytes
        entries = self._caches()[cache]
        while len(entries) > self.max_cached:
            self._evict(cache, next(iter(entries)))
        while self.held_bytes > self.max_cached_bytes:
            oldest = next(iter(self._order))
            if oldest == (cache, key):
                break
            self._evict(*oldest)

    def _evict(self, cache: str, key: _Key) -> None:
        """Drop an entry (a buffer a running request still holds stays alive with it); a staging buffer's pinned
        memory is freed: staging is written and read within one call, so no later call holds it."""
        found = self._caches()[cache].pop(key)
        self.held[cache] -= self._order.pop((cache, key))
        self.evicted[cache] += 1
        if cache == "staging":
            self.host.free(found[0])

    def run(self, session: ort.InferenceSession, binding: ort.IOBinding, component: str,
            outputs: dict[str, ort.OrtValue]) -> None:
        """``session.run_with_iobinding``; after the large stages of a large batch (TRIM_AFTER, TRIM_ABOVE_BYTES by
        ``memory`` at the shape of the run's first output) the shared arena is shrunk: the stage is done, so the
        regions it grew are freed at once."""
        defer = self._defers(outputs)
        options = self._trim_options(component, outputs)
        if defer and options is not None:
            options.add_run_config_entry(NO_SYNC, "1")
        elif defer:
            options = self._plain(defer)
        if options is None:
            session.run_with_iobinding(binding)
        else:
            try:
                session.run_with_iobinding(binding, options)
            except Exception as exc:  # ORT refuses the list before running anything: run it plainly, never again
                if "arena" not in str(exc):
                    raise
                self._trim = False
                log.warning("arena shrinkage refused (%s): large requests keep their memory in the arena",
                            " ".join(str(exc).split())[:300])
                session.run_with_iobinding(binding, self._plain(defer))
        self._count_run(defer)

    def _plain(self, defer: bool) -> ort.RunOptions | None:
        """The run options of a run without a trim: NO_SYNC inside a tick on a shared stream (made once), else
        none (ORT's default, which synchronizes)."""
        if not defer:
            return None
        if self._no_sync is None:
            self._no_sync = ort.RunOptions()
            self._no_sync.add_run_config_entry(NO_SYNC, "1")
        return self._no_sync

    def _defers(self, outputs: dict[str, ort.OrtValue]) -> bool:
        """Whether this run may skip its end-of-run synchronize: inside ``one_tick``, on a shared stream, and
        writing no output to host memory (a host output is read right after the run, e.g. the step cache's probe
        scalars: that run synchronizes, which also completes every run deferred before it)."""
        if self._tick is None or self.stream is None:
            return False
        return self.device == "cpu" or all(v.device_name() != "cpu" for v in outputs.values())

    def _count_run(self, deferred: bool) -> None:
        self.syncs.runs += 1
        if self._tick is not None:
            self._tick.runs += 1
        if deferred:
            assert self._tick is not None
            self._tick.pending = True
            return
        self.syncs.total += 1  # the run synchronized its providers (ORT's default)
        if self._tick is not None:
            self._tick.syncs += 1
            self._tick.pending = False  # that synchronize also finished every run enqueued before it

    @contextmanager
    def one_tick(self) -> Iterator[None]:
        """A step-batching tick: on a shared stream its runs skip ORT's per-run synchronize (NO_SYNC) and the
        tick synchronizes once, at its end, before anything reads the results on the host. On separate streams
        (no ``stream``) nothing changes: every run synchronizes, as skipping it would race between streams.
        ``syncs`` counts both (on the CPU, the synchronisations the code issues: one per tick). Nested: the inner
        block joins the outer tick."""
        if self._tick is not None:
            yield
            return
        tick = self._tick = _Tick()
        try:
            yield
        finally:
            self._tick = None
            if tick.pending and self.stream is not None:
                self.stream.synchronize()
                tick.syncs += 1
                self.syncs.total += 1
            self.syncs.ticks += 1
            self.syncs.last_tick_runs, self.syncs.last_tick_syncs = tick.runs, tick.syncs

    def _trim_options(self, component: str, outputs: dict[str, ort.OrtValue]) -> ort.RunOptions | None:
        device = "cpu:0" if self.host_arena.get("registered") else \
            f"gpu:{self.device_id}" if self.arena.get("registered") else ""
        shape = next(iter(outputs.values())).shape() if outputs else []
        if not (self._trim and device and self.memory is not None and component in TRIM_AFTER and len(shape) == 4):
            return None
        if TRIM_AFTER[component] == "first" and self._shapes.get(component) == shape:
            return None
        self._shapes[component] = shape
        scale = 1 if TRIM_AFTER[component] == "image" else self.memory.factor
        n, height, width = shape[0], shape[2] * scale, shape[3] * scale
        if self.memory.need(width, height, n, n).peak_bytes < TRIM_ABOVE_BYTES:
            return None
        options = ort.RunOptions()
        options.add_run_config_entry(SHRINK, device)
        return options

    def note_host_read(self, tag: str, array: np.ndarray) -> None:
        """Record that a copy to the device read ``array`` (a host feed bound with bind_cpu_input counts too)."""
        self.host_reads.append(HostRead(tag, int(array.ctypes.data), int(array.nbytes)))

    def close(self) -> None:
        self._buffers.clear()
        self._tables.clear()
        self._staging.clear()
        self._order.clear()
        self.held = dict.fromkeys(self.held, 0)
        if self._host is not None:
            self._host.close()
        if self.stream is not None:
            self.stream.close()
            self.stream = None


class Stream(Protocol):
    """What a tick needs of a stream: wait for everything enqueued on it (engines/runtime/pinned.py)."""

    kind: str
    address: int

    def synchronize(self) -> None: ...

    def close(self) -> None: ...


@dataclass
class SyncCounter:
    """Synchronisations of the device's streams with the host, as the code issues them: one per run that ends in
    ORT's synchronize, one per tick that deferred its runs' (``DeviceBuffers.one_tick``)."""

    total: int = 0
    runs: int = 0
    ticks: int = 0
    last_tick_runs: int = 0
    """ORT runs of the last tick (joins, the denoiser, the split, the step graphs, cache probes)."""
    last_tick_syncs: int = 0
    """Synchronisations of the last tick: its runs on separate streams; 1 on a shared stream (more only where a
    run wrote to host memory inside the tick)."""

    def as_dict(self) -> dict[str, int]:
        return {"total": self.total, "runs": self.runs, "ticks": self.ticks, "last_tick_runs": self.last_tick_runs,
                "last_tick_syncs": self.last_tick_syncs}


@dataclass
class _Tick:
    runs: int = 0
    syncs: int = 0
    pending: bool = False
    """Runs since the last synchronize skipped theirs."""

"""LoRA per request: the adapter set is the unit, merged once on the device, cached LRU under a memory budget.

An adapter set is the sorted list of (file sha256, text-encoder multiplier, denoiser multiplier). For a set not in
the cache, every weight it touches is merged on the device (engines/lora/merge.py) into a new tensor; the set's
tensors are bound by name to the LoRA variant sessions of the text encoders and the denoiser (engines/lora/
targets.py) for the batches of that set: the engine hands them down with the call (engines/lora/active.py Adapters).
The base sessions, and a batch without LoRA, bind nothing. A set evicted while a batch runs stays alive until that
batch ends (the batch holds the tensors); eviction only drops the cache's reference.

The budget ([runtime.lora] cache_mb) counts a merge's own memory too, priced from the files' headers before any
factor is read (``merge_bytes``): the factors it reads are held while it runs, the row copies of fused projections,
the merged tensors, and the largest weight's working set (its factors widened to float32 and stacked, the merge
graph's float32 intermediates, the base weight's upload). A set is refused when that peak exceeds the budget, and
cached sets are evicted before a merge until it fits beside them. A refresh is serialized (callers arriving while
one runs share the next one) and incremental (engines/lora/library.py scan: unchanged files are not read again).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import onnx
import onnxruntime as ort

from engines.config import LoraSettings
from engines.errors import InvalidRequestError, ModelLoadError
from engines.lora import keys, library, merge, residual, targets
from engines.lora.active import Weights
from engines.lora.library import LoraFile
from engines.lora.safetensors import LoraFileError, memory_bytes
from engines.types.model import LoraInfo, LoraStats
from engines.types.request import LoraUse, lora_key

if TYPE_CHECKING:
    from engines.runtime.sessions import Runtime


class Model(Protocol):
    """What the manager needs of a component session (engines/pipelines/unet.py OrtModel is one): the LoRA
    rooms stay below the pipelines, which hand their session class in."""

    name: str

    def run(self, feeds: dict[str, Any], outputs: dict[str, ort.OrtValue]) -> None: ...


class MakeModel(Protocol):
    def __call__(self, runtime: Runtime, model: Path | bytes, name: str, fp32: bool = False,
                 extra: dict[str, str] | None = None) -> Model: ...


log = logging.getLogger(__name__)
TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")
DENOISERS = ("unet", "transformer")
HISTORY = 32
F32 = 4
"""Bytes of a float32 value: the merge stacks factors and computes the delta in float32 (engines/lora/merge.py)."""
STACK_COPIES = 3
"""float32 copies of a weight's factors a merge holds at once: ``merge.stack`` keeps each file's widened (and
scaled) factors and their concatenation until it returns (2), and on a GPU the graph's B and A inputs are copied
to the device (1; fed in place on the CPU, priced alike)."""
GRAPH_COPIES = 3
"""float32 tensors of a weight's size the merge graph holds at its peak: the delta, the transposed or reshaped
delta (or, for a float16 weight, W widened), and the float32 sum before the cast back."""
FIRST_MERGE_BYTES_PER_S = 1e9
"""Admission's price of a merge before any ran on this server: 1 GB of weights written per second. A merge reads
W and writes W + s*B@A once (a rank-r GEMM: memory-bound), so a device does tens of GB/s and a CPU core a few;
1 GB/s errs towards refusing a deadline it might have met. Replaced by the measured rate after the first merge."""


@dataclass
class Component:
    """One adaptable session: its targets, their stored values (host; memory-mapped where the model keeps its
    weights as external data), and the variant session that binds them, built only once a file of the library
    adapts the component (no variant, no second copy of the weights, for a component nothing adapts)."""

    name: str
    targets: dict[str, targets.Target]
    base: dict[str, np.ndarray]
    path: Path
    """The component's model.onnx: the variant is built from it when a file first adapts the component."""
    variant: Model | None = None
    required: dict[str, ort.OrtValue] = field(default_factory=dict)
    """Plugin EPs only (the targets are plain inputs there): every target's base value on the device, bound
    under the set's merged tensors."""


@dataclass
class MergedSet:
    weights: dict[str, dict[str, ort.OrtValue]]
    nbytes: int
    seconds: float
    hits: int = 0
    last_used: float = field(default_factory=time.time)



class LoraManager:
    """The library, the adaptable components of one model, and the merged-set cache."""

    def __init__(self, settings: LoraSettings, model_dir: Path, family: str, runtime: Runtime,
                 make_model: MakeModel) -> None:
        self.settings, self.family, self.runtime = settings, family, runtime
        self.folder = Path(settings.dir)
        unet_config = model_dir / "unet" / "config.json"
        self.layers_per_block = int(json.loads(unet_config.read_text()).get("layers_per_block", 2)) \
            if unet_config.is_file() else 2
        """The UNet's, to map kohya's SDXL names in the original block layout (engines/lora/keys.py)."""
        if not self.folder.is_dir():
            raise ModelLoadError(f"[runtime.lora] dir {self.folder} is not a folder (--lora-dir or "
                                 "SDSERVE_LORA_DIR)")
        self._make_model = make_model
        self.components = self._load_components(model_dir)
        kinds = {(t.layout, t.dtype, len(t.shape)) for c in self.components.values() for t in c.targets.values()}
        self._merge: dict[tuple[str, type[np.generic], int], Model] = {
            (layout, dt, rank): make_model(runtime, merge.merge_graph(layout, np.dtype(dt), rank),
                                           f"lora_merge_{layout}_{np.dtype(dt).name}_{rank}d")
            for layout, dt, rank in sorted(kinds, key=str)}
        self._cache: OrderedDict[tuple[tuple[str, float, float], ...], MergedSet] = OrderedDict()
        self._lock = threading.Lock()
        self._refresh_lock = threading.Lock()
        """Held by the one scan running; callers queue on it and share the scan that starts after they asked."""
        self._asked = self._scanned_upto = 0
        self._by_file: dict[str, LoraFile] = {}
        """The last scan's entries by relative path: what the next scan reuses for unchanged files."""
        self.last_scan = library.Scan({})
        self.scans = 0
        self.files: dict[str, LoraFile] = {}
        self._listing: tuple[LoraInfo, ...] = ()
        self.stats = LoraStats()
        self.history: OrderedDict[str, int] = OrderedDict()
        self._residuals: dict[tuple[Path, str], Model] = {}
        """Variants of graphs holding a component's weights (residual_variant), by (path, component)."""
        self.refresh()

    def _load_components(self, model_dir: Path) -> dict[str, Component]:
        """Each adaptable component's targets, from its graph read without external data (no weights are loaded
        for a model that keeps them beside the graph; inline weights are read once and kept as the base)."""
        out = {}
        for name in (*TEXT_ENCODERS, *DENOISERS):
            path = model_dir / name / "model.onnx"
            if not path.is_file() or (name in TEXT_ENCODERS and library.text_encoder_lora_refused(self.family)):
                continue  # a family whose encoders take no LoRA: no targets, a file adapting one is refused
            model = onnx.load(str(path), load_external_data=False)
            found = targets.find(model, self.settings.targets)
            out[name] = Component(name, found, targets.base_weights(model, found, path.parent), path)
            log.info("LoRA: %s has %d adaptable weights (%s)", name, len(found), self.settings.targets)
        return out

    def _ensure_variants(self) -> None:
        """A variant session for every component a usable file of the library adapts, built the first time one
        does (a refresh that adds a text-encoder LoRA builds that encoder's variant then)."""
        wanted = {c for f in self.files.values() if not f.problem for c in f.components}
        for name in sorted(wanted & set(self.components)):
            comp = self.components[name]
            if comp.variant is not None:
                continue
            model = onnx.load(str(comp.path), load_external_data=False)
            external = any(i.data_location == onnx.TensorProto.EXTERNAL for i in model.graph.initializer)
            if not external:
                model = onnx.load(str(comp.path))
            # the variant's protobuf without weights where they are external: ORT reads them beside the model
            extra = {"session.model_external_initializers_file_folder_path": str(comp.path.parent)} \
                if external else None
            as_inputs = self.runtime.settings.plugin is not None
            comp.variant = self._make_model(self.runtime, targets.with_overridable(model, comp.targets, as_inputs),
                                            f"{name}:lora", extra=extra)
            comp.required = {k: self._device(v) for k, v in comp.base.items()} if as_inputs else {}
            log.info("LoRA: variant session for %s built (a file of the library adapts it)", name)

    def residual_variant(self, path: Path, component: str = "unet") -> Model | None:
        """A LoRA variant session of ``path``, a graph holding ``component``'s weights (ControlNet's residual UNet,
        ``unet_controlnet/model.onnx``), that binds ``component``'s merged tensors: its targets renamed to the
        component's initializer names (engines/lora/residual.py), so a set merged once runs on both. None while no
        file of the library adapts the component (no variant of it either); built once, on the first call after
        one does. ModelLoadError when the graph's adaptable weights are not the component's."""
        comp = self.components.get(component)
        if comp is None or comp.variant is None:
            return None
        key = (path, component)
        with self._lock:
            found = self._residuals.get(key)
            if found is not None:
                return found
            model = onnx.load(str(path), load_external_data=False)
            external = any(i.data_location == onnx.TensorProto.EXTERNAL for i in model.graph.initializer)
            if not external:
                model = onnx.load(str(path))
            own = targets.find(model, self.settings.targets)
            renamed = residual.renamed_like(model, own, comp.targets, str(path.parent.name), component)
            extra = {"session.model_external_initializers_file_folder_path": str(path.parent)} if external else None
            as_inputs = self.runtime.settings.plugin is not None  # the base values: comp.required, the same weights
            found = self._make_model(self.runtime, targets.with_overridable(renamed, comp.targets, as_inputs),
                                     f"{path.parent.name}:lora", extra=extra)
            self._residuals[key] = found
            log.info("LoRA: variant session for %s built (takes %s's merged weights)", path.parent.name, component)
            return found

    def _device(self, array: np.ndarray) -> ort.OrtValue:
        value = ort.OrtValue.ortvalue_from_shape_and_type(list(array.shape), array.dtype.type, self.runtime.device,
                                                          self.runtime.device_id)
        value.update_inplace(np.ascontiguousarray(array))
        return value

    def refresh(self) -> list[LoraFile]:
        """Scan the folder again (POST /sdapi/v1/refresh-loras); the merged-set cache keeps sets whose files
        are still there with the same hash. Serialized and coalesced: a caller waits for the running scan, then
        returns the result of one that started after it asked (its own, or one another waiting caller ran), so a
        burst of refreshes costs at most two scans; files unchanged since the last scan are not read again."""
        with self._lock:
            self._asked += 1
            ticket = self._asked
        with self._refresh_lock:
            if self._scanned_upto < ticket:
                with self._lock:
                    covers = self._asked
                self._scan()
                self._scanned_upto = covers
            return list(self.files.values())

    def _scan(self) -> None:
        limits = library.Limits(self.settings.max_header_kb * 1024, self.settings.max_file_mb * 1024 * 1024,
                                self.layers_per_block)
        found = library.scan(self.folder, {n: c.targets for n, c in self.components.items()}, self.family,
                             limits, self._by_file)
        with self._lock:
            self.scans += 1
            self.last_scan, self._by_file, self.files = found, found.by_file, found.files
            self._relist()
            self._ensure_variants()
        log.info("LoRA library scanned: %d files, %d read (%d bytes), %d unchanged", len(found.files), found.read,
                 found.read_bytes, found.reused)

    def _relist(self) -> None:
        """The listing and the cache after ``files`` changed (under ``_lock``): sets whose files are gone, changed
        or refused are dropped."""
        self._listing = tuple(LoraInfo(f.name, f.alias, f.file, f.sha256, f.size, dict(f.metadata), f.problem,
                                       f.components) for f in self.files.values())
        live = {f.sha256 for f in self.files.values() if not f.problem}
        for key in [k for k in self._cache if any(sha not in live for sha, _, _ in k)]:
            del self._cache[key]

    def _stale(self, file: LoraFile, problem: str) -> None:
        """A file found changed at a merge: refused from now on, and read again by the next scan (a change that
        kept the fingerprint cannot keep the old entry)."""
        with self._lock:
            if self.files.get(file.name) is file:
                self.files[file.name] = dataclasses.replace(file, problem=problem, fingerprint=None)
                self._by_file.pop(file.file, None)
                self._relist()

    def listing(self) -> tuple[LoraInfo, ...]:
        """The library as the last scan found it (built once per scan: every request's names are checked
        against it)."""
        return self._listing

    def is_cached(self, uses: tuple[LoraUse, ...]) -> bool:
        uses = tuple(u for u in uses if u.te or u.unet)
        return not uses or lora_key(uses) in self._cache

    def weights(self, uses: tuple[LoraUse, ...]) -> Weights:
        """The set's merged tensors per component (merged now if not cached). InvalidRequestError when a file is
        gone or refused since the request was admitted. A multiplier of 0 leaves its components out, so they run
        on the base sessions: multiplier 0 is the base image exactly."""
        uses = tuple(u for u in uses if u.te or u.unet)
        if not uses:
            return {}
        key = lora_key(uses)
        if key not in self._cache:
            self.require_fits(uses)
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
                found.hits += 1
                found.last_used = time.time()
                self.stats = dataclasses.replace(self.stats, hits=self.stats.hits + 1)
                self._note(key)
                return found.weights
        self._make_room(self.merge_bytes(uses))
        merged = self._merge_set(uses)
        with self._lock:
            self._store(key, merged)
            self._note(key)
        return merged.weights

    def _note(self, key: tuple[tuple[str, float, float], ...]) -> None:
        label = ",".join(f"{sha[:12]}:{te:g}:{unet:g}" for sha, te, unet in key)
        self.history[label] = self.history.pop(label, 0) + 1
        while len(self.history) > HISTORY:
            self.history.popitem(last=False)

    def _store(self, key: tuple[tuple[str, float, float], ...], merged: MergedSet) -> None:
        budget = self.settings.cache_mb * 1024 * 1024
        self.stats = dataclasses.replace(self.stats, misses=self.stats.misses + 1,
                                         merge_seconds_total=self.stats.merge_seconds_total + merged.seconds,
                                         merged_bytes_total=self.stats.merged_bytes_total + merged.nbytes,
                                         last_merge_seconds=merged.seconds)
        if merged.nbytes > budget:
            log.warning("LoRA set of %d bytes is over the cache budget of %d ([runtime.lora] cache_mb): used for "
                        "this batch, not kept", merged.nbytes, budget)
            self.stats = dataclasses.replace(self.stats, uncacheable=self.stats.uncacheable + 1)
            return
        self._cache[key] = merged
        while sum(m.nbytes for m in self._cache.values()) > budget:
            self._cache.popitem(last=False)
            self.stats = dataclasses.replace(self.stats, evictions=self.stats.evictions + 1)
        self.stats = dataclasses.replace(self.stats, cached_sets=len(self._cache),
                                         cached_bytes=sum(m.nbytes for m in self._cache.values()))

    def _merge_set(self, uses: tuple[LoraUse, ...]) -> MergedSet:
        start = time.perf_counter()
        by_sha = {f.sha256: f for f in self.files.values() if not f.problem}
        per_weight: dict[tuple[str, targets.Target], list[tuple[float, np.ndarray, np.ndarray]]] = {}
        for use in uses:
            file = by_sha.get(use.sha256)
            if file is None or file.header is None or file.path is None:
                raise InvalidRequestError(f"LoRA {use.name!r} (sha256 {use.sha256[:12]}) is no longer in the "
                                          "library (refreshed since the request was admitted)", param="loras")
            self._factors(file, use, per_weight)
        weights: dict[str, dict[str, ort.OrtValue]] = {}
        nbytes = 0
        for (component, target), factors in per_weight.items():
            comp = self.components[component]
            weights.setdefault(component, dict(comp.required))[target.initializer] = self._merge_one(comp, target,
                                                                                                      factors)
            nbytes += target.nbytes
        return MergedSet(weights, nbytes, time.perf_counter() - start)

    def _factors(self, file: LoraFile, use: LoraUse,
                 per_weight: dict[tuple[str, targets.Target], list[tuple[float, np.ndarray, np.ndarray]]]) -> None:
        try:
            tensors = library.read_factors(self.folder.resolve(), file)
        except LoraFileError as exc:
            self._stale(file, exc.message)
            raise
        for r in file.resolved:
            multiplier = use.te if r.component in TEXT_ENCODERS else use.unet
            if multiplier == 0:
                continue
            down, up = tensors[r.module.down], keys.take_rows(tensors[r.module.up], r.rows)
            rank = down.shape[0]
            alpha = float(tensors[r.module.alpha].reshape(-1)[0]) if r.module.alpha else None
            scale = multiplier * (alpha / rank if alpha is not None else 1.0)  # A1111 network.py calc_scale
            per_weight.setdefault((r.component, r.target), []).append((scale, up, down))

    def _merge_one(self, comp: Component, target: targets.Target,
                   factors: list[tuple[float, np.ndarray, np.ndarray]]) -> ort.OrtValue:
        out_features, in_features = target.out_in
        b, a = merge.stack(factors, out_features, in_features)
        graph = self._merge[(target.layout, target.dtype, len(target.shape))]
        result = ort.OrtValue.ortvalue_from_shape_and_type(list(target.shape), target.dtype, self.runtime.device,
                                                           self.runtime.device_id)
        # W goes up through the runtime's staging (pinned on a GPU) into a device buffer reused per shape, never
        # from pageable memory; the result is allocated on the device (the shared, capped arena where registered).
        base = self.runtime.upload("lora_base", comp.base[target.initializer])
        graph.run({"W": base, "B": b, "A": a}, {"merged": result})
        return result

    def warm_weights(self) -> Weights:
        """Every variant with nothing merged (the stored weights; a plugin EP's required base values): what the
        boot warm-up runs, so no variant meets its first input shape on a request."""
        return {name: dict(c.required) for name, c in self.components.items() if c.variant is not None}

    def summary(self) -> dict[str, object]:
        """/capabilities' ``lora``: the library (no server paths), the variant sessions, the cache, recent sets."""
        files = self.files.values()
        return {"files": len(self.files), "usable": sum(1 for f in files if not f.problem),
                "refused": {f.file: f.problem for f in files if f.problem},
                "targets": self.settings.targets,
                "adaptable_weights": {name: len(c.targets) for name, c in self.components.items()},
                "sessions": {name: c.variant.name for name, c in self.components.items() if c.variant is not None},
                "library": [{"name": f.name, "file": f.file, "sha256": f.sha256, "components": f.components,
                             "problem": f.problem} for f in files],
                "cache": dataclasses.asdict(self.stats) | {"budget_bytes": self.settings.cache_mb * 1024 * 1024},
                "recent_sets": dict(self.history),
                "serving": "merged weights bound to LoRA variant sessions of the plain ONNX components (IO "
                           "binding); requests without LoRA run the base sessions unchanged"}

    def set_bytes(self, uses: tuple[LoraUse, ...]) -> int:
        """Bytes the set's merged tensors take on the device: every weight a non-zero multiplier touches, once."""
        by_sha = {f.sha256: f for f in self.files.values() if not f.problem}
        touched: dict[tuple[str, str], int] = {}
        for use in uses:
            file = by_sha.get(use.sha256)
            for r in file.resolved if file is not None else ():
                if (use.te if r.component in TEXT_ENCODERS else use.unet) != 0:
                    touched[(r.component, r.target.initializer)] = r.target.nbytes
        return sum(touched.values())

    def factor_bytes(self, uses: tuple[LoraUse, ...]) -> int:
        """Host bytes a merge of the set holds while it runs: the factors of every file it reads."""
        by_sha = {f.sha256: f for f in self.files.values() if not f.problem}
        return sum(by_sha[u.sha256].factor_bytes for u in uses if u.sha256 in by_sha)

    def merge_bytes(self, uses: tuple[LoraUse, ...]) -> int:
        """Peak bytes a merge of the set holds (host and device together), priced from the files' headers, so
        before any factor is read: every file's factors (``factor_bytes``: a merge reads them all first), the row
        copies of fused projections (``keys.take_rows``), the merged tensors (``set_bytes``), and the largest
        weight's working set: its factors of every file widened to float32 (STACK_COPIES), the merge graph's
        float32 intermediates (GRAPH_COPIES) and the base weight uploaded (and, on a GPU, staged). The working set
        is what large-rank LoRAs on one weight add: four rank-4096 float16 files on two weights held 3.4 times
        their factors' bytes at the peak (tests/integration/test_lora_merge_memory.py)."""
        by_sha = {f.sha256: f for f in self.files.values() if not f.problem}
        held, stacked = 0, dict[tuple[str, str], int]()
        targets_of: dict[tuple[str, str], targets.Target] = {}
        for use in uses:
            file = by_sha.get(use.sha256)
            if file is None or file.header is None:
                continue
            held += file.factor_bytes
            for r in file.resolved:
                if (use.te if r.component in TEXT_ENCODERS else use.unet) == 0:
                    continue
                share = sum(1 / count for _, count in r.rows) if r.rows else 1.0
                up = math.prod(file.header.tensors[r.module.up].shape) * share
                if r.rows:
                    held += int(memory_bytes(file.header, [r.module.up]) * share)
                key = (r.component, r.target.initializer)
                targets_of[key] = r.target
                stacked[key] = stacked.get(key, 0) + int(up) + math.prod(file.header.tensors[r.module.down].shape)
        merged = sum(t.nbytes for t in targets_of.values())
        working = max((STACK_COPIES * F32 * stacked[k] + GRAPH_COPIES * F32 * math.prod(t.shape) + 2 * t.nbytes
                       for k, t in targets_of.items()), default=0)
        return held + merged + working

    def require_fits(self, uses: tuple[LoraUse, ...]) -> int:
        """The set's merged bytes; InvalidRequestError (param ``loras``, naming the set's ``<lora:...>`` tags) for
        a set whose merge would hold more than the whole LoRA budget at its peak (``merge_bytes``): it is refused
        before admission, never merged into an out-of-memory at batch time."""
        merged, budget = self.set_bytes(uses), self.settings.cache_mb * 1024 * 1024
        need = self.merge_bytes(uses)
        if need > budget:
            tags = " ".join(f"<lora:{u.label()}>" for u in uses)
            raise InvalidRequestError(
                f"the LoRA set {tags} needs {need / 2**20:.0f} MiB to merge ({merged / 2**20:.0f} MiB of merged "
                "weights on the device, the factors its merge reads and their float32 working copies), over this "
                f"server's LoRA budget of {self.settings.cache_mb} MiB ([runtime.lora] cache_mb): use fewer or "
                "smaller adapters, or a server with a larger budget", param="loras")
        return merged

    def _make_room(self, need: int) -> None:
        """Evict cached sets (oldest first) until ``need`` more bytes fit in the budget beside the rest."""
        budget = self.settings.cache_mb * 1024 * 1024
        with self._lock:
            while self._cache and sum(m.nbytes for m in self._cache.values()) + need > budget:
                self._cache.popitem(last=False)
                self.stats = dataclasses.replace(self.stats, evictions=self.stats.evictions + 1)
            self.stats = dataclasses.replace(self.stats, cached_sets=len(self._cache),
                                             cached_bytes=sum(m.nbytes for m in self._cache.values()))

    def merge_estimate_s(self, uses: tuple[LoraUse, ...]) -> float:
        """Admission: seconds a set not cached costs before its first step, priced by the bytes it writes at the
        rate merges ran on this server (FIRST_MERGE_BYTES_PER_S before the first). Refuses a set over the budget."""
        uses = tuple(u for u in uses if u.te or u.unet)
        if self.is_cached(uses):
            return 0.0
        need = self.require_fits(uses)
        s = self.stats
        rate = s.merged_bytes_total / s.merge_seconds_total if s.merged_bytes_total and s.merge_seconds_total \
            else FIRST_MERGE_BYTES_PER_S
        return need / rate

"""LoRA per request: the adapter set is the unit, merged once on the device, cached LRU under a memory budget.

An adapter set is the sorted list of (file sha256, text-encoder multiplier, denoiser multiplier). For a set not in
the cache, every weight it touches is merged on the device (engines/lora/merge.py) into a new tensor; the set's
tensors are bound by name to the LoRA variant sessions of the text encoders and the denoiser (engines/lora/
targets.py) for the batches of that set, through ``ACTIVE`` (a context variable, so two batches never share one).
The base sessions, and a batch without LoRA, bind nothing. A set evicted while a batch runs stays alive until that
batch ends (the batch holds the tensors); eviction only drops the cache's reference.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx
import onnxruntime as ort

from engines.config import LoraSettings
from engines.errors import InvalidRequestError, ModelLoadError
from engines.lora import library, merge, targets
from engines.lora.active import Weights
from engines.lora.library import LoraFile
from engines.lora.safetensors import LoraFileError, read_tensors
from engines.protocol import LoraInfo, LoraStats, LoraUse, lora_key

if TYPE_CHECKING:
    from engines.diffusion.pipeline import OrtModel
    from engines.runtime.sessions import Runtime

log = logging.getLogger(__name__)
TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")
DENOISERS = ("unet", "transformer")
HISTORY = 32


@dataclass
class Component:
    """One adaptable session: its targets, their stored values (host), and the variant session that binds them."""

    name: str
    targets: dict[str, targets.Target]
    base: dict[str, np.ndarray]
    variant: OrtModel
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
                 make_model: type[OrtModel]) -> None:
        self.settings, self.family, self.runtime = settings, family, runtime
        self.folder = Path(settings.dir)
        unet_config = model_dir / "unet" / "config.json"
        self.layers_per_block = int(json.loads(unet_config.read_text()).get("layers_per_block", 2)) \
            if unet_config.is_file() else 2
        """The UNet's, to map kohya's SDXL names in the original block layout (engines/lora/keys.py)."""
        if not self.folder.is_dir():
            raise ModelLoadError(f"[runtime.lora] dir {self.folder} is not a folder (--lora-dir or "
                                 "SDSERVE_LORA_DIR)")
        self.components = self._load_components(model_dir, make_model)
        kinds = {(t.layout, t.dtype, len(t.shape)) for c in self.components.values() for t in c.targets.values()}
        self._merge: dict[tuple[str, type[np.generic], int], OrtModel] = {
            (layout, dt, rank): make_model(runtime, merge.merge_graph(layout, np.dtype(dt), rank),
                                           f"lora_merge_{layout}_{np.dtype(dt).name}_{rank}d")
            for layout, dt, rank in sorted(kinds, key=str)}
        self._cache: OrderedDict[tuple[tuple[str, float, float], ...], MergedSet] = OrderedDict()
        self._lock = threading.Lock()
        self.files: dict[str, LoraFile] = {}
        self._listing: tuple[LoraInfo, ...] = ()
        self.stats = LoraStats()
        self.history: OrderedDict[str, int] = OrderedDict()
        self.refresh()

    def _load_components(self, model_dir: Path, make_model: type[OrtModel]) -> dict[str, Component]:
        out = {}
        for name in (*TEXT_ENCODERS, *DENOISERS):
            path = model_dir / name / "model.onnx"
            if not path.is_file():
                continue
            model = onnx.load(str(path))
            found = targets.find(model, self.settings.targets)
            base = targets.base_weights(model, found)
            external = any(i.data_location == onnx.TensorProto.EXTERNAL for i in
                           onnx.load(str(path), load_external_data=False).graph.initializer)
            if external:  # the variant's protobuf without weights; ORT reads them beside the model file
                model = onnx.load(str(path), load_external_data=False)
            extra = {"session.model_external_initializers_file_folder_path": str(path.parent)} if external else None
            as_inputs = self.runtime.settings.plugin is not None
            variant = make_model(self.runtime, targets.with_overridable(model, found, as_inputs), f"{name}:lora",
                                 extra=extra)
            required = {k: self._device(v) for k, v in base.items()} if as_inputs else {}
            out[name] = Component(name, found, base, variant, required)
            log.info("LoRA: %s has %d adaptable weights (%s)", name, len(found), self.settings.targets)
        return out

    def _device(self, array: np.ndarray) -> ort.OrtValue:
        value = ort.OrtValue.ortvalue_from_shape_and_type(list(array.shape), array.dtype.type, self.runtime.device,
                                                          self.runtime.device_id)
        value.update_inplace(np.ascontiguousarray(array))
        return value

    def refresh(self) -> list[LoraFile]:
        """Scan the folder again (POST /sdapi/v1/refresh-loras); the merged-set cache keeps sets whose files
        are still there with the same hash."""
        found = library.scan(self.folder, {n: c.targets for n, c in self.components.items()}, self.family,
                             self.settings.max_header_kb * 1024, self.settings.max_file_mb * 1024 * 1024,
                             self.layers_per_block)
        with self._lock:
            self.files = found
            self._listing = tuple(LoraInfo(f.name, f.alias, f.file, f.sha256, f.size, dict(f.metadata), f.problem,
                                           f.components) for f in found.values())
            live = {f.sha256 for f in found.values() if not f.problem}
            for key in [k for k in self._cache if any(sha not in live for sha, _, _ in k)]:
                del self._cache[key]
        return list(found.values())

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
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
                found.hits += 1
                found.last_used = time.time()
                self.stats = dataclasses.replace(self.stats, hits=self.stats.hits + 1)
                self._note(key)
                return found.weights
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
        assert file.header is not None
        assert file.path is not None
        wanted = [k for r in file.resolved for k in (r.module.down, r.module.up, r.module.alpha) if k]
        try:
            stat = file.path.stat()
            if (stat.st_size, stat.st_mtime_ns) != (file.size, file.mtime_ns):
                raise LoraFileError(f"LoRA file {file.file} changed on disk since the library was scanned: POST "
                                    "/sdapi/v1/refresh-loras to hash it again")
            tensors = read_tensors(file.path, file.header, wanted)
        except OSError as exc:
            raise LoraFileError(f"LoRA file {file.file} cannot be read: {exc.strerror}") from None
        for r in file.resolved:
            multiplier = use.te if r.component in TEXT_ENCODERS else use.unet
            if multiplier == 0:
                continue
            down, up = tensors[r.module.down], tensors[r.module.up]
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
        return {name: dict(c.required) for name, c in self.components.items()}

    def merge_estimate_s(self, uses: tuple[LoraUse, ...]) -> float:
        """Admission: seconds a set not cached costs before its first step (the mean merge so far; a first guess
        of 0.05 s per set before any merge ran)."""
        if self.is_cached(uses):
            return 0.0
        merges = self.stats.misses
        return self.stats.merge_seconds_total / merges if merges else 0.05 * len(uses)

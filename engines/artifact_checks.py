"""What the engine verifies before it loads: the model folder against its manifest and, under TensorRT or a plugin
EP, the prebuilt artifacts against this node (engines/artifacts.py holds the formats and the checks themselves)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from engines import artifacts
from engines.config import PluginEp, RuntimeSettings, SelfTestPlan
from engines.errors import ArtifactError
from engines.health import trt_coverage
from engines.health.preflight import Observations
from engines.types.snapshot import Artifacts, EngineArtifacts

log = logging.getLogger(__name__)
ANY = "*"
"""The key of the one pipeline that serves every size (no per-size TensorRT engines)."""


class ArtifactChecks:
    """One model folder's verification under a runtime policy. ``artifacts`` is what the capability snapshot
    reports: as far as verification got, also when it raised."""

    def __init__(self, model_dir: Path, settings: RuntimeSettings) -> None:
        self.model_dir = model_dir
        self.settings = settings
        self.artifacts = Artifacts()

    def verify(self, observations: Observations | None, nvml_index: Callable[[], int],
               plan: SelfTestPlan | None = None) -> dict[str, dict[str, Path]]:
        """The model folder against its manifest; with TensorRT in the policy, the prebuilt engines against the
        configuration (``plan``: the self-test plan, which carries the served sizes and the largest call; the
        recorded profiles must cover them, engines/health/trt_coverage.py) and this node (``observations``: preflight's;
        ``nvml_index``: the served card's NVML index, raising when none matches). Returns, per served size, the
        EP-context models to load instead of the plain ONNX files (one engine per size: engines/artifacts.py
        context_models); {ANY: {}} for the plain model at every size."""
        artifacts.verify_model(self.model_dir, self.settings.verify, self.settings.manifest_sha256)
        self.artifacts = Artifacts(model_manifest=f"verified ({self.settings.verify})")
        if self.settings.plugin is not None:
            return self._verify_plugin(self.settings.plugin, observations)
        trt = self.model_dir / artifacts.TRT_DIR
        if "TensorrtExecutionProvider" not in self.settings.providers:
            return {ANY: {}}
        if not (trt / "manifest.json").is_file():
            if self.settings.tensorrt.require_engines:
                raise ArtifactError(
                    f"no prebuilt TensorRT engines in {trt}: build them with `sdserve engines build` on a node with "
                    "the deployed versions (the server never builds engines in production)")
            log.warning("no prebuilt TensorRT engines in %s: TensorRT may build them on this node (slow boot)", trt)
            return {ANY: {}}
        if plan is not None:
            self._require_coverage(trt, plan)
        live = artifacts.node_identity(observations.to_model().model_dump() if observations else {}, nvml_index())
        found = artifacts.verify_engines(self.model_dir, live, self.settings.verify)
        self.artifacts = self.artifacts.model_copy(update={"engines": EngineArtifacts.model_validate(found)})
        per_size = artifacts.context_models(self.model_dir)
        if not per_size:
            raise ArtifactError(f"the engine manifest in {trt} lists no served sizes: rebuild with `sdserve engines "
                                "build`")
        return per_size

    def _require_coverage(self, trt: Path, plan: SelfTestPlan) -> None:
        """ArtifactError (exit 23) when the engines' recorded profiles do not take the configured rows and sizes:
        checked before the node, as it holds wherever the engines are loaded."""
        why = trt_coverage.refusal(artifacts.read_manifest(trt / artifacts.MANIFEST), trt_coverage.Demand.from_plan(
            plan), str(self.model_dir))
        if why is not None:
            raise ArtifactError(why)

    def _verify_plugin(self, plugin: PluginEp, observations: Observations | None) -> dict[str, dict[str, Path]]:
        """A plugin EP's EP-context artifacts (<model>/ep/<name>, `sdserve engines build`) against this node's ORT
        and plugin versions; per served size, the context models to load. Without a manifest: refused when the
        plugin requires artifacts, else the plain model (the EP compiles it at load)."""
        sub = artifacts.ep_dir(plugin.name)
        if not (self.model_dir / sub / artifacts.MANIFEST).is_file():
            if plugin.require_artifacts:
                raise ArtifactError(f"no EP-context artifacts for {plugin.name} in {self.model_dir / sub}: build "
                                    "them with `sdserve engines build --profile <this profile>` (the profile sets "
                                    "runtime.plugin.require_artifacts)")
            log.warning("no EP-context artifacts in %s: %s compiles the model at load", sub, plugin.name)
            return {ANY: {}}
        observed = observations.to_model().model_dump() if observations else {}
        live = artifacts.plugin_identity(observed, plugin.device_type)
        found = artifacts.verify_engines(self.model_dir, live, self.settings.verify, sub, artifacts.PLUGIN_NODE_KEYS)
        self.artifacts = self.artifacts.model_copy(update={"engines": EngineArtifacts.model_validate(found)})
        per_size = artifacts.context_models(self.model_dir, sub)
        if not per_size:
            raise ArtifactError(f"the artifact manifest in {sub} lists no served sizes: rebuild with `sdserve "
                                "engines build`")
        return per_size

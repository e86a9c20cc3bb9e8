"""`sdserve engines build` for a plugin execution provider: EP-context artifacts exactly as for TensorRT.

Per served size and component, the EP compiles the source graph in a session that dumps an EP-context model
(session config ``ep.context_enable``, ``ep.context_file_path``, ``ep.context_embed_mode=0``: the keys of
onnxruntime_session_options_config_keys.h): ``ep/<EP>/<WxH>/<component>_ctx.onnx``, one ``EPContext`` node whose
``ep_cache_context`` names the blob beside it by a relative path (``<component>_ctx_<EP>.bin`` for OpenVINO), so the
model folder can move. The compile runs under the profile's policy (disable_cpu_ep_fallback, placement audit), so a
node the EP leaves on the CPU fails the build (exit 22) naming it. Each written context model is then reopened:
it must be one EPContext node with the source's inputs and outputs, and load with every node on the EP. Then
``ep/<EP>/manifest.json`` binds the files to the ONNX Runtime version and the plugin's package, pip and library
versions and device type (engines/artifacts.py PLUGIN_NODE_KEYS).

The plugin EP keeps the source's dynamic dims (batch, latent height and width), so the per-size folders hold the
same compiled graph; they exist so the layout, the manifest and the server's per-size loading are the TensorRT
ones, and a static-shape EP option (e.g. OpenVINO's reshape_input) can be added per size without a format change.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

from engines.artifacts import (
    COMPONENTS,
    context_model_problems,
    ep_dir,
    plugin_identity,
    sha256_file,
    source_files,
    write_engine_manifest,
)
from engines.config import PluginEp, RuntimeSettings
from engines.errors import ArtifactError
from engines.runtime.sessions import Runtime

log = logging.getLogger(__name__)
OPTIONAL_COMPONENTS = ("text_encoder_2", "vae_encoder")  # when the folder has them


DIT_COMPONENTS = ("text_encoder", "text_encoder_2", "text_encoder_3", "transformer", "vae_decoder", "vae_encoder")
"""A Flux or SD 3 folder's networks (the ones it has: Flux has no text_encoder_3)."""


def components(model_dir: Path) -> list[str]:
    from engines.pipelines.flow_family import is_dit_folder

    if is_dit_folder(model_dir):
        return [c for c in DIT_COMPONENTS if (model_dir / c / "model.onnx").is_file()]
    return [*COMPONENTS, *(c for c in OPTIONAL_COMPONENTS if (model_dir / c / "model.onnx").is_file())]


def dump_config(ctx: Path) -> dict[str, str]:
    """Session config entries that make the EP write ``ctx`` and its blob beside it."""
    return {"ep.context_enable": "1", "ep.context_file_path": str(ctx), "ep.context_embed_mode": "0"}


def plan(model_dir: Path, plugin: PluginEp, sizes: list[str]) -> dict[str, Any]:
    """What the build will write, relative to the model folder (``--dry-run`` prints it)."""
    root = ep_dir(plugin.name)
    return {"model": model_dir.name, "ep": plugin.name, "package": plugin.package, "options": dict(plugin.options),
            "manifest": f"{root}/manifest.json",
            "sizes": {size: {c: {"source": f"{c}/model.onnx", "writes": f"{root}/{size}/{c}_ctx.onnx",
                                 "session_config": {**dump_config(Path(f"{root}/{size}/{c}_ctx.onnx"))}}
                             for c in components(model_dir)} for size in sizes}}


def _build_settings(runtime: RuntimeSettings, plugin: PluginEp) -> RuntimeSettings:
    """The profile's policy for compiling: the plain source may be compiled (that is the build), CPU never."""
    return runtime.model_copy(update={"plugin": plugin.model_copy(update={"require_artifacts": False}),
                                      "allow_cpu": False, "placement_audit": True})


def _compile(runtime: Runtime, source: Path, ctx: Path, name: str) -> dict[str, int]:
    """Compile ``source`` on the EP, writing ``ctx``; returns the source's nodes by provider."""
    ctx.parent.mkdir(parents=True, exist_ok=True)
    runtime.session(source, name, extra=dump_config(ctx))
    if not ctx.is_file():
        raise ArtifactError(f"{name}: the execution provider wrote no EP-context model {ctx}")
    report = runtime.reports[name].placement
    return dict(report.nodes_by_provider) if report is not None else {}


def reopen(runtime: Runtime, source: Path, ctx: Path, name: str, ep: str) -> None:
    """The written context model, checked: one EPContext node with the source's inputs and outputs, and a session
    on it with every node on ``ep`` (the policy's own checks, then the recorded placement)."""
    problems = context_model_problems(ctx, source)
    if problems:
        raise ArtifactError(f"{name}: the EP-context model is not what was built: " + "; ".join(problems))
    runtime.session(ctx, f"{name} (reopened)")
    placement = runtime.reports[f"{name} (reopened)"].placement
    nodes = placement.nodes_by_provider if placement is not None else {}
    if set(nodes) != {ep}:
        raise ArtifactError(f"{name}: the reopened EP-context model runs on {nodes}, expected every node on {ep}")


def _fresh(root: Path) -> None:
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)


def build(model_dir: Path, runtime_settings: RuntimeSettings, sizes: list[str],
          observations: dict[str, Any]) -> Path:
    """Per size and component: compile, dump, reopen and check; then the manifest. Returns its path."""
    plugin = runtime_settings.plugin
    if plugin is None:
        raise ArtifactError("the profile names no runtime.plugin: nothing to build EP-context artifacts for")
    root = model_dir / ep_dir(plugin.name)
    _fresh(root)
    runtime = Runtime(_build_settings(runtime_settings, plugin))  # no model_dir: the artifact folder is written
    placement: dict[str, dict[str, int]] = {}
    entries: dict[str, dict[str, Any]] = {}
    try:
        for size in sizes:
            width, height = (int(v) for v in size.split("x"))
            built = {}
            for component in components(model_dir):
                source, ctx = model_dir / component / "model.onnx", root / size / f"{component}_ctx.onnx"
                name = f"{component}@{size}"
                placement[component] = _compile(runtime, source, ctx, name)
                reopen(runtime, source, ctx, name, plugin.name)
                built[component] = ctx.relative_to(root).as_posix()
                log.info("%s: %s, %s nodes on %s", name, ctx.relative_to(model_dir), placement[component],
                         plugin.name)
            entries[size] = {"profile": {"name": size, "width": width, "height": height}, "context_models": built}
    except Exception:
        shutil.rmtree(root, ignore_errors=True)  # a half-written folder would be refused at boot anyway
        raise
    finally:
        runtime.close()
    model = {c: sha256_file(model_dir / c / "model.onnx") for c in components(model_dir)}
    sources = {rel: digest for c in components(model_dir)
               for rel, digest in source_files(model_dir, f"{c}/model.onnx").items()}
    flags = {"ep_options": dict(plugin.options), "embed_mode": 0}
    return write_engine_manifest(root, plugin_identity(observations, plugin.device_type), entries, flags, model,
                                 placement, sources)

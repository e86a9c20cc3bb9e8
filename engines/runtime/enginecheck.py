"""On-node TensorRT engine builds, detected from facts rather than log lines.

ORT announces a build only at VERBOSE severity ("[TensorRT EP] ... engine will be built"), which a served process
never prints, so a log pattern cannot be the evidence. Two facts are:

- EP-context nodes. A component TensorRT serves from prebuilt engines is loaded from an EP-context model whose
  nodes have op type ``EPContext`` (domain com.microsoft) pointing at the engine (``ep_cache_context``, with
  ``embed_mode``, ``hardware_architecture``, ``onnx_model_filename``): GraphHasCtxNode/CreateCtxModel in
  onnxruntime/core/providers/tensorrt/onnx_ctx_model_helper.cc, docs/EP-Context-Design.md. A plain ONNX graph
  under TensorRT is compiled on the node.
- The engine cache folder (trt_engine_cache_path) and the timing cache beside it, listed before and after session
  creation, and again after the first run at each served shape (TensorRT builds per new input shape on first use).
  A new or rewritten file there is a build, whatever was logged.
"""

from __future__ import annotations

import logging
from pathlib import Path

import onnx

from engines.errors import ArtifactError
from engines.types.snapshot import OrtEvent

log = logging.getLogger(__name__)
EPCONTEXT = "EPContext"
Snapshot = dict[str, tuple[int, int]]


def watched_dirs(engine_cache: Path) -> tuple[Path, ...]:
    """The whole TensorRT folder (the configured engine cache's parent, ``<model>/trt`` by default: per-size
    engines, context models, the timing cache): a file the provider writes anywhere there (a built or refitted
    engine) is seen, whatever folder the engine manifest names."""
    return (engine_cache.parent,)


def snapshot(dirs: tuple[Path, ...]) -> Snapshot:
    """path -> (size, mtime_ns) of every file under ``dirs`` (missing folders are empty)."""
    found: Snapshot = {}
    for directory in dirs:
        if directory.is_dir():
            for path in sorted(directory.rglob("*")):
                if path.is_file():
                    stat = path.stat()
                    found[str(path)] = (stat.st_size, stat.st_mtime_ns)
    return found


def cache_events(before: Snapshot, after: Snapshot, stage: str) -> list[OrtEvent]:
    """One engine_rebuild event when files appeared or changed between the two listings."""
    changed = sorted(path for path, stamp in after.items() if before.get(path) != stamp)
    if not changed:
        return []
    names = ", ".join(Path(p).name for p in changed[:5]) + (" ..." if len(changed) > 5 else "")
    return [OrtEvent(kind="engine_rebuild", severity="error", detail=changed[0],
                     line=f"{stage}: the execution provider wrote {len(changed)} file(s) to its artifact/engine "
                          f"cache ({names}): an engine was built on this node")]


def ep_context_nodes(model: Path | bytes) -> int:
    """How many EPContext nodes the model's main graph holds (weights are not read)."""
    proto = onnx.load_from_string(model) if isinstance(model, bytes) else onnx.load(str(model),
                                                                                    load_external_data=False)
    return sum(1 for node in proto.graph.node if node.op_type == EPCONTEXT)


def ep_context_events(model: Path | bytes, name: str) -> list[OrtEvent]:
    """An engine_rebuild event when a component placed on TensorRT is not an EP-context model."""
    if ep_context_nodes(model):
        return []
    source = "an in-process graph" if isinstance(model, bytes) else str(model)
    return [OrtEvent(kind="engine_rebuild", severity="error", detail=source,
                     line=f"no {EPCONTEXT} node in {source}: TensorRT would build the {name} engine on the node")]


def gate(name: str, events: list[OrtEvent], forbid: bool) -> None:
    """ArtifactError on an artifact_mismatch event (a prebuilt engine that does not deserialize) and on an
    engine_rebuild event when on-node builds are forbidden; otherwise a warning."""
    mismatch = [e for e in events if e.kind == "artifact_mismatch"]
    if mismatch:
        raise ArtifactError(f"artifact mismatch: {name}: {mismatch[0].line[:300]}; rebuild the engines with "
                            "`sdserve engines build` on the deployed versions")
    rebuild = [e for e in events if e.kind == "engine_rebuild"]
    if rebuild and forbid:
        raise ArtifactError(f"{name}: {rebuild[0].line[:300]}; engines are artifacts: build them offline with "
                            "`sdserve engines build` (EP-context models under <model>/trt)")
    if rebuild:
        log.warning("%s: TensorRT builds engines on this node (allowed by the profile): %s", name,
                    rebuild[0].line[:300])


def context_engine_problems(ctx: Path) -> list[str]:
    """Why the engines an EP-context model names would not load from where the model now lies: ``ep_cache_context``
    (embed_mode 0) must be a relative path without '..' to an existing file beside the model
    (onnx_ctx_model_helper.cc GetEpContextFromGraph refuses an absolute path or '..' and joins the rest to the
    context model's folder, "TensorRT EP can't find engine cache" when absent). Empty: it loads from here."""
    problems = []
    for node in onnx.load(str(ctx), load_external_data=False).graph.node:
        if node.op_type != EPCONTEXT:
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if attrs.get("embed_mode", 1):
            continue
        raw = attrs.get("ep_cache_context", b"")
        path = raw.decode() if isinstance(raw, bytes) else str(raw)
        if not path or Path(path).is_absolute() or ".." in Path(path).parts:
            problems.append(f"{ctx.name}: ep_cache_context {path!r} is not a path relative to the context model")
        elif not (ctx.parent / path).is_file():
            problems.append(f"{ctx.name}: its engine {path} is not beside it ({ctx.parent / path} is missing)")
    return problems

"""`sdserve engines build`: TensorRT engines for the served sizes, on a GPU node with the deployed versions, dumped
as EP-context models next to the model (one folder per size), with a manifest bound to the node and to the model
(engines/artifacts.py)."""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any

import onnxruntime as ort

from engines.artifacts import (
    TRT_DIR,
    node_identity,
    read_manifest,
    sha256_file,
    source_files,
    write_engine_manifest,
)
from engines.build.trtplan import ENGINE_CACHE, MODEL_RELATIVE, TIMING_CACHE
from engines.errors import ArtifactError, GpuUnavailableError
from engines.health.trt_coverage import RECORD
from engines.runtime.libdeps import preload
from engines.runtime.ortlog import capture_ort_output

log = logging.getLogger(__name__)
TRT = "TensorrtExecutionProvider"


def require_int8_gate(model_dir: Path) -> dict[str, Any]:
    """INT8 only for a model whose quantized weights passed the accuracy gate (`sdserve engines quantize`)."""
    gate = read_manifest(model_dir / "manifest.json").get("int8_gate")
    if not gate or not gate.get("passed"):
        raise ArtifactError(f"INT8 refused: {model_dir} has no passed accuracy gate; run `sdserve engines quantize` "
                            "and build from its output")
    return dict(gate)


def session_options(model_dir: Path, options: dict[str, str]) -> dict[str, str]:
    """The plan's provider options for this build: model-relative paths made absolute (ORT reads them against the
    working directory). ``trt_engine_cache_path`` stays relative: with ``trt_dump_ep_context_model`` ORT joins it to
    the context model's folder and writes it, relative, into the EPContext node's ``ep_cache_context``
    (tensorrt_execution_provider.cc; onnx_ctx_model_helper.cc GetPathOrParentPathOfCtxModel)."""
    out = dict(options)
    for key in MODEL_RELATIVE:
        if key in out:
            out[key] = str(model_dir / out[key])
    if Path(out.get("trt_engine_cache_path", "")).is_absolute():
        raise ArtifactError("trt_engine_cache_path must be relative to the context model (ORT refuses an absolute "
                            "path when dumping EP-context models)")
    return out


def _fresh_trt(model_dir: Path) -> Path:
    """``trt/`` emptied of earlier builds (the timing cache is kept: it only speeds the builder up)."""
    trt = model_dir / TRT_DIR
    if trt.exists():
        for child in trt.iterdir():
            if child.is_dir() and child.name != Path(TIMING_CACHE).name:
                shutil.rmtree(child)
            elif child.is_file():
                child.unlink()
    (model_dir / TIMING_CACHE).mkdir(parents=True, exist_ok=True)
    return trt


def build_session_options() -> ort.SessionOptions:
    """The build session: from the model's path (never bytes: the provider passes the path to TensorRT's parser,
    which reads external weights from it), with ORT's graph optimizations off, so no folded constant turns
    external weights into inline tensors of a serialized graph over protobuf's 2 GB (trtplan.PROTOBUF_LIMIT);
    TensorRT optimizes the graph itself."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return so


def _build_one(model_dir: Path, size: str, component: str, spec: dict[str, Any]) -> Path:
    options = session_options(model_dir, spec["provider_options"])
    ctx = Path(options["trt_ep_context_file_path"])
    (ctx.parent / ENGINE_CACHE).mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    log.info("building the TensorRT engine for %s at %s; this takes minutes", component, size)
    with capture_ort_output(component) as captured:
        try:
            session = ort.InferenceSession(str(model_dir / spec["source"]), sess_options=build_session_options(),
                                           providers=[TRT], provider_options=[options], enable_fallback=0)
        except Exception as exc:  # ORT raises plain exceptions; the captured lines say why
            raise GpuUnavailableError(f"{component} at {size}: TensorRT build failed: {str(exc).strip()}") from exc
    for event in captured.events:
        log.info("%s: %s", component, event.line[:200])
    require_tensorrt(session.get_providers(), f"{component} at {size}",
                     [e.line for e in captured.events if e.severity == "error"])
    if not ctx.is_file():
        raise ArtifactError(f"{component} at {size}: TensorRT wrote no EP-context model {ctx}")
    reopen(ctx, model_dir / spec["source"], options, f"{component} at {size}")
    log.info("%s at %s done in %.0fs", component, size, time.monotonic() - start)
    return ctx


def require_tensorrt(providers: list[str], name: str, errors: list[str]) -> None:
    """GpuUnavailableError unless the build session runs on TensorRT. A provider that fails to create is a
    WARNING and ORT builds the session on what remains, the CPU provider always among it
    (CreateExecutionProviderFactoryInstance, onnxruntime/python/onnxruntime_pybind_state.cc), so a CPU session
    would otherwise pass as a build and fail later as "TensorRT wrote no EP-context model"."""
    if not providers or providers[0] != TRT:
        why = "; ".join(errors)[:400] or "no error was logged (is libnvonnxparser.so.10 / libcublas.so.13 loadable?)"
        raise GpuUnavailableError(f"{name}: the TensorRT provider did not come up (the session runs on "
                                  f"{providers}): {why}")


def reopen(ctx: Path, source: Path, options: dict[str, str], name: str) -> None:
    """The written context model, reopened: one EPContext node with the source's inputs and outputs (with static
    shapes TensorRT may dump one partition of several), then a session on it with the prebuilt-loading options
    whose every node is on TensorRT (session.record_ep_graph_assignment_info)."""
    from engines.artifacts import context_model_problems
    from engines.runtime.sessions import loading_prebuilt

    problems = context_model_problems(ctx, source)
    if problems:
        raise ArtifactError(f"{name}: the EP-context model is not one TensorRT engine: " + "; ".join(problems))
    so = ort.SessionOptions()
    so.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    keep = {k: v for k, v in loading_prebuilt(options).items() if not k.startswith(("trt_dump", "trt_ep_context"))}
    sess = ort.InferenceSession(str(ctx), sess_options=so, providers=[TRT], provider_options=[keep], enable_fallback=0)
    on = {sg.ep_name for sg in sess.get_provider_graph_assignment_info()}
    if on != {TRT}:
        raise ArtifactError(f"{name}: the reopened EP-context model runs on {sorted(on)}, not TensorRT alone")


def build(model_dir: Path, plan: dict[str, Any], observations: dict[str, Any], nvml_index: int) -> Path:
    """Per served size, one TensorRT session per component (the provider builds the engine and dumps the context
    model into ``trt/<size>/``), then the manifest. Raises GpuUnavailableError when TensorRT cannot run here.

    The CUDA, cuDNN and TensorRT wheels' libraries are preloaded first, as the server does before its sessions:
    libonnxruntime_providers_tensorrt.so needs libnvinfer.so.10, libnvonnxparser.so.10, libcublas.so.13,
    libcudnn.so.9 and libcudart.so.13 (its DT_NEEDED) and carries no RUNPATH, so without the preload the loader
    finds none of the pip copies."""
    if TRT not in ort.get_available_providers():
        raise GpuUnavailableError("this onnxruntime has no TensorRT provider compiled in")

    require_parsed(parser_verdicts(model_dir, plan))  # a refused option is the plan's fault, not the node's
    for line in preload(tensorrt=True):
        log.info("preload: %s", line)
    trt = _fresh_trt(model_dir)
    sizes: dict[str, dict[str, Any]] = {}
    for size, entry in plan["sizes"].items():
        built = {c: _build_one(model_dir, size, c, spec) for c, spec in entry["components"].items()}
        if RECORD not in entry:  # trtplan.plan always writes it; a plan made by hand may not
            raise ArtifactError(f"the plan records no engine profiles for {size} (engines/build/trtplan.py plan "
                                "writes them): boot could not check such engines against its configuration")
        # The profiles TensorRT got, per component: boot refuses a configuration they do not cover
        # (engines/health/trt_coverage.py); a manifest without them covers nothing.
        sizes[size] = {"profile": entry["profile"], RECORD: entry[RECORD],
                       "context_models": {c: ctx.relative_to(trt).as_posix() for c, ctx in built.items()}}
    first = next(iter(plan["sizes"].values()))["components"]
    model = {c: sha256_file(model_dir / spec["source"]) for c, spec in first.items()}
    sources = {rel: digest for spec in first.values()
               for rel, digest in source_files(model_dir, spec["source"]).items()}
    return write_engine_manifest(trt, node_identity(observations, nvml_index), sizes, plan["build_flags"], model,
                                 sources=sources)


def parser_verdicts(model_dir: Path, plan_: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every option set of the plan through ORT's real Python option parser (engines/runtime/optcheck.py), on a
    probe model with each component's input names, types and ranks: ``"<size>/<component>" -> verdict``."""
    from engines.runtime import optcheck

    out: dict[str, dict[str, Any]] = {}
    for size, entry in plan_["sizes"].items():
        for component, spec in entry["components"].items():
            inputs = optcheck.graph_input_types(model_dir / spec["source"])
            result = optcheck.parse(optcheck.TRT, session_options(model_dir, spec["provider_options"]), inputs)
            out[f"{size}/{component}"] = result.as_dict()
    return out


def require_parsed(verdicts: dict[str, dict[str, Any]]) -> None:
    """ArtifactError naming each option set ORT's parser refused: such a plan can build nothing, anywhere."""
    refused = {k: v["detail"] for k, v in verdicts.items() if not v["accepted"]}
    if refused:
        raise ArtifactError("ONNX Runtime's option parser refuses the TensorRT plan: " + "; ".join(
            f"{k}: {why}" for k, why in sorted(refused.items())))

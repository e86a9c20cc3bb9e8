"""Every provider option set the production path can produce, through ONNX Runtime's real option parser.

Nothing here replaces ``ort.InferenceSession`` or any part of ORT: ``engines/runtime/optcheck.py`` makes the two
calls the Python wrapper makes (onnxruntime/python/onnxruntime_inference_collection.py,
``_create_inference_session``), and ORT's binding parses the TensorRT options in
onnxruntime/python/onnxruntime_pybind_state.cc (``CreateExecutionProviderFactoryInstance``) before it tries to load
the provider library. On this CPU machine a good set is *accepted* and then fails to *load* (libcublas.so.13 is
missing); a bad key or value is *refused*, and the test fails on it. The CUDA provider parses its options inside its
own library (cuda_execution_provider_info.cc), which a machine without CUDA cannot load: its sets are checked against
that file's option names (optcheck.CUDA_OPTION_KEYS) and then passed through the binding too.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from engines.build import trt_build, trtplan
from engines.build.trt_build import session_options
from engines.runtime import optcheck
from engines.runtime.sessions import loading_prebuilt, provider_options, session_providers

UNET_FAMILIES = ("sd1", "sd2", "sdxl", "turbo", "inpaint")
DIT_FAMILIES = ("flux", "flux-schnell", "sd3", "sd35")


@pytest.fixture(scope="module")
def family_models(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from engines.build.tiny import build_tiny

    root = tmp_path_factory.mktemp("families")
    out = {"sd1": tiny_model}
    for family in UNET_FAMILIES[1:]:
        out[family] = build_tiny(root / family, family=family)
    return out


def _dry_run(model: Path) -> dict:
    done = subprocess.run([sys.executable, "-m", "server.cli", "engines", "build", "--profile", "production",
                           "--model", str(model), "--dry-run"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_the_rejected_key_is_refused_by_the_real_parser_and_a_known_key_is_not() -> None:
    """The control: the parser this suite relies on tells a bad option from a missing library on this CPU."""
    bad = optcheck.parse(optcheck.TRT, {"trt_load_user_initializer": "True"})
    assert not bad.accepted and "Invalid TensorRT EP option" in bad.detail
    value = optcheck.parse(optcheck.TRT, {"trt_fp16_enable": "maybe"})
    assert not value.accepted
    good = optcheck.parse(optcheck.TRT, {"trt_fp16_enable": "True", "trt_bf16_enable": "False"})
    assert good.accepted, good.detail
    cuda = optcheck.parse(optcheck.CUDA, {"gpu_mem_limit": "1024", "arena_extend_strategy": "kSameAsRequested"})
    assert cuda.accepted, cuda.detail
    assert not optcheck.parse(optcheck.CUDA, {"gpu_mem_limimt": "1"}).accepted
    assert not optcheck.parse(optcheck.CUDA, {"arena_extend_strategy": "kNever"}).accepted


@pytest.mark.parametrize("family", UNET_FAMILIES)
def test_every_build_plan_passes_the_parser(family: str, family_models: dict[str, Path]) -> None:
    """`sdserve engines build --profile production --dry-run` prints the plan and each set's parser verdict."""
    printed = _dry_run(family_models[family])
    sets = [(size, c, spec["provider_options"]) for size, e in printed["sizes"].items()
            for c, spec in e["components"].items()]
    assert sets and set(printed["option_parser"]) == {f"{s}/{c}" for s, c, _ in sets}
    refused = {k: v for k, v in printed["option_parser"].items() if not v["accepted"]}
    assert not refused, refused
    for _size, _component, options in sets:
        assert "trt_load_user_initializer" not in options
        # The prebuilt-loading set the builder reopens each context model with (trt_build.reopen).
        keep = {k: v for k, v in loading_prebuilt(session_options(family_models[family], options)).items()
                if not k.startswith(("trt_dump", "trt_ep_context"))}
        assert optcheck.parse(optcheck.TRT, keep).accepted
    if family == "sdxl":
        assert {"text_encoder_2", "vae_decoder"} <= {c for _, c, _ in sets}
    assert all(o["trt_fp16_enable"] == "True" or c in printed["build_flags"]["fp32_components"]
               for _, c, o in sets)
    # The build budget is the architecture's, per size; the weights' layout is in the plan.
    assert printed["budget_s"] == trtplan.BUILD_BUDGET_S[printed["architecture"]] * len(printed["sizes"])
    assert printed["architecture"] == {"sd1": "sd1", "sd2": "sd2", "sdxl": "sdxl", "turbo": "sd2",
                                       "inpaint": "sd1"}[family]
    assert all(not w["over_2gb"] and w["graph_bytes"] > 0 for w in printed["weights"].values())


@pytest.mark.parametrize("family", DIT_FAMILIES)
def test_every_dit_build_plan_passes_the_parser(family: str, dit_build: Any) -> None:
    """Flux and SD 3 plans (engines/build/trtplan_dit.py): every transformer input resolved from the folder (packed
    image tokens, T5 + CLIP text tokens, rope tables over both), T5 and transformer in bf16, CLIP in fp16, and each
    set through the real parser. Before, `engines build` exited 11 on a DiT folder (it opened unet/model.onnx)."""
    model, _ = dit_build(family)
    printed = _dry_run(model)
    refused = {k: v for k, v in printed["option_parser"].items() if not v["accepted"]}
    assert not refused, refused
    components = printed["sizes"]["512x512"]["components"]
    assert "transformer" in components and "unet" not in components
    t5 = "text_encoder_2" if family.startswith("flux") else "text_encoder_3"
    assert components[t5]["provider_options"]["trt_bf16_enable"] == "True"
    assert components["text_encoder"]["provider_options"]["trt_fp16_enable"] == "True"
    shapes = dict(item.split(":") for item in components["transformer"]["provider_options"][
        "trt_profile_max_shapes"].split(","))
    if family.startswith("flux"):  # 512x512: (512/16)^2 packed tokens; text = the T5 length; rope over both
        text = 512 if family == "flux" else 256
        assert shapes["hidden_states"].split("x")[1] == str(32 * 32)
        assert shapes["encoder_hidden_states"].split("x")[1] == str(text)
        assert shapes["rope_cos"].split("x")[0] == str(text + 32 * 32)
        assert ("guidance" in shapes) == (family == "flux")
    else:  # SD 3: latents [rows, 16, 64, 64], CLIP 77 + T5 256 text tokens, rows doubled for CFG
        assert shapes["hidden_states"].split("x")[2:] == ["64", "64"]
        assert shapes["encoder_hidden_states"].split("x")[1] == str(77 + 256)
        assert int(shapes["hidden_states"].split("x")[0]) == 2 * printed["sizes"]["512x512"]["profile"]["batch_max"]
    assert printed["budget_s"] == trtplan.BUILD_BUDGET_S[family]


@pytest.mark.parametrize("family", ["flux", "sd35"])
def test_a_dit_build_on_this_cpu_fails_for_the_gpu_only_after_the_parser(family: str, dit_build: Any) -> None:
    """The real `engines build --profile production` on a tiny Flux and SD 3.5 (not a dry run): every option set of
    the plan passes ORT's parser first (logged, one per size and component), then preflight refuses the missing
    TensorRT libraries with exit 20 naming them."""
    model, _ = dit_build(family)
    done = subprocess.run([sys.executable, "-m", "server.cli", "engines", "build", "--profile", "production",
                           "--model", str(model)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 20, done.stderr[-2000:]
    parsed = done.stderr.index("option parser: ")
    assert "512x512/transformer" in done.stderr[parsed:].splitlines()[0]
    refused = done.stderr.index("GPU path unavailable")
    assert parsed < refused and "libnvinfer.so.10" in done.stderr[refused:]


def test_a_refused_option_stops_the_dry_run_naming_the_key(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan's own check, not this test's: a key the parser refuses makes `engines build` fail, dry run or not,
    with the parser's words (before, a real build exited 20, "GPU path unavailable")."""
    from engines.errors import ArtifactError

    plan = trtplan.plan(tiny_model, trtplan.profiles_from([(64, 64)], 2, 1), trtplan.BuildFlags())
    plan["sizes"]["64x64"]["components"]["unet"]["provider_options"]["trt_load_user_initializer"] = "True"
    with pytest.raises(ArtifactError, match="trt_load_user_initializer"):
        trt_build.require_parsed(trt_build.parser_verdicts(tiny_model, plan))


def test_the_plan_says_where_the_weights_are(tiny_model: Path, tmp_path: Path) -> None:
    """An external-data component: its weight bytes are counted beside the graph file (the build reads them from
    the folder: trtplan.PROTOBUF_LIMIT)."""
    import shutil

    import onnx

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    unet = model / "unet" / "model.onnx"
    onnx.save(onnx.load(str(unet)), str(unet), save_as_external_data=True, location="w.bin", size_threshold=1024)
    printed = trtplan.plan(model, trtplan.profiles_from([(64, 64), (128, 128)], 2, 1), trtplan.BuildFlags())
    unet_weights = printed["weights"]["unet"]
    assert unet_weights["external_bytes"] == (model / "unet" / "w.bin").stat().st_size > unet_weights["graph_bytes"]
    assert printed["budget_s"] == 2 * trtplan.BUILD_BUDGET_S["sd1"]


def test_every_serving_option_set_passes_the_parser(tiny_model: Path) -> None:
    """The sessions the production profile builds: TensorRT + CUDA for files, CUDA for graphs built in process
    (LoRA variants, the step graph), prebuilt loading, the fp32 override, the arena cap."""
    from server.settings import load_settings

    runtime = load_settings("production").runtime
    total = 141 * 1024**3
    sets = {"policy": provider_options(runtime, tiny_model, total),
            "file": session_providers(runtime, False, tiny_model, total),
            "in process": session_providers(runtime, True, tiny_model, total)}
    checked = 0
    for label, providers in sets.items():
        for provider, options in providers:
            variants = [options]
            if provider == optcheck.TRT:
                variants += [loading_prebuilt(options), {**options, "trt_fp16_enable": "False"}]
            for opts in variants:
                result = optcheck.parse(provider, opts)
                assert result.accepted, f"{label} {provider}: {result.detail}"
                assert not result.loaded  # no GPU here: the parse is what this proves
                checked += 1
    cuda = dict(sets["policy"])[optcheck.CUDA]
    assert cuda["gpu_mem_limit"].isdigit() and cuda["arena_extend_strategy"] in ("kNextPowerOfTwo", "kSameAsRequested")
    assert checked >= 5


def test_a_build_without_the_libraries_is_a_gpu_fault_after_the_preload(tiny_model: Path, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The real build on this CPU, through the real ORT: the plan passes the parser (no ArtifactError), the CUDA
    and TensorRT wheels' libraries are preloaded first (libonnxruntime_providers_tensorrt.so has no RUNPATH), and
    the missing provider is exit 20's GpuUnavailableError: the TensorRT plugin registration raises "Please install
    TensorRT libraries" (onnxruntime_inference_collection.py ``_register_ep_custom_ops``) or the provider fails to
    create and ORT builds on the CPU (refused by trt_build.require_tensorrt)."""
    import shutil

    from engines.build import trt_build
    from engines.errors import GpuUnavailableError

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    order: list[str] = []
    real_preload = trt_build.preload
    monkeypatch.setattr(trt_build, "preload", lambda tensorrt: order.append("preload") or real_preload(tensorrt))
    plan = trtplan.plan(model, trtplan.profiles_from([(64, 64)], 2, 1), trtplan.BuildFlags())
    with pytest.raises(GpuUnavailableError, match=r"TensorRT (build failed|provider did not come up)"):
        trt_build.build(model, plan, {}, 0)
    assert order == ["preload"]
    assert not list((model / "trt").glob("*/*_ctx.onnx"))


def test_the_shared_device_arena_goes_through_orts_real_registration() -> None:
    """The arena config and memory info pass the binding's own checks (OrtArenaCfg refuses an unknown key:
    onnxruntime_pybind_state.cc "Invalid OrtArenaCfg option"); on this CPU the registration then fails only where
    the CUDA provider library must load ("CUDA Provider not available"), and the runtime records why, so
    /capabilities says the budget is not enforced instead of claiming it."""
    from engines.config import RuntimeSettings
    from engines.runtime import buffers, sessions

    settings = RuntimeSettings(providers=("TensorrtExecutionProvider", "CUDAExecutionProvider"), device_id=5)
    buffers._DEVICE_ARENAS.pop(5, None)
    state = buffers.device_arena(settings, 141 * 1024**3)
    assert state["max_mem_bytes"] == int(141 * 1024**3 * settings.cuda.gpu_mem_limit_fraction)
    assert not state["registered"] and "CUDA Provider not available" in state["error"], state
    assert buffers.device_arena(settings, None) is state  # once per device and process
    runtime = sessions.Runtime(settings, total_memory=141 * 1024**3)
    assert runtime.arena is state
    with pytest.raises(RuntimeError, match="does not have configuration"):  # not registered: not asked for
        runtime._options().get_session_config_entry(sessions.ENV_ALLOCATORS)
    runtime.arena = {**state, "registered": True}  # as on a GPU node: every session uses the shared arena
    assert runtime._options().get_session_config_entry(sessions.ENV_ALLOCATORS) == "1"
    assert runtime._options(audit_only=True).get_session_config_entry(sessions.ENV_ALLOCATORS) == "1"
    buffers._DEVICE_ARENAS.pop(5, None)
    off = buffers.device_arena(settings.model_copy(update={"cuda": settings.cuda.model_copy(
        update={"shared_arena": False})}), None)
    assert off == {"registered": False, "max_mem_bytes": 0, "arena_extend_strategy": "kSameAsRequested",
                   "error": "runtime.cuda.shared_arena is off"}
    buffers._DEVICE_ARENAS.pop(5, None)

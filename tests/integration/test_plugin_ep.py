"""Every fail-closed promise, against a real accelerator EP: OpenVINO's plugin execution provider on the CPU (the
openvino profile), from real `sdserve` processes, with their exit codes. The artifacts are built once per session by
`sdserve engines build --profile openvino` (tests/conftest.py ``openvino_model``); each refusal works on a copy."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from server.exitcodes import ExitCode
from tests.plugin_ep import (
    ARTIFACTS,
    EP,
    build_artifacts,
    build_shim,
    cpu_facts,
    listed_devices,
    openvino_args,
    openvino_library,
    profile,
    resign,
    sdserve,
    with_cpu_node,
)

pytestmark = pytest.mark.plugin_ep


Done = subprocess.CompletedProcess[str]


def assert_exit(done: Done, code: ExitCode, *fragments: str) -> None:
    out = done.stdout + done.stderr
    assert done.returncode == int(code), f"exit {done.returncode}, want {int(code)}:\n{out[-3000:]}"
    for fragment in fragments:
        assert fragment in out, f"{fragment!r} not in:\n{out[-3000:]}"


def doctor(model: Path, config: Path | None = None) -> Done:
    where = ("--config", str(config)) if config else openvino_args(model.parent)
    return sdserve("doctor", *where, "--model", str(model))


@pytest.fixture
def copy(openvino_model: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "model"
    shutil.copytree(openvino_model, dest)
    return dest


def test_built_artifacts_boot_on_the_ep(openvino_model: Path) -> None:
    """The untouched artifacts pass preflight and load (exit 0): the refusals below are caused by what they change."""
    done = doctor(openvino_model)
    assert_exit(done, ExitCode.OK, EP)


PLUGIN = 'package = "onnxruntime-ep-openvino"\nmodule = "onnxruntime_ep_openvino"'


@pytest.mark.parametrize(("table", "package", "check"), [
    ('package = "onnxruntime-ep-absent"\nmodule = "onnxruntime_ep_absent"', "onnxruntime-ep-absent", "plugin_package"),
    (PLUGIN + '\nlibrary = "{missing}"', "onnxruntime-ep-openvino", "plugin_library"),
    (PLUGIN + '\nlibrary = "{garbage}"', "onnxruntime-ep-openvino", "plugin_library"),
], ids=["package-not-installed", "library-missing", "library-unloadable"])
def test_plugin_library_unavailable_exits_20_naming_the_package(openvino_model: Path, tmp_path: Path, table: str,
                                                               package: str, check: str) -> None:
    garbage = tmp_path / "libnot_an_elf.so"
    garbage.write_text("not a shared object")
    config = profile(tmp_path, {PLUGIN: table.format(missing=tmp_path / "libabsent.so", garbage=garbage)})
    assert_exit(doctor(openvino_model, config), ExitCode.GPU_UNAVAILABLE, package, f"{check}:{EP}")


def test_plugin_named_in_providers_is_refused_at_validation(openvino_model: Path, tmp_path: Path) -> None:
    config = profile(tmp_path, {"providers = []": 'providers = ["OpenVINOExecutionProvider"]'})
    done = doctor(openvino_model, config)
    assert_exit(done, ExitCode.CONFIG_INVALID, "a plugin execution provider", "runs every node on "
                "CPUExecutionProvider", "[runtime.plugin]")


def test_a_node_the_ep_leaves_on_the_cpu_exits_22_naming_it(tiny_model: Path, tmp_path: Path) -> None:
    """Both where it can happen: the build (the EP compiles the source) and a boot that compiles at load."""
    model = tmp_path / "det"
    det = with_cpu_node(tiny_model, model)
    assert_exit(sdserve("engines", "build", *openvino_args(tmp_path), "--model", str(model)),
                ExitCode.PLACEMENT_FAILED, f"Det {det}", "vae_decoder")
    assert not (model / ARTIFACTS).exists(), "a failed build leaves no half-written artifacts"
    config = profile(tmp_path, {"require_artifacts = true": "require_artifacts = false"})
    assert_exit(doctor(model, config), ExitCode.PLACEMENT_FAILED, f"Det {det}")


def _tamper(root: Path) -> str:
    blob = root / "64x64" / f"unet_ctx_{EP}.bin"
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    return f"64x64/unet_ctx_{EP}.bin: sha256"


def _delist(root: Path) -> str:
    manifest = json.loads((root / "manifest.json").read_text())
    del manifest["files"][f"64x64/vae_decoder_ctx_{EP}.bin"]
    (root / "manifest.json").write_text(json.dumps(manifest))
    return f"64x64/vae_decoder_ctx_{EP}.bin: not in the manifest"


def _unlisted(root: Path) -> str:
    (root / "64x64" / "extra.bin").write_bytes(b"\0" * 16)
    return "64x64/extra.bin: not in the manifest"


def _ep_version(root: Path) -> str:
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["node"]["ep_version"] = "1.7.0"
    (root / "manifest.json").write_text(json.dumps(manifest))
    return "ep_version: artifact built with 1.7.0, this node has 1.8.1"


def _stale_blob(root: Path) -> str:
    """The UNet's blob replaced by another compiled graph's, the manifest re-signed (so every hash matches): only
    ONNX Runtime loading it can tell, and that must read as an artifact mismatch."""
    shutil.copy(root / "64x64" / f"text_encoder_ctx_{EP}.bin", root / "64x64" / f"unet_ctx_{EP}.bin")
    resign(root)
    return "artifact mismatch: unet@64x64"


def _no_artifacts(root: Path) -> str:
    shutil.rmtree(root)
    return f"no EP-context artifacts for {EP}"


@pytest.mark.parametrize("change", [_tamper, _delist, _unlisted, _ep_version, _stale_blob, _no_artifacts],
                         ids=["tampered", "de-listed", "unlisted", "ep-version", "stale-blob", "missing"])
def test_artifact_problems_exit_23(copy: Path, change: Callable[[Path], str]) -> None:
    fragment = change(copy / ARTIFACTS)
    done = doctor(copy)
    assert_exit(done, ExitCode.ARTIFACT_INVALID, fragment)
    assert "path unavailable" not in done.stdout + done.stderr


def test_the_shim_decides_what_the_plugin_offers() -> None:
    """The vendor path is exercised on every machine: the same OpenVINO plugin, loaded through the vendor shim,
    offers the CPU when it is presented as Intel (0x8086) and drops it when presented as AMD (0x1022): the rule in
    ov_factory.cc, reproduced on an Intel CPU, lifted on an AMD one."""
    as_amd = listed_devices(str(build_shim(0x1022)))
    as_intel = listed_devices(str(build_shim(0x8086)))
    assert not [d for d in as_amd if d[0] == EP], as_amd
    assert [d for d in as_intel if d[0] == EP and d[1] == "CPU"], as_intel
    assert [d for d in as_amd if d[0] == "CPUExecutionProvider"], "ONNX Runtime's own CPU device is unchanged"


def test_a_plugin_offering_no_device_exits_20_saying_why_not_reinstall(openvino_model: Path, tmp_path: Path) -> None:
    """The plugin loads but offers no CPU device (here: presented an AMD CPU by the shim; on an AMD machine also the
    plugin itself): exit 20 naming what ONNX Runtime has and what the plugin offered, never "reinstall"."""
    libraries = [str(build_shim(0x1022))]
    vendor_rule = cpu_facts()["vendor"] != "GenuineIntel"
    if vendor_rule:
        libraries.append(openvino_library())
    for library in libraries:
        config = profile(tmp_path, {PLUGIN: PLUGIN + f"\nlibrary = {json.dumps(library)}"})
        done = doctor(openvino_model, config)
        assert_exit(done, ExitCode.GPU_UNAVAILABLE, f"plugin_library:{EP}", "loaded but lists no CPU device",
                    "ONNX Runtime found: CPU", "the plugin offered: nothing")
        assert "reinstall" not in done.stdout + done.stderr
        if vendor_rule and library == libraries[-1]:
            assert "vendor rule" in done.stdout + done.stderr and "ov_factory.cc" in done.stdout + done.stderr


def _external_unet(model: Path) -> None:
    """The UNet's weights moved to external data beside it, and the model manifest rewritten, as an export of a
    real-size model (over protobuf's 2 GB) lays them out."""
    import onnx

    from engines.artifacts import read_manifest, write_model_manifest

    unet = model / "unet" / "model.onnx"
    onnx.save(onnx.load(str(unet)), str(unet), save_as_external_data=True, location="model.onnx_data",
              size_threshold=1024)
    write_model_manifest(model, {k: v for k, v in read_manifest(model / "manifest.json").items() if k != "files"})


def test_engines_are_bound_to_the_external_weights_they_were_built_from(tiny_model: Path, tmp_path: Path) -> None:
    """A fine-tune re-exported with the same architecture changes only the weight file (the graph file of an
    external-data model is the same bytes) and comes with a new, consistent model manifest: the engines built
    from the old weights must be refused (exit 23), naming the weight file, not served."""
    from engines.artifacts import read_manifest, write_model_manifest

    source = tmp_path / "source"
    shutil.copytree(tiny_model, source)
    _external_unet(source)
    model = build_artifacts(source, tmp_path / "built" / "model")
    built = read_manifest(model / ARTIFACTS / "manifest.json")
    assert "unet/model.onnx_data" in built["sources"]
    assert_exit(doctor(model), ExitCode.OK, EP)
    weights = model / "unet" / "model.onnx_data"
    data = bytearray(weights.read_bytes())
    data[len(data) // 3] ^= 0x01
    weights.write_bytes(bytes(data))
    write_model_manifest(model, {k: v for k, v in read_manifest(model / "manifest.json").items() if k != "files"})
    assert_exit(doctor(model), ExitCode.ARTIFACT_INVALID, "unet/model.onnx_data: engines built from sha256")

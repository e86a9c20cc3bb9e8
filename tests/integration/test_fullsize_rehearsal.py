"""A full-size SD 1.5-architecture model through what production does to it, as far as a 2-core CPU allows (issue
37, point 2). The tiny model proves the logic; only a real-size model has what breaks at size: a fp32 UNet over
protobuf's 2 GB limit, so its weights are external data (hundreds of files beside a 1.4 MB graph), 2,464 nodes,
attention over 4,096 tokens at 512x512.

Built once for the module (engines/build/sd15.py, random weights, seed 0, in a child process so its peak is its
own), then: the export has external data; the placement audit *with classification* on a CPU session of the UNet
and of its LoRA variant (bytes whose initializers point at the files), writing no weights to the temporary folder;
one 512x512 image and one LoRA image on the dev profile; accept's relocation (hard links, `engines build` on
OpenVINO's plugin EP, a move, a strict boot from the moved EP-context models); one flipped weight byte refused at
boot, by the model manifest and, once the manifest is re-signed as a re-export would, by the engines' binding to
the weight files they were built from. Each step's wall time, peak RSS (VmHWM) and bytes written to storage are
printed at the end of the module and written to ``fullsize_figures.json`` in pytest's base temporary folder.

Measured on 2 cores (AMD EPYC, OpenVINO through the vendor shim), 2026-12-03: build 193 s, 6.0 GB peak, 8.6 GB
written (4.3 GB model + 4.3 GB diffusers twin, which build_sd15 always writes and this module deletes); UNet audit
27 s (session 17 s, 3.6 GB; audit 11 s, 4.8 GB, 1 MB written); engine load with a LoRA library 25 s, 5.4 GB (was
50 s, 11.8 GB before the merge's W was memory-mapped and variants were built only for adapted components); 512x512
1-step image 27 s, 6.9 GB; LoRA image 33 s, peak 12.1 GB (was 16.5 GB); relocation with the OpenVINO build 46 s,
7.7 GB, 4.3 GB written (the EP blobs; the weights are linked); each refused boot 6-8 s; the module 380 s.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from engines import artifacts
from engines.config import LoraSettings
from engines.engine import OrtEngine
from engines.lora import targets
from engines.runtime import placement
from engines.runtime.dataflow import CPU_PROVIDER
from engines.types.request import Batch, ImageSpec, LoraUse
from server.exitcodes import ExitCode
from server.settings import load_settings
from tests.plugin_ep import ARTIFACTS, EP, profile, sdserve

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STEPS_SCRIPT = ROOT / "benchmarks" / "rehearsal_fullsize.py"
BPE = ROOT / ".cache" / "wheels" / "open_clip_torch-3.3.0-py3-none-any.whl"
EXTERNAL_FOLDER = "session.model_external_initializers_file_folder_path"
SIZE, STEPS = 512, 1
GUIDANCE = 1.0
"""No classifier-free guidance (the UNet runs on one row, not two): half the activations of a 512x512 step, which
are most of the peak (a CFG step adds about 2 GB and 20 s here)."""
AUDIT_WRITE_LIMIT = 100 * 10**6
FIGURES: dict[str, dict[str, float | str]] = {}


# --- figures --------------------------------------------------------------------------------------------------------


def _status_kib(key: str) -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(f"{key}:"))
    return int(line.split()[1])


def _written() -> int:
    """Bytes this process dirtied for storage so far (/proc/self/io write_bytes): a temporary file written and
    deleted still counts, a write to the null device does not."""
    io = dict(x.split(": ", 1) for x in Path("/proc/self/io").read_text().splitlines() if ": " in x)
    return int(io["write_bytes"])


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (clear_refs "5", Linux >= 4.0), so the next peak is the step's own."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


@dataclass
class Meter:
    written: int = 0
    seconds: float = 0.0


@contextmanager
def measured(step: str) -> Iterator[Meter]:
    meter = Meter()
    own_peak = _reset_peak()
    start, before = time.monotonic(), _written()
    try:
        yield meter
    finally:
        meter.seconds, meter.written = time.monotonic() - start, _written() - before
        FIGURES[step] = {"seconds": round(meter.seconds, 1), "peak_rss_gb": round(_status_kib("VmHWM") / 2**20, 2),
                         "written_gb": round(meter.written / 1e9, 3),
                         **({} if own_peak else {"note": "peak is the process's so far (clear_refs refused)"})}


@pytest.fixture(scope="module", autouse=True)
def figures(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every step's figures, printed when the module ends (pass or fail) and written as JSON."""
    start = time.monotonic()
    yield
    FIGURES["module"] = {"seconds": round(time.monotonic() - start, 1)}
    out = tmp_path_factory.getbasetemp() / "fullsize_figures.json"
    out.write_text(json.dumps(FIGURES, indent=2) + "\n")
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.ensure_newline()
        reporter.write_line(f"full-size rehearsal figures ({out}):")
        for step, values in FIGURES.items():
            reporter.write_line(f"  {step}: " + ", ".join(f"{k} {v}" for k, v in values.items()))


def _bytes_under(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def _child(*args: str, timeout: float = 600) -> dict[str, Any]:
    """One heavy step in a fresh process (benchmarks/rehearsal_fullsize.py): its result and its own figures."""
    done = subprocess.run([sys.executable, str(STEPS_SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


# --- the model, built once ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fullsize(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The SD 1.5-architecture model (random weights, fp32) as the build extra exports it. Removed at the end of
    the module: pytest keeps its last three base folders, and each would hold 4 GB."""
    root = tmp_path_factory.mktemp("fullsize")
    model, twin = root / "onnx", root / "diffusers"
    done = _child("build", str(model), str(twin), str(BPE) if BPE.is_file() else "")
    FIGURES["build (child)"] = {**done["figures"], "model_gb": round(_bytes_under(model) / 1e9, 2),
                                "diffusers_twin_gb": round(_bytes_under(twin) / 1e9, 2)}
    shutil.rmtree(twin)  # the torch reference's copy of the weights: nothing here reads it
    yield model
    shutil.rmtree(root, ignore_errors=True)


def _unet(model: Path) -> Path:
    return model / "unet" / "model.onnx"


def _cpu_session(model: Path | bytes, folder: Path | None = None) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.add_session_config_entry(placement.CONFIG_KEY, "1")
    so.log_severity_level = 3  # a LoRA variant warns once per overridable initializer (hundreds of lines)
    if folder is not None:
        so.add_session_config_entry(EXTERNAL_FOLDER, str(folder))
    return ort.InferenceSession(model if isinstance(model, bytes) else str(model), so, providers=[CPU_PROVIDER])


def _variant(path: Path) -> bytes:
    """The UNet's LoRA variant as engines/lora/manager.py builds it for an external-data model: the graph read
    without its weights, every adaptable weight overridable, serialized (ORT reads the weights beside the file)."""
    graph = onnx.load(str(path), load_external_data=False)
    found = targets.find(graph)
    assert len(found) > 200, len(found)
    return targets.with_overridable(graph, found)


# --- (a) the export -------------------------------------------------------------------------------------------------


def test_the_unet_weights_are_external_data_beside_a_small_graph(fullsize: Path) -> None:
    unet = _unet(fullsize)
    graph = onnx.load(str(unet), load_external_data=False).graph
    files = artifacts.external_files(unet)
    weights = sum((unet.parent / f).stat().st_size for f in files)
    assert unet.stat().st_size < 16 * 2**20, unet.stat().st_size
    assert weights > 2**31, weights  # past protobuf's 2 GB: the reason the weights are external at all
    inline = [i.name for i in graph.initializer if i.data_location != onnx.TensorProto.EXTERNAL
              and len(i.raw_data) > 2**20]
    assert not inline, inline[:5]
    listed = artifacts.read_manifest(fullsize / artifacts.MANIFEST)["files"]
    missing = [f for f in files if f"unet/{f}" not in listed]
    assert not missing, missing[:5]  # the model manifest covers every weight file
    assert len(graph.node) > 2000


# --- (b) the placement audit with classification --------------------------------------------------------------------


def _audit(name: str, sess: ort.InferenceSession, model: Path | bytes, folder: Path | None,
           monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> tuple[placement.PlacementReport, Meter]:
    """The audit with classification, every temporary file under a folder of its own, what it writes measured."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    with measured(f"audit {name}") as meter:
        report = placement.audit(sess, name, model, classify=True, external_folder=folder)
    assert not os.listdir(scratch), os.listdir(scratch)
    return report, meter


def _assert_classified(report: placement.PlacementReport, meter: Meter) -> None:
    assert report.unclassified in (None, ""), report.unclassified
    assert not report.unmatched, report.unmatched[:5]
    assert sum(report.shape_path.values()) + len(report.activation_on_cpu) == len(report.cpu_nodes) > 2000
    assert report.shape_path  # the shape arithmetic ORT leaves on the CPU on purpose, allowed
    assert any(e.startswith("Conv ") for e in report.activation_on_cpu)  # a CPU session's compute, named
    assert not report.ok
    assert meter.written < AUDIT_WRITE_LIMIT, f"the audit wrote {meter.written / 1e6:.0f} MB (the weights?)"


def test_the_unet_audit_classifies_without_writing_its_weights(fullsize: Path, monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    unet = _unet(fullsize)
    with measured("CPU session unet"):
        sess = _cpu_session(unet)
    report, meter = _audit("unet", sess, unet, None, monkeypatch, tmp_path)
    _assert_classified(report, meter)


def test_the_lora_variant_audit_classifies_without_writing_its_weights(fullsize: Path,
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path) -> None:
    unet = _unet(fullsize)
    variant = _variant(unet)
    assert len(variant) < 16 * 2**20  # the weights stay in their files
    with measured("CPU session unet:lora"):
        sess = _cpu_session(variant, unet.parent)
    report, meter = _audit("unet:lora", sess, variant, unet.parent, monkeypatch, tmp_path)
    _assert_classified(report, meter)


# --- (c) one image, one LoRA image ----------------------------------------------------------------------------------


def _write_lora(model: Path, path: Path, rank: int = 4) -> int:
    """A PEFT-named LoRA on the attention projections of the UNet's second down block, random factors sized from
    the graph's own weights (no torch module of a 3.4 GB UNet needed)."""
    from safetensors.numpy import save_file

    found = targets.find(onnx.load(str(_unet(model)), load_external_data=False))
    chosen = sorted(m for m in found if m.startswith("down_blocks.1.attentions.")
                    and m.endswith((".to_q", ".to_k", ".to_v", ".to_out.0")))
    rng = np.random.default_rng(7)
    tensors = {}
    for module in chosen:
        out_features, in_features = found[module].out_in
        tensors[f"unet.{module}.lora_A.weight"] = (rng.standard_normal((rank, in_features)) * 0.2).astype(np.float32)
        tensors[f"unet.{module}.lora_B.weight"] = (rng.standard_normal((out_features, rank)) * 0.2).astype(np.float32)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))
    return len(chosen)


def _image(engine: OrtEngine, uses: tuple[LoraUse, ...] = ()) -> np.ndarray:
    batch = Batch((ImageSpec("a photo of an astronaut riding a horse", seed=1, guidance_scale=GUIDANCE),), SIZE,
                  SIZE, STEPS, "euler", loras=uses)
    result = engine.generate(batch)
    assert result.provider == CPU_PROVIDER
    return np.asarray(result.images[0].image)


def test_a_512_image_and_a_lora_image_on_the_dev_profile(fullsize: Path, tmp_path: Path) -> None:
    modules = _write_lora(fullsize, tmp_path / "loras" / "style.safetensors")
    assert modules == 16
    runtime = load_settings("dev").runtime
    assert runtime.allow_cpu and runtime.verify == "full"
    settings = runtime.model_copy(update={"lora": LoraSettings(dir=str(tmp_path / "loras"))})
    engine = OrtEngine(fullsize, settings)
    try:
        with measured("engine load (dev, verify full, LoRA library)"):
            engine.load()
        found = {f.name: f for f in engine.loras()}["style"]
        assert not found.problem, found.problem
        with measured(f"{SIZE}x{SIZE} image, {STEPS} step(s)"):
            base = _image(engine)
        with measured(f"{SIZE}x{SIZE} LoRA image, {STEPS} step(s)"):
            styled = _image(engine, (LoraUse("style", found.sha256, 1.0, 1.0),))
    finally:
        engine.close()
    assert base.shape == styled.shape == (SIZE, SIZE, 3)
    assert base.std() > 1.0  # not a constant (black) image
    changed = float((np.abs(base.astype(np.int16) - styled.astype(np.int16)) > 2).mean())
    assert changed > 0.01, f"the LoRA changed {changed:.2%} of the values"


# --- (e) accept's relocation: hard links, `engines build` on OpenVINO, a move, a strict boot ------------------------


@dataclass(frozen=True)
class Relocated:
    moved: Path
    config: Path
    result: dict[str, Any]


@pytest.fixture(scope="module")
def relocated(fullsize: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Relocated]:
    root = tmp_path_factory.mktemp("relocation")
    config = profile(root, {'sizes = ["64x64"]': f'sizes = ["{SIZE}x{SIZE}"]'})
    done = _child("relocate", str(fullsize), str(config), str(root / "accept"))
    FIGURES["relocation + engines build on OpenVINO (child)"] = done["figures"]
    yield Relocated(Path(done["section"]["moved_to"]), config, done)
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.plugin_ep
def test_relocation_links_the_weights_builds_on_openvino_and_boots_from_the_moved_folder(
        fullsize: Path, relocated: Relocated) -> None:
    section = relocated.result["section"]
    assert section["loaded"] and not section["engine_built_on_load"] and not section["reasons"], section
    moved = relocated.moved
    assert moved.is_dir() and not Path(section["built_at"]).exists()
    assert not (fullsize / artifacts.EP_DIR).exists()  # nothing was built into the source folder
    weights = [f"unet/{f}" for f in artifacts.external_files(_unet(fullsize))]
    unlinked = [rel for rel in weights if not os.path.samefile(fullsize / rel, moved / rel)]
    assert not unlinked, unlinked[:5]
    manifest = artifacts.read_manifest(moved / ARTIFACTS / artifacts.MANIFEST)
    assert set(weights) <= set(manifest.get("sources", {})), "the engines are not bound to the weight files"
    assert set(manifest["placement"]["unet"]) == {EP}
    blobs = sum(p.stat().st_size for p in (moved / ARTIFACTS).rglob("*.bin"))
    weight_bytes = sum((fullsize / rel).stat().st_size for rel in weights)
    written = relocated.result["figures"]["written_gb"] * 1e9
    assert blobs > weight_bytes * 0.9  # the compiled UNet carries its weights
    assert written < blobs + weight_bytes / 4, f"{written / 1e9:.2f} GB written: the weights copied?"


# --- (d) one flipped weight byte, refused at boot -------------------------------------------------------------------


def _flip(path: Path) -> None:
    """One bit of ``path`` flipped in a file of its own (the link to the source's file broken first)."""
    data = bytearray(path.read_bytes())
    path.unlink()
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.plugin_ep
def test_a_flipped_weight_byte_is_refused_at_boot_by_the_manifest_and_by_the_engine_binding(
        fullsize: Path, relocated: Relocated, tmp_path: Path) -> None:
    """First as it lands on the node (the model manifest no longer matches); then with the manifest re-signed, as
    a fine-tune re-exported with the same graph would come: the engines built from the old weights are refused,
    naming the weight file, not served."""
    model = tmp_path / "model"
    artifacts.link_tree(relocated.moved, model, skip=())  # the relocated folder, artifacts included, by links
    weights = [f"unet/{f}" for f in artifacts.external_files(_unet(model))]
    rel = min(weights, key=lambda r: (model / r).stat().st_size)  # the smallest: the copy that breaks the link
    _flip(model / rel)
    listed = artifacts.read_manifest(fullsize / artifacts.MANIFEST)["files"][rel]
    assert artifacts.sha256_file(fullsize / rel) == artifacts.expected(listed)[0]  # the source is untouched
    with measured("doctor refused: model manifest (parent side)"):
        done = sdserve("doctor", "--config", str(relocated.config), "--model", str(model))
    out = done.stdout + done.stderr
    assert done.returncode == ExitCode.ARTIFACT_INVALID, out[-3000:]
    assert "does not match its manifest" in out and f"{rel}: sha256" in out, out[-3000:]
    data = artifacts.read_manifest(model / artifacts.MANIFEST)
    artifacts.write_model_manifest(model, {k: v for k, v in data.items() if k not in ("files", "format")})
    with measured("doctor refused: engine binding (parent side)"):
        done = sdserve("doctor", "--config", str(relocated.config), "--model", str(model))
    out = done.stdout + done.stderr
    assert done.returncode == ExitCode.ARTIFACT_INVALID, out[-3000:]
    assert f"{rel}: engines built from sha256" in out, out[-3000:]

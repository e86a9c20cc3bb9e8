"""Helpers for the tests that run on OpenVINO's plugin execution provider (the openvino profile): real processes,
the tiny model, artifacts built once per session (tests/conftest.py ``openvino_model``).

Which library runs the proof. OpenVINO's plugin offers only Intel CPUs (``OpenVINOEpPluginFactory::
GetSupportedDevices`` in onnxruntime/core/providers/openvino/ov_factory.cc skips every device whose vendor id is not
0x8086), while OpenVINO itself runs on any x86-64 CPU. Where the plugin lists a CPU device (Intel) the tests register
it directly; where it lists none (AMD), they register tests/plugin_shim/vendor_shim.c, built here with the system C
compiler: it loads the same OpenVINO plugin and presents the CPU to it as vendor 0x8086, so the same ONNX Runtime and
the same plugin run the same graphs. ``SDSERVE_TEST_PLUGIN_SHIM=1`` forces the shim (to rehearse the AMD path on
Intel), ``=0`` forbids it. `make test` prints the choice at the top and the count of tests it ran at the end.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from engines.artifacts import ep_dir, file_table, sha256_file, write_model_manifest
from server.settings import CONFIG_DIR

EP = "OpenVINOExecutionProvider"
ARTIFACTS = ep_dir(EP)
PROFILE = CONFIG_DIR / "openvino.toml"
REPO = Path(__file__).resolve().parent.parent
SHIM_SOURCE = Path(__file__).resolve().parent / "plugin_shim" / "vendor_shim.c"
SHIM_CACHE = REPO / ".cache" / "plugin-shim"
SHIM_ORT_VERSION = "1.31.1"
"""The ONNX Runtime whose OrtApi slot numbers vendor_shim.c was written for (its table is append-only, but the
count it copies is this version's)."""
INTEL = 0x8086

_DEVICES_PROBE = """
import json, onnxruntime as ort, sys
ort.register_execution_provider_library("sdserve_probe", sys.argv[1])
print(json.dumps([[d.ep_name, str(d.device.type).rsplit(".", 1)[-1], d.device.vendor_id, d.device.vendor]
                  for d in ort.get_ep_devices()]))
"""


def cpu_facts() -> dict[str, str]:
    """The machine facts that change results: CPU vendor and model, cores."""
    facts = {"vendor": "?", "model": platform.processor() or "?", "cores": str(os.cpu_count())}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "vendor_id":
                facts["vendor"] = value.strip()
            elif key.strip() == "model name":
                facts["model"] = value.strip()
                break
    except OSError:
        pass
    return facts


def openvino_library() -> str:
    """The OpenVINO plugin library the pip package ships."""
    import onnxruntime_ep_openvino

    return str(onnxruntime_ep_openvino.get_library_path())


def listed_devices(library: str) -> list[tuple[str, str, int, str]]:
    """(EP name, device type, vendor id, vendor) of every EP device ONNX Runtime lists once ``library`` is
    registered: asked in a fresh process, so this test process never registers a plugin."""
    done = subprocess.run([sys.executable, "-c", _DEVICES_PROBE, library], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return [tuple(row) for row in json.loads(done.stdout.strip().splitlines()[-1])]  # type: ignore[misc]


def offers_cpu(library: str) -> bool:
    return any(name == EP and kind == "CPU" for name, kind, _, _ in listed_devices(library))


def build_shim(vendor_id: int = INTEL) -> Path:
    """tests/plugin_shim/vendor_shim.c compiled for the installed OpenVINO plugin, presenting CPUs as ``vendor_id``;
    cached by (source, target, vendor) under .cache/plugin-shim."""
    import onnxruntime as ort

    assert ort.__version__ == SHIM_ORT_VERSION, (
        f"vendor_shim.c copies ONNX Runtime {SHIM_ORT_VERSION}'s OrtApi table; this is {ort.__version__}: re-read "
        "include/onnxruntime/core/session/onnxruntime_c_api.h for the slot numbers and update it")
    target = openvino_library()
    key = hashlib.sha256(SHIM_SOURCE.read_bytes() + target.encode() + str(vendor_id).encode()).hexdigest()[:16]
    out = SHIM_CACHE / f"libsdserve_vendor_shim_{vendor_id:04x}_{key}.so"
    if out.is_file():
        return out
    SHIM_CACHE.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(f".{os.getpid()}.tmp")
    cc = os.environ.get("CC", "gcc")
    done = subprocess.run([cc, "-shared", "-fPIC", "-O2", "-Wall", "-Werror", "-fvisibility=hidden",
                           f'-DSHIM_TARGET="{target}"', f"-DSHIM_VENDOR_ID={vendor_id:#x}", str(SHIM_SOURCE),
                           "-o", str(partial), "-ldl", "-pthread"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{cc} could not build the vendor shim:\n{done.stderr[-2000:]}"
    partial.replace(out)
    return out


@dataclass(frozen=True)
class Accelerator:
    """What runs the accelerator proof on this machine."""

    library: str
    """Library the openvino profile registers: empty for the plugin package's own, else the vendor shim."""
    how: str
    """One line for the test report."""


@functools.cache
def accelerator() -> Accelerator:
    """The plugin directly where it offers this CPU, else the vendor shim (see the module docstring)."""
    forced = os.environ.get("SDSERVE_TEST_PLUGIN_SHIM", "")
    cpu = cpu_facts()
    if forced != "1" and offers_cpu(openvino_library()):
        return Accelerator("", f"{EP} on the CPU ({cpu['vendor']}), the plugin registered directly")
    if forced == "0":
        raise AssertionError(f"{EP} lists no CPU device on {cpu['vendor']} and SDSERVE_TEST_PLUGIN_SHIM=0 "
                             "forbids the vendor shim")
    shim = build_shim()
    assert offers_cpu(str(shim)), f"{EP} lists no CPU device even through the vendor shim {shim.name}"
    why = "forced by SDSERVE_TEST_PLUGIN_SHIM=1" if forced == "1" else "the plugin offers only vendor 0x8086"
    return Accelerator(str(shim), f"{EP} on the CPU ({cpu['vendor']}) through the vendor shim ({why})")


def profile_text(text: str) -> str:
    """A profile's text with the shim's library set under [runtime.plugin] when this machine needs it (unless
    the text already names a library)."""
    library = accelerator().library
    if not library or "\nlibrary = " in text:
        return text
    head, sep, tail = text.partition("[runtime.plugin]\n")
    assert sep, "no [runtime.plugin] table"
    return f"{head}{sep}library = {json.dumps(library)}\n{tail}"


def sdserve(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "server.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ})


def openvino_args(tmp_path: Path) -> tuple[str, str]:
    """The CLI arguments that select the openvino profile on this machine: ``--config`` of configs/openvino.toml
    as :func:`profile` writes it (the shim's library where needed)."""
    return ("--config", str(profile(tmp_path)))


def build_artifacts(source: Path, dest: Path) -> Path:
    """``source`` copied to ``dest`` and `sdserve engines build --profile openvino` run on it (asserted to pass)."""
    shutil.copytree(source, dest)
    done = sdserve("engines", "build", *openvino_args(dest.parent), "--model", str(dest))
    assert done.returncode == 0, done.stderr[-3000:]
    return dest


def profile(tmp_path: Path, replace: dict[str, str] | None = None, append: str = "") -> Path:
    """configs/openvino.toml with exact-text replacements: a profile for one test."""
    text = PROFILE.read_text()
    for old, new in (replace or {}).items():
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / "openvino.toml"
    path.write_text(profile_text(text + append))
    return path


def resign(root: Path) -> None:
    """Rewrite the files table of ``root``'s artifact manifest to what is on disk (as a rebuild would)."""
    manifest = root / "manifest.json"
    data = json.loads(manifest.read_text())
    data["files"] = file_table(root)
    manifest.write_text(json.dumps(data, indent=2, sort_keys=True))


def listing(folder: Path) -> dict[str, tuple[str, int]]:
    """relative path -> (sha256, mtime_ns) of every file under ``folder``: equal listings mean nothing was written."""
    return {p.relative_to(folder).as_posix(): (sha256_file(p), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def with_cpu_node(source: Path, dest: Path) -> str:
    """A copy of ``source`` whose VAE decoder output goes through a ``Det`` node (which OpenVINO's EP does not take,
    so ONNX Runtime leaves it on the CPU) on the activation path: ``sample + 0 * Det(sample[..., :2, :2])``. The model
    manifest is re-signed so only the placement is wrong. Returns the Det node's name."""
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("ep"))
    path = dest / "vae_decoder" / "model.onnx"
    model = onnx.load(str(path))
    graph = model.graph
    out = graph.output[0].name
    graph.node[-1].output[0] = "pre_det"
    consts = {"starts": [0, 0], "ends": [2, 2], "axes": [2, 3], "zero": 0.0, "unsq": [2, 3]}
    for name, value in consts.items():
        graph.initializer.append(numpy_helper.from_array(
            np.array(value, dtype=np.float32 if name == "zero" else np.int64), f"det_{name}"))
    det = "cpu_only_Det"
    graph.node.extend([
        helper.make_node("Slice", ["pre_det", "det_starts", "det_ends", "det_axes"], ["det_in"], name="det_slice"),
        helper.make_node("Det", ["det_in"], ["det_out"], name=det),
        helper.make_node("Mul", ["det_out", "det_zero"], ["det_zeroed"], name="det_mul"),
        helper.make_node("Unsqueeze", ["det_zeroed", "det_unsq"], ["det_4d"], name="det_unsqueeze"),
        helper.make_node("Add", ["pre_det", "det_4d"], [out], name="det_add")])
    onnx.save(model, str(path))
    data = json.loads((dest / "manifest.json").read_text())
    write_model_manifest(dest, {k: v for k, v in data.items() if k not in ("files", "format")})
    return det


def header_lines() -> list[str]:
    """The machine facts that change results and what runs the accelerator proof (`make test` prints them first;
    tests/conftest.py puts them in pytest's header)."""
    from importlib import metadata

    def version(package: str) -> str:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return "not installed"

    cpu = cpu_facts()
    lines = [f"machine: {cpu['vendor']} {cpu['model']}, {cpu['cores']} cores; onnxruntime "
             f"{version('onnxruntime-gpu')}, onnxruntime-ep-openvino {version('onnxruntime-ep-openvino')} "
             "(ships its OpenVINO runtime)"]
    try:
        lines.append(f"accelerator proof runs on: {accelerator().how}")
    except (AssertionError, ImportError, OSError) as exc:  # reported here; the plugin_ep tests then fail loudly
        lines.append(f"accelerator proof CANNOT run: {exc}")
    return lines


if __name__ == "__main__":
    print("\n".join(header_lines()))

"""Preflight: what the fast path needs, checked before any model loads, compared with configs/matrix.toml.

``gather()`` reads the machine (ORT build, provider library closures, NVML, cuDNN and TensorRT versions);
``evaluate()`` is a pure function from those observations, the matrix and the policy to a list of checks.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

import onnxruntime as ort

from engines.config import Matrix, PluginEp, RuntimeSettings
from engines.health.matrix import at_least, matches
from engines.health.telemetry import DeviceInfo, NvmlReport, match_cuda_to_nvml, read_nvml
from engines.runtime.libdeps import PROVIDER_LIBRARIES, Closure, library_closure, provider_closure, resolve
from engines.runtime.pinned import cuda_pci_bus_ids
from engines.runtime.plugins import PluginReport, observe
from engines.types.snapshot import CheckResult, FoundVersion, LibraryClosure, PluginInfo
from engines.types.snapshot import Observations as ProtocolObservations

Status = Literal["pass", "fail", "skip"]
Category = Literal["gpu", "version"]


@dataclass(frozen=True)
class Check:
    name: str
    category: Category
    status: Status
    observed: str
    expected: str
    remediation: str = ""

    def to_model(self) -> CheckResult:
        return CheckResult(**asdict(self))


@dataclass
class Observations:
    ort_version: str
    ort_cuda_version: str
    available_providers: list[str]
    closures: dict[str, Closure]
    nvml: NvmlReport
    cudnn_version: str | None
    cudnn_source: str = ""
    tensorrt_version: str | None = None
    tensorrt_source: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    cuda_bus_ids: list[str] | None = None
    """PCI bus id per CUDA ordinal (this process's numbering); None when the CUDA runtime could not be asked."""
    plugin: PluginReport | None = None
    tensorrt_install: str = ""
    """installed / placeholder / not installed (tensorrt_install())."""

    def nvml_index(self, device_id: int) -> int | None:
        """NVML index of CUDA ordinal ``device_id``, matched by PCI bus id (CUDA_VISIBLE_DEVICES renumbers CUDA
        ordinals, never NVML's). None without CUDA's answer: the same number would be a guess, and with
        CUDA_VISIBLE_DEVICES set it names another card."""
        if self.cuda_bus_ids is None:
            return None
        return match_cuda_to_nvml(self.cuda_bus_ids, self.nvml.devices).get(device_id)

    def device(self, device_id: int) -> DeviceInfo | None:
        index = self.nvml_index(device_id)
        return next((d for d in self.nvml.devices if d.index == index), None)

    def memory_total(self, device_id: int) -> int | None:
        """Total memory of the served device (bytes) as NVML reports it; None without NVML or a match, and under
        MIG when the slice is unknown (the parent GPU's total is not what this process can use)."""
        device = self.device(device_id)
        return device.memory_total_bytes if device is not None and device.memory_total_bytes > 0 else None

    def to_model(self) -> ProtocolObservations:
        return ProtocolObservations(
            onnxruntime=self.ort_version, onnxruntime_cuda_build=self.ort_cuda_version,
            available_providers=tuple(self.available_providers),
            provider_libraries={p: LibraryClosure(library=c.library, missing=dict(c.missing),
                                                  resolved=dict(c.resolved)) for p, c in self.closures.items()},
            nvml=self.nvml.to_model(), cudnn=FoundVersion(version=self.cudnn_version, source=self.cudnn_source),
            tensorrt=FoundVersion(version=self.tensorrt_version, source=self.tensorrt_source),
            plugin=PluginInfo(**{**self.plugin.to_dict(), "devices": tuple(self.plugin.devices)})
            if self.plugin else None, tensorrt_install=self.tensorrt_install)


def _dist_version(names: tuple[str, ...]) -> tuple[str | None, str]:
    for name in names:
        try:
            return metadata.version(name), f"pip {name}"
        except metadata.PackageNotFoundError:
            continue
    return None, ""


def decode_version(number: int) -> str:
    """A library's integer version as dotted text. cuDNN 9 and TensorRT 10 encode major*10000 + minor*100 + patch
    (CUDNN_VERSION in cudnn_version.h since 9.0, NV_TENSORRT_VERSION in NvInferVersion.h since 10.0); cuDNN 8 and
    TensorRT 8 used major*1000 + minor*100 + patch."""
    if number >= 10000:
        return f"{number // 10000}.{number // 100 % 100}.{number % 100}"
    return f"{number // 1000}.{number // 100 % 10}.{number % 100}"


def loaded_version(soname: str, symbol: str,
                   load: Callable[[str], Any] = ctypes.CDLL) -> tuple[str | None, str]:
    """The version the library itself reports (``size_t cudnnGetVersion(void)``, ``int32_t getInferLibVersion(void)``
    in NvInferRuntime.h), loaded from where sessions will find it; (None, why) when it does not resolve or load."""
    path = resolve(soname)
    if path is None:
        return None, f"{soname} not found"
    try:
        function = getattr(load(path), symbol)
        function.restype = ctypes.c_size_t if symbol == "cudnnGetVersion" else ctypes.c_int32
        function.argtypes = []
        return decode_version(int(function())), f"{symbol}() of {path}"
    except (OSError, AttributeError) as exc:
        return None, f"{path} does not load: {exc}"


TENSORRT_DISTS = ("tensorrt", "tensorrt-cu13", "tensorrt-cu13-libs", "tensorrt-libs")


def library_or_pip(soname: str, symbol: str, dists: tuple[str, ...],
                   load: Callable[[str], Any] = ctypes.CDLL) -> tuple[str | None, str]:
    """The loaded library's own version when it loads; else pip metadata, saying the library did not load (pip
    metadata names a wheel, not what a session would load)."""
    found, why = loaded_version(soname, symbol, load)
    if found is not None:
        return found, why
    pip, source = _dist_version(dists)
    return (pip, f"{source}; library not loadable: {why}") if pip else (None, why)


def tensorrt_install(dist: str | None, library: str | None) -> str:
    """"installed" when libnvinfer resolves; "placeholder" when a pip TensorRT package is there without it (PyPI's
    tensorrt-cu13-libs is a stub that fetches the real wheel from NVIDIA's index at install time); else "not
    installed"."""
    if library is not None:
        return "installed"
    return "placeholder" if dist is not None else "not installed"


def gather(plugin: PluginEp | None = None) -> Observations:
    from onnxruntime.capi import build_and_package_info

    capi = Path(ort.__file__).parent / "capi"
    closures = {p: provider_closure(p, capi) for p in PROVIDER_LIBRARIES if (capi / PROVIDER_LIBRARIES[p]).exists()}
    cudnn, cudnn_src = library_or_pip("libcudnn.so.9", "cudnnGetVersion", ("nvidia-cudnn-cu13", "nvidia-cudnn-cu12"))
    trt, trt_src = library_or_pip("libnvinfer.so.10", "getInferLibVersion", TENSORRT_DISTS)
    install = tensorrt_install(_dist_version(TENSORRT_DISTS)[0], resolve("libnvinfer.so.10"))
    nvml = read_nvml()
    found = observe(plugin) if plugin is not None else None
    if plugin is not None and found is not None and found.library:
        closures[plugin.name] = library_closure(plugin.name, Path(found.library))
    return Observations(ort.__version__, str(getattr(build_and_package_info, "cuda_version", "")),
                        list(ort.get_available_providers()), closures, nvml, cudnn, cudnn_src, trt, trt_src,
                        cuda_bus_ids=cuda_pci_bus_ids() if nvml.available else None, plugin=found,
                        tensorrt_install=install)


def _versions(obs: Observations, matrix: Matrix, settings: RuntimeSettings) -> list[Check]:
    m = matrix
    checks = [
        Check("onnxruntime_version", "version", "pass" if matches(obs.ort_version, m.onnxruntime.version) else "fail",
              obs.ort_version, m.onnxruntime.version, f"pip install onnxruntime-gpu=={m.onnxruntime.version}"),
        Check("onnxruntime_cuda_build", "version",
              "pass" if matches(obs.ort_cuda_version, m.onnxruntime.cuda) else "fail", obs.ort_cuda_version or "none",
              m.onnxruntime.cuda, "install the onnxruntime-gpu build for the matrix's CUDA"),
    ]
    if obs.cudnn_version is None:
        checks.append(Check("cudnn_version", "gpu", "fail", f"not found ({obs.cudnn_source or 'no libcudnn.so.9'})",
                            f"{m.cudnn.major}.x", "pip install 'onnxruntime-gpu[cuda,cudnn]' (nvidia-cudnn-cu13)"))
    else:
        ok = matches(obs.cudnn_version, m.cudnn.major)
        checks.append(Check("cudnn_version", "version", "pass" if ok else "fail",
                            f"{obs.cudnn_version} ({obs.cudnn_source})", f"{m.cudnn.major}.x",
                            f"install cuDNN {m.cudnn.major} for CUDA {m.onnxruntime.cuda}"))
    if "TensorrtExecutionProvider" not in settings.providers:
        checks.append(Check("tensorrt_version", "version", "skip", obs.tensorrt_version or "not found",
                            m.tensorrt.version, "absent by design: TensorRT is not in the provider policy "
                            f"({', '.join(settings.providers) or 'a plugin EP'}), so it is not required"))
    elif obs.tensorrt_version is None or obs.tensorrt_install == "placeholder":
        observed = ("TensorRT wheel is a placeholder: a pip TensorRT package is installed but libnvinfer.so.10 is "
                    "not (PyPI's tensorrt-cu13-libs only fetches the real wheel from NVIDIA's index at install "
                    "time)" if obs.tensorrt_install == "placeholder" else "TensorRT not installed")
        checks.append(Check("tensorrt_version", "gpu", "fail", observed, f"{m.tensorrt.version}.x",
                            "pip install 'tensorrt-cu13==10.*' with NVIDIA's package index as an extra index (not "
                            "plain `tensorrt`: that is 11.x)"))
    else:
        ok = matches(obs.tensorrt_version, m.tensorrt.version)
        checks.append(Check("tensorrt_version", "version", "pass" if ok else "fail",
                            f"{obs.tensorrt_version} ({obs.tensorrt_source})", f"{m.tensorrt.version}.x",
                            f"TensorRT {obs.tensorrt_version} cannot load in ORT {obs.ort_version}'s provider; "
                            f"pip install 'tensorrt-cu13=={m.tensorrt.version}.*'"))
    return checks


def _providers(obs: Observations, settings: RuntimeSettings) -> list[Check]:
    checks = []
    for provider in settings.providers:
        if provider == "CPUExecutionProvider":
            continue
        compiled = provider in obs.available_providers
        checks.append(Check(f"provider_compiled:{provider}", "gpu", "pass" if compiled else "fail",
                            ", ".join(obs.available_providers), provider, "install onnxruntime-gpu, not onnxruntime"))
        closure = obs.closures.get(provider)
        if closure is None:
            continue
        missing = "; ".join(f"{lib} (needed by {closure.needed_by.get(lib, '?')}; ships in {pkg})"
                            for lib, pkg in closure.missing.items())
        checks.append(Check(f"provider_libraries:{provider}", "gpu", "fail" if closure.missing else "pass",
                            f"missing: {missing}" if missing else f"{len(closure.resolved)} libraries resolve",
                            "every dependency of " + Path(closure.library).name + " resolves",
                            "install the packages named (the server preloads the pip nvidia-* and TensorRT wheels as "
                            "onnxruntime.preload_dlls() does), or set LD_LIBRARY_PATH"))
    return checks


def _device(obs: Observations, matrix: Matrix, settings: RuntimeSettings) -> list[Check]:
    nv, m = obs.nvml, matrix
    if not nv.available:
        return [Check("nvml", "gpu", "fail", nv.error, "NVIDIA driver and device visible",
                      "run on a GPU node; in containers use the NVIDIA container toolkit (--gpus / nvidia.com/gpu)")]
    checks = [Check("nvml", "gpu", "pass", f"driver {nv.driver_version}", "NVIDIA driver and device visible")]
    count = len(nv.devices) if obs.cuda_bus_ids is None else len(obs.cuda_bus_ids)
    device = obs.device(settings.device_id)
    where = f"NVML index {device.index} ({device.pci_bus_id or 'bus id unknown'})" if device else "no NVML match"
    checks.append(Check("device_count", "gpu", "pass" if count >= m.device.count and device is not None
                        else "fail", f"{count} CUDA device(s), serving ordinal {settings.device_id}: {where}",
                        f">= {m.device.count} device(s)", "check CUDA_VISIBLE_DEVICES and --device-id"))
    checks.append(Check("driver_version", "version", "pass" if at_least(nv.driver_version, m.driver.min_version)
                        else "fail", nv.driver_version, f">= {m.driver.min_version}",
                        f"upgrade the NVIDIA driver to {m.driver.min_version} or newer"))
    checks.append(Check("cuda_driver", "version", "pass" if at_least(nv.cuda_driver_version, m.onnxruntime.cuda)
                        else "fail", nv.cuda_driver_version, f">= {m.onnxruntime.cuda}",
                        "the driver must support the CUDA version ORT was built for"))
    if device is not None:
        checks.append(Check("compute_capability", "gpu", "pass" if device.compute_capability in
                            m.device.compute_capabilities else "fail", f"{device.name} sm {device.compute_capability}",
                            ", ".join(m.device.compute_capabilities), "schedule onto a supported GPU"))
    return checks


def _plugin(obs: Observations, matrix: Matrix, plugin: PluginEp) -> list[Check]:
    """The plugin EP: package installed, library loads with its dependencies, a device of the wanted type, and the
    package and the loaded library at the version configs/matrix.toml pins."""
    found = obs.plugin or PluginReport(plugin.name, plugin.package, error="not observed")
    name, package = plugin.name, plugin.package
    checks = [Check(f"plugin_package:{name}", "gpu", "pass" if found.package_version else "fail",
                    f"{package} {found.package_version}" if found.package_version else found.error,
                    f"pip package {package} installed", f"pip install {package}")]
    closure = obs.closures.get(name)
    if closure is not None:
        missing = "; ".join(f"{lib} (needed by {closure.needed_by.get(lib, '?')})" for lib in closure.missing)
        checks.append(Check(f"provider_libraries:{name}", "gpu", "fail" if closure.missing else "pass",
                            f"missing: {missing}" if missing else f"{len(closure.resolved)} libraries resolve",
                            "every dependency of " + Path(closure.library).name + " resolves",
                            f"reinstall {package}"))
    if found.package_version:
        checks.append(Check(f"plugin_library:{name}", "gpu", "fail" if found.error else "pass",
                            found.error or f"{found.library} registered; {found.devices[0]['device_name']}",
                            f"{name} registered from {package} with a {plugin.device_type} device",
                            "see the cause in the observed line: the library loads, the plugin offers no device"
                            if found.loaded else f"reinstall {package}, or check runtime.plugin.library"))
    pinned = matrix.plugins.get(name)
    if pinned is None:
        checks.append(Check(f"plugin_version:{name}", "version", "fail", f"{package} {found.package_version}",
                            "an entry in configs/matrix.toml [plugins]", f"pin {name} in configs/matrix.toml"))
    elif found.package_version:
        versions = [v for v in (found.package_version, found.library_version) if v]
        ok = pinned.package == package and all(matches(v, pinned.version) for v in versions)
        checks.append(Check(f"plugin_version:{name}", "version", "pass" if ok else "fail",
                            f"{package} {found.package_version} (pip), library reports {found.library_version}",
                            f"{pinned.package} {pinned.version}", f"pip install '{pinned.package}=={pinned.version}'"))
    return checks


def evaluate(obs: Observations, matrix: Matrix, settings: RuntimeSettings) -> list[Check]:
    """All checks. With a CPU-only policy they are reported but skipped (nothing GPU is required). With a plugin EP:
    the ONNX Runtime versions and the plugin's checks, plus the NVIDIA device checks for a GPU plugin."""
    if settings.plugin is not None:
        checks = [*_versions(obs, matrix, settings)[:2], *_plugin(obs, matrix, settings.plugin)]
        return checks + (_device(obs, matrix, settings) if settings.device == "cuda" else [])
    checks = [*_versions(obs, matrix, settings), *_providers(obs, settings), *_device(obs, matrix, settings)]
    if settings.device == "cpu":
        return [Check(c.name, c.category, "skip" if c.status == "fail" else c.status, c.observed, c.expected,
                      "not required: the profile runs on the CPU") if c.status == "fail" else c for c in checks]
    return checks


def failures(checks: list[Check]) -> tuple[list[Check], list[Check]]:
    """(gpu-path failures, version-matrix failures)."""
    failed = [c for c in checks if c.status == "fail"]
    return [c for c in failed if c.category == "gpu"], [c for c in failed if c.category == "version"]

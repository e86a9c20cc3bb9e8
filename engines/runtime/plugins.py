"""Plugin execution providers (ONNX Runtime's EP ABI): find the library a pip package ships, register it once per
process, and pick the EP devices sessions are built on.

How ORT 1.31 exposes them (read in the installed wheel's onnxruntime/capi/onnxruntime_inference_collection.py and
checked here with onnxruntime-ep-openvino 1.8.1): ``onnxruntime.register_execution_provider_library(name, path)``
loads the library (a bad path raises "Failed to load library ... cannot open shared object file"; registering the
same name twice raises "EP library is already registered"); ``onnxruntime.get_ep_devices()`` then lists one
``OrtEpDevice`` per (EP, hardware device) with ``ep_name``, ``ep_vendor``, ``ep_metadata`` (the loaded library's own
``version``) and ``device.type``; ``SessionOptions.add_provider_for_devices(devices, options)`` puts the EP in a
session. Naming the EP in ``providers=`` instead only warns and runs on the CPU, so config validation refuses it.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import onnxruntime as ort

from engines.config import PluginEp
from engines.errors import GpuUnavailableError

log = logging.getLogger(__name__)
_REGISTERED: dict[str, str] = {}
"""registration name -> library path, for this process (ORT refuses a second registration under one name)."""


@dataclass(frozen=True)
class VendorRule:
    """A plugin that offers only one vendor's devices, whatever else could run it."""

    vendor_id: int
    vendor: str
    where: str
    """Where the rule lives in the plugin's source."""


VENDOR_RULES: dict[str, VendorRule] = {
    # OpenVINOEpPluginFactory::GetSupportedDevices (onnxruntime/core/providers/openvino/ov_factory.cc) skips every
    # OrtHardwareDevice whose vendor id is not 0x8086 ("Not an Intel Device"), though OpenVINO runs on other x86-64.
    "OpenVINOExecutionProvider": VendorRule(0x8086, "Intel", "OpenVINOEpPluginFactory::GetSupportedDevices in "
                                            "onnxruntime/core/providers/openvino/ov_factory.cc"),
}


@dataclass
class PluginReport:
    """What preflight found about a plugin EP: package, library, registration, devices."""

    name: str
    package: str
    package_version: str | None = None
    library: str = ""
    library_version: str | None = None
    """The version the loaded library reports (ep_metadata['version'] of its devices)."""
    devices: list[dict[str, str]] = field(default_factory=list)
    error: str = ""
    """Why the plugin is unusable (empty: registered, with a device of the wanted type)."""
    loaded: bool = False
    """The library registered (so an error is about devices, never about the installation)."""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "package": self.package, "package_version": self.package_version,
                "library": self.library, "library_version": self.library_version, "devices": self.devices,
                "error": self.error}


def library_path(plugin: PluginEp) -> str:
    """The plugin's library: ``plugin.library``, else the package module's ``get_library_path()``. Raises
    GpuUnavailableError naming the package when neither gives an existing file."""
    if plugin.library:
        path = plugin.library
    else:
        try:
            module = importlib.import_module(plugin.import_name)
            path = str(module.get_library_path())
        except (ImportError, AttributeError) as exc:
            raise GpuUnavailableError(f"plugin EP {plugin.name}: cannot import {plugin.import_name} from pip "
                                      f"package {plugin.package} ({exc}): pip install {plugin.package}") from None
    if not Path(path).is_file():
        raise GpuUnavailableError(f"plugin EP {plugin.name}: library {path} of package {plugin.package} does not "
                                  f"exist: reinstall {plugin.package}")
    return path


def register(plugin: PluginEp) -> str:
    """Register the plugin's library once per process; returns its path. GpuUnavailableError (exit 20) names the
    package when the library is missing or does not load."""
    path = library_path(plugin)
    known = _REGISTERED.get(plugin.registration)
    if known is not None:
        if known != path:
            raise GpuUnavailableError(f"plugin EP {plugin.name}: already registered from {known}, not {path}")
        return path
    try:
        ort.register_execution_provider_library(plugin.registration, path)
    except Exception as exc:  # ORT raises its plain Fail/RuntimeError types
        raise GpuUnavailableError(f"plugin EP {plugin.name}: library {path} of package {plugin.package} does not "
                                  f"load: {str(exc).strip()[:400]}") from None
    _REGISTERED[plugin.registration] = path
    log.info("plugin EP %s registered from %s", plugin.name, path)
    return path


def devices(plugin: PluginEp) -> list[Any]:
    """The OrtEpDevices of ``plugin.name`` on a ``plugin.device_type`` device (register first). Exact EP-name
    match: OpenVINO also lists ``OpenVINOExecutionProvider.AUTO``, a meta device that may pick another target."""
    listed = ort.get_ep_devices()
    found = [d for d in listed if d.ep_name == plugin.name and _type(d) == plugin.device_type]
    if not found:
        offered = sorted({f"{d.ep_name} on {_type(d)}" for d in listed if d.ep_name.startswith(plugin.name)})
        hardware = sorted({(_type(d), int(d.device.vendor_id), str(d.device.vendor)) for d in listed})
        raise GpuUnavailableError(no_device_message(plugin, offered, hardware))
    return found[:1]


def _type(device: Any) -> str:
    return str(device.device.type).rsplit(".", 1)[-1]


def no_device_message(plugin: PluginEp, offered: list[str], hardware: list[tuple[str, int, str]]) -> str:
    """Why a registered plugin offers no device of the wanted type: what ONNX Runtime found, what the plugin offered,
    and the likely cause from what is known (a vendor rule in the plugin's own factory, or the device type). The
    library loaded, so reinstalling it is never the advice."""
    seen = ", ".join(f"{kind} {vendor or '?'} (vendor id {vendor_id:#06x})" for kind, vendor_id, vendor in hardware)
    text = (f"plugin EP {plugin.name} (package {plugin.package}) loaded but lists no {plugin.device_type} device. "
            f"ONNX Runtime found: {seen or 'no hardware devices'}; the plugin offered: "
            f"{', '.join(offered) or 'nothing'}. ")
    rule = VENDOR_RULES.get(plugin.name)
    wanted = [(vendor_id, vendor) for kind, vendor_id, vendor in hardware if kind == plugin.device_type]
    if rule is not None and wanted and all(vendor_id != rule.vendor_id for vendor_id, _ in wanted):
        vendors = ", ".join(sorted({f"{vendor or '?'} {vendor_id:#06x}" for vendor_id, vendor in wanted}))
        return text + (f"Cause: the plugin's vendor rule, not the installation: {rule.where} offers only devices "
                       f"whose vendor id is {rule.vendor_id:#06x} ({rule.vendor}); this {plugin.device_type} is "
                       f"{vendors}. Run this profile on a node with an {rule.vendor} {plugin.device_type}, or "
                       "choose a profile whose accelerator this node has.")
    if not wanted:
        return text + (f"Cause: ONNX Runtime found no {plugin.device_type} device at all: check "
                       "runtime.plugin.device_type against the hardware listed.")
    return text + ("Likely cause: the plugin cannot use this hardware (its own log lines above say why), or "
                   "runtime.plugin.device_type names a type it does not serve.")


def describe(device: Any) -> dict[str, str]:
    meta = dict(device.ep_metadata)
    return {"ep_name": str(device.ep_name), "ep_vendor": str(device.ep_vendor),
            "device_type": str(device.device.type).rsplit(".", 1)[-1], "version": str(meta.get("version", "")),
            "device_name": str(meta.get("FULL_DEVICE_NAME", device.device.vendor))}


def observe(plugin: PluginEp) -> PluginReport:
    """Preflight's view: package version (pip metadata), library path, registration, devices and the version the
    loaded library reports. Never raises: the error says what failed, naming the package."""
    report = PluginReport(plugin.name, plugin.package)
    try:
        report.package_version = metadata.version(plugin.package)
    except metadata.PackageNotFoundError:
        report.error = f"pip package {plugin.package} is not installed (pip install {plugin.package})"
        return report
    try:
        report.library = register(plugin)
        report.loaded = True
        report.devices = [describe(d) for d in devices(plugin)]
    except GpuUnavailableError as exc:
        report.error = str(exc)
        return report
    report.library_version = report.devices[0]["version"] or None
    return report


def add_to(options: ort.SessionOptions, plugin: PluginEp) -> None:
    """Put the plugin EP (registered on first use) into ``options`` for its device."""
    register(plugin)
    options.add_provider_for_devices(devices(plugin), dict(plugin.options))

"""`sdserve serve`: boot the engine behind the HTTP API (port opens at once; /ready turns green when proven)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from engines.errors import ConfigError, ModelLoadError
from server.cli.common import add_boot_args, boot_config
from server.settings import ServerSettings, Settings

log = logging.getLogger("sdserve")


def register(sub: Any) -> None:
    p = sub.add_parser("serve", help="serve the HTTP API")
    add_boot_args(p)
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=None, help="0 picks a free port and logs it")
    p.add_argument("--cors-allow-origins", default=None, metavar="ORIGINS",
                   help="browser origins allowed, comma-separated without spaces (A1111's flag); replaces [server] "
                   "cors_origins")
    p.add_argument("--cors-allow-origins-regex", default=None, metavar="REGEX",
                   help="browser origins allowed, one regular expression matching the whole origin (A1111's flag); "
                   "replaces [server] cors_origin_regex")
    p.add_argument("--lora-dir", type=Path, default=None, metavar="DIR",
                   help="folder of .safetensors LoRA files (A1111's flag); replaces [runtime.lora] dir")
    p.add_argument("--controlnet-dir", type=Path, default=None, metavar="DIR",
                   help="folder of exported ControlNets, one subfolder each (A1111's flag); replaces "
                   "[runtime.controlnet] dir")
    p.add_argument("--upscaler-dir", type=Path, default=None, metavar="DIR",
                   help="folder of ESRGAN-family upscalers as <name>.onnx (/sdapi/v1/extra-single-image); replaces "
                   "[runtime] upscaler_dir")
    p.set_defaults(run=run)


def with_lora_dir(settings: Settings, folder: Path | None) -> Settings:
    """The profile with ``--lora-dir`` applied (ConfigError, exit 10, when it is not a folder)."""
    if folder is None:
        return settings
    if not folder.is_dir():
        raise ConfigError(f"--lora-dir {folder}: not a folder")
    lora = settings.runtime.lora.model_copy(update={"dir": str(folder.resolve())})
    return settings.model_copy(update={"runtime": settings.runtime.model_copy(update={"lora": lora})})


def with_controlnet_dir(settings: Settings, folder: Path | None) -> Settings:
    """The profile with ``--controlnet-dir`` applied (ConfigError, exit 10, when it is not a folder)."""
    if folder is None:
        return settings
    if not folder.is_dir():
        raise ConfigError(f"--controlnet-dir {folder}: not a folder")
    controlnet = settings.runtime.controlnet.model_copy(update={"dir": str(folder.resolve())})
    return settings.model_copy(update={"runtime": settings.runtime.model_copy(update={"controlnet": controlnet})})


def with_cors(settings: Settings, origins: str | None, regex: str | None) -> Settings:
    """The profile with A1111's CORS flags applied, validated again (ConfigError, exit 10, names the flag)."""
    if origins is None and regex is None:
        return settings
    server = settings.server.model_dump()
    if origins is not None:
        server["cors_origins"] = tuple(o for o in origins.split(",") if o)
    if regex is not None:
        server["cors_origin_regex"] = regex
    try:
        return settings.model_copy(update={"server": ServerSettings.model_validate(server)})
    except ValidationError as exc:
        raise ConfigError(f"--cors-allow-origins / --cors-allow-origins-regex: {exc.errors()[0]['msg']}") from None


def check_model_folder(model: Path) -> None:
    """Exit 11 at once, before the port opens, for a model path that is missing or not a folder."""
    if not model.exists():
        raise ModelLoadError(f"model folder {model} does not exist (--model or SDSERVE_MODEL)")
    if not model.is_dir():
        raise ModelLoadError(f"model path {model} is not a folder (--model or SDSERVE_MODEL)")


def run(args: argparse.Namespace) -> int:
    """Exit codes: 11 model folder missing, 12 port cannot be bound, 10 bad profile; the rest from boot."""
    from server.app import create_app
    from server.launcher import Launcher
    from server.upscale import with_upscaler_dir

    check_model_folder(args.model)
    boot = boot_config(args)
    boot = dataclasses.replace(boot, settings=with_upscaler_dir(with_lora_dir(
        with_cors(boot.settings, args.cors_allow_origins, args.cors_allow_origins_regex), args.lora_dir),
        args.upscaler_dir))
    boot = dataclasses.replace(boot, settings=with_controlnet_dir(boot.settings, args.controlnet_dir))
    settings = boot.settings
    if settings.runtime.allow_cpu:
        log.warning("profile %s allows the CPU: this server is NOT accelerated (accelerated: false)",
                    settings.profile)
    if boot.faults is not None:
        log.warning("fault injection enabled (dev profile): PUT /debug/faults can slow this server down")
    launcher = Launcher(settings)
    app = create_app(boot.engine(watch_ort_log=True), settings, launcher.on_fatal, boot.faults)
    return launcher.run(app)

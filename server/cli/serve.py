"""`sdserve serve`: boot the engine behind the HTTP API (port opens at once; /ready turns green when proven)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from engines.errors import ModelLoadError
from server.cli.common import add_boot_args, boot_config

log = logging.getLogger("sdserve")


def register(sub: Any) -> None:
    p = sub.add_parser("serve", help="serve the HTTP API")
    add_boot_args(p)
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=None, help="0 picks a free port and logs it")
    p.set_defaults(run=run)


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

    check_model_folder(args.model)
    boot = boot_config(args)
    settings = boot.settings
    if settings.runtime.allow_cpu:
        log.warning("profile %s allows the CPU: this server is NOT accelerated (accelerated: false)",
                    settings.profile)
    if boot.faults is not None:
        log.warning("fault injection enabled (dev profile): PUT /debug/faults can slow this server down")
    launcher = Launcher(settings)
    app = create_app(boot.engine(watch_ort_log=True), settings, launcher.on_fatal, boot.faults)
    return launcher.run(app)

"""`sdserve serve`: boot the engine behind the HTTP API (port opens at once; /ready turns green when proven)."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from server.cli.common import add_boot_args, boot_config

log = logging.getLogger("sdserve")


def register(sub: Any) -> None:
    p = sub.add_parser("serve", help="serve the HTTP API")
    add_boot_args(p)
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=None, help="0 picks a free port and logs it")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from server.app import create_app
    from server.launcher import Launcher

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

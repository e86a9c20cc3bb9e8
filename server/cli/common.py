"""Arguments shared by the commands that boot an engine, and their translation into a BootConfig."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from server.bootstrap import BootConfig
from server.settings import PROFILES

DEFAULT_MODEL = Path("models/tiny")


def add_boot_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", choices=PROFILES, default="production",
                   help="settings profile from configs/ (default: production)")
    p.add_argument("--config", type=Path, default=None, help="a profile TOML file instead of configs/<profile>.toml")
    p.add_argument("--model", type=Path, default=Path(os.environ.get("SDSERVE_MODEL", DEFAULT_MODEL)),
                   help="ONNX model folder (env SDSERVE_MODEL; default models/tiny)")
    p.add_argument("--device-id", type=int, default=None, help="CUDA device this process serves")
    p.add_argument("--matrix", type=Path, default=None, help="version matrix TOML (default: configs/matrix.toml)")


def boot_config(args: argparse.Namespace) -> BootConfig:
    return BootConfig.create(args.model, args.profile, args.config, args.matrix, getattr(args, "host", None),
                             getattr(args, "port", None), args.device_id)

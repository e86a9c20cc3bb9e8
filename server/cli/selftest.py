"""`sdserve selftest`: run the boot self-test, or record canary fingerprints next to the model."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from server.cli.common import add_boot_args, boot_config

log = logging.getLogger("sdserve")


def register(sub: Any) -> None:
    p = sub.add_parser("selftest", help="run the boot self-test, or record canary fingerprints next to the model")
    add_boot_args(p)
    p.add_argument("--record", action="store_true", help="write <model>/selftest.json from this node's outputs")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    engine = boot_config(args).engine()
    engine.preflight()
    engine.load()
    try:
        if args.record:
            log.info("recorded canary fingerprints to %s", engine.record_fingerprints())
        else:
            print(engine.self_test().model_dump_json(indent=2))
    finally:
        engine.close()
    return 0

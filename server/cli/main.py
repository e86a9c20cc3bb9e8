"""`sdserve` entry point: builds the parser from one module per subcommand and maps errors to exit codes."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from engines.errors import SdserveError
from server.cli import accept, bench, deploy, doctor, engines, gate, generate, selftest, serve
from server.exitcodes import ExitCode, exit_code_for

log = logging.getLogger("sdserve")
COMMANDS = (serve, doctor, selftest, generate, engines, bench, gate, deploy, accept)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sdserve", description="A Stable Diffusion server that proves its GPU fast "
                                                            "path; exits non-zero with a documented code when not.")
    p.add_argument("--log-level", default=os.environ.get("SDSERVE_LOG_LEVEL", "INFO"))
    sub = p.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpcore", "matplotlib"):  # one line per request is noise in a load test
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        code: int = args.run(args)
        return code
    except SdserveError as exc:
        exit_code = exit_code_for(exc)
        log.error("%s (exit code %d %s)", exc, exit_code, exit_code.name)
        return int(exit_code)
    except FileNotFoundError as exc:
        log.error("%s", exc)
        return int(ExitCode.MODEL_INVALID)


if __name__ == "__main__":
    sys.exit(main())

"""`sdserve` entry point: builds the parser from one module per subcommand and maps errors to exit codes."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from engines.errors import SdserveError
from server.cli import accept, bench, deploy, doctor, engines, gate, generate, selftest, serve, verify
from server.exitcodes import ExitCode, exit_code_for
from server.middleware import escape_controls

log = logging.getLogger("sdserve")
COMMANDS = (serve, doctor, selftest, generate, engines, bench, gate, deploy, accept, verify)
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, the access-log fields (``record.access``, see
    server/middleware.py) when present, and the traceback as text."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {"time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{record.msecs:03.0f}",
                                   "level": record.levelname, "logger": record.name,
                                   "message": record.getMessage()}
        line |= getattr(record, "access", None) or {}
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """TEXT_FORMAT with control characters in the message escaped (server/middleware.py escape_controls): a
    request path holding CR/LF cannot forge or split a line. Tracebacks keep their own lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        record.message = escape_controls(record.message)
        return super().formatMessage(record)


def configure_logging(level: str, fmt: str) -> None:
    """stderr, text or JSON lines (``--log-format``)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler])


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sdserve")
    except PackageNotFoundError:  # running from a checkout that was never installed
        return "unknown (not installed)"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sdserve", description="A Stable Diffusion server that proves its GPU fast "
                                                            "path; exits non-zero with a documented code when not.")
    p.add_argument("--log-level", default=os.environ.get("SDSERVE_LOG_LEVEL", "INFO"))
    p.add_argument("--log-format", choices=("text", "json"), default=os.environ.get("SDSERVE_LOG_FORMAT", "text"),
                   help="json: one JSON object per log line (access lines carry their fields)")
    p.add_argument("--version", action="version", version=f"sdserve {_version()}")
    sub = p.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    configure_logging(args.log_level, args.log_format)
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

"""Capture what ONNX Runtime prints while building sessions, classify it, and re-emit it through logging.

Native ORT messages go to file descriptor 2 only (no Python callback); the Python wrapper's fallback banner goes to
``sys.stdout``. Both are captured around session creation, kept raw for operators, and classified into the events
that mean the fast path is not what it seems.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import cast

from engines.types.snapshot import EventKind, OrtEvent, Severity

log = logging.getLogger(__name__)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_CAPTURE_LOCK = threading.Lock()


# (kind, severity, pattern); the first group, when present, becomes the event's detail.
RULES: tuple[tuple[EventKind, str, re.Pattern[str]], ...] = (
    ("provider_library_missing", "error",
     re.compile(r"Failed to load library .*? with error: (\S+): cannot open shared object file")),
    ("provider_library_missing", "error", re.compile(r"(Please install TensorRT libraries)")),
    ("provider_creation_failed", "error", re.compile(r"Failed to create (\w+ExecutionProvider)")),
    ("driver_too_old", "error", re.compile(r"(CUDA driver version is insufficient)")),
    ("cpu_fallback", "error", re.compile(r"Falling back to (\[.*?\])")),
    ("nodes_not_on_preferred_provider", "warning",
     re.compile(r"(Some nodes were not assigned to the preferred execution providers)")),
    ("memcpy_nodes_added", "warning", re.compile(r"(\d+ Memcpy nodes are added|Memcpy nodes are added)")),
    # "Engine will be built" is logged at VERBOSE only, so a served process never sees it: on-node builds are
    # detected from facts (EP-context nodes, the engine cache folder) in engines/runtime/enginecheck.py.
    # A prebuilt engine that does not deserialize (another TensorRT, GPU or a damaged file) is an artifact that
    # does not match this node: exit 23, not "GPU unavailable" and not an on-node build.
    ("artifact_mismatch", "error", re.compile(r"(could not deserialize engine)", re.IGNORECASE)),
    ("engine_rebuild", "error", re.compile(r"(Engine will be built|"
                                           r"Building new engine)", re.IGNORECASE)),
    ("arena_growth", "info", re.compile(r"(Extending BFCArena)")),
)


def classify(lines: list[str]) -> list[OrtEvent]:
    """Events for the lines that match a rule (one event per line, first matching rule wins)."""
    events = []
    for raw in lines:
        line = _ANSI.sub("", raw).strip()
        for kind, severity, pattern in RULES:
            match = pattern.search(line)
            if match:
                events.append(OrtEvent(kind=kind, severity=cast(Severity, severity), line=line,
                                       detail=(match.group(1) or "") if match.groups() else ""))
                break
    return events


@dataclass
class Captured:
    lines: list[str] = field(default_factory=list)
    events: list[OrtEvent] = field(default_factory=list)


@contextlib.contextmanager
def capture_ort_output(source: str, reemit: bool = True) -> Iterator[Captured]:
    """Redirect fd 2 and sys.stdout for the duration; afterwards classify, re-emit (unless ``reemit`` is False:
    a probe whose failures are expected reports them itself), and fill the result.
    Process-wide, so callers keep the window to the session constructor (serialized by a lock)."""
    result = Captured()
    with _CAPTURE_LOCK, tempfile.TemporaryFile(mode="w+b") as sink:
        sys.stderr.flush()
        saved_fd = os.dup(2)
        banner = io.StringIO()
        try:
            os.dup2(sink.fileno(), 2)
            with contextlib.redirect_stdout(banner):
                yield result
        finally:
            sys.stderr.flush()
            os.dup2(saved_fd, 2)
            os.close(saved_fd)
            sink.seek(0)
            native = sink.read().decode("utf-8", "replace")
            result.lines = [ln for ln in (banner.getvalue() + native).splitlines() if ln.strip()]
            result.events = classify(result.lines)
            if reemit:
                _reemit(source, result)


def _reemit(source: str, result: Captured) -> None:
    classified = {e.line for e in result.events}
    for event in result.events:
        level = {"error": logging.ERROR, "warning": logging.WARNING}.get(event.severity, logging.INFO)
        log.log(level, "%s: ORT %s: %s", source, event.kind, event.line)
    for line in result.lines:
        if _ANSI.sub("", line).strip() not in classified:
            log.debug("%s: ORT: %s", source, line)


class StderrTee:
    """While serving: fd 2 goes through a pipe; a thread copies every byte to the real stderr and classifies each
    line, so ORT messages printed after boot (an engine rebuild, arena growth) become events the watchdog sees.
    Session-creation captures still work: they redirect fd 2 and restore it to the pipe."""

    def __init__(self) -> None:
        self.events: list[OrtEvent] = []
        self._lock = threading.Lock()
        self._original: int | None = None
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._original is not None

    def start(self) -> None:
        read_fd, write_fd = os.pipe()
        sys.stderr.flush()
        self._original = os.dup(2)
        os.dup2(write_fd, 2)
        os.close(write_fd)
        self._thread = threading.Thread(target=self._pump, args=(read_fd, self._original), daemon=True,
                                        name="sdserve-stderr-tee")
        self._thread.start()

    def _pump(self, read_fd: int, original: int) -> None:
        with os.fdopen(read_fd, "rb", buffering=0) as pipe:
            pending = b""
            while chunk := pipe.read(65536):
                os.write(original, chunk)
                pending += chunk
                *lines, pending = pending.split(b"\n")
                found = classify([ln.decode("utf-8", "replace") for ln in lines])
                if found:
                    with self._lock:
                        self.events.extend(found)

    def drain(self) -> list[OrtEvent]:
        """Events seen since the last drain."""
        with self._lock:
            taken, self.events = self.events, []
        return taken

    def stop(self) -> None:
        if self._original is None:
            return
        sys.stderr.flush()
        os.dup2(self._original, 2)  # closes the pipe's last write end: the pump sees EOF
        if self._thread is not None:
            self._thread.join(timeout=2)
        os.close(self._original)
        self._original = None

"""The boot/serving state machine shown at /ready and /capabilities."""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field
from typing import Literal

State = Literal["starting", "preflight", "loading", "self-test", "ready", "degraded", "draining",
                "failed"]

_ABSOLUTE_PATH = re.compile(r"(?<![\w.:/~-])/[\w.@+~-]+(?:/[\w.@+~-]*)*")
MAX_PUBLIC_REASON = 300


def public_reason(text: str) -> str:
    """A reason fit for the unauthenticated /ready and 503 bodies: absolute filesystem paths replaced by
    ``<path>``, at most 300 characters. The full text stays in /capabilities and the log."""
    redacted = _ABSOLUTE_PATH.sub("<path>", text)
    return redacted if len(redacted) <= MAX_PUBLIC_REASON else redacted[:MAX_PUBLIC_REASON - 1] + "…"


@dataclass
class Transition:
    state: State
    at: float
    reasons: list[str]


@dataclass
class ServerState:
    """Thread-safe current state, reasons (public: redacted), details (full) and history of transitions.
    ``codes`` are short machine-readable reason codes (an exit-code name after a failed boot)."""

    state: State = "starting"
    reasons: list[str] = field(default_factory=list)
    details: list[str] = field(default_factory=list)
    codes: list[str] = field(default_factory=list)
    history: list[Transition] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self.history.append(Transition(self.state, time.time(), []))

    def set(self, state: State, reasons: list[str] | None = None, details: list[str] | None = None,
            codes: list[str] | None = None) -> None:
        """``reasons`` are shown redacted on /ready; ``details`` (default: the reasons) on /capabilities."""
        with self._lock:
            self.state = state
            self.details = list(details if details is not None else reasons or [])
            self.reasons = [public_reason(r) for r in reasons or []]
            self.codes = list(codes or [])
            self.history.append(Transition(state, time.time(), list(self.details)))

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def snapshot(self) -> dict[str, object]:
        with self._lock:
            return {"state": self.state, "reasons": list(self.details), "codes": list(self.codes),
                    "history": [{"state": t.state, "at": t.at, "reasons": t.reasons} for t in self.history]}

"""The boot/serving state machine shown at /ready and /capabilities."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Literal

State = Literal["starting", "preflight", "loading", "self-test", "ready", "degraded", "draining",
                "failed"]


@dataclass
class Transition:
    state: State
    at: float
    reasons: list[str]


@dataclass
class ServerState:
    """Thread-safe current state, reasons and history of transitions."""

    state: State = "starting"
    reasons: list[str] = field(default_factory=list)
    history: list[Transition] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self.history.append(Transition(self.state, time.time(), []))

    def set(self, state: State, reasons: list[str] | None = None) -> None:
        with self._lock:
            self.state = state
            self.reasons = list(reasons or [])
            self.history.append(Transition(state, time.time(), list(self.reasons)))

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def snapshot(self) -> dict[str, object]:
        with self._lock:
            return {"state": self.state, "reasons": list(self.reasons),
                    "history": [{"state": t.state, "at": t.at, "reasons": t.reasons} for t in self.history]}

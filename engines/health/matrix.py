"""configs/matrix.toml as a typed model, and version comparison by prefix."""

from __future__ import annotations

from engines.config import version_tuple


def matches(observed: str, prefix: str) -> bool:
    """'13.0.2' matches '13.0' and '13'; '11.0' does not match '10'."""
    want, got = version_tuple(prefix), version_tuple(observed)
    return bool(want) and got[: len(want)] == want


def at_least(observed: str, minimum: str) -> bool:
    return version_tuple(observed) >= version_tuple(minimum)

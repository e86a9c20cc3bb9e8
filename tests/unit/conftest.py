"""Shared unit fixtures: a fake engine behind the engine protocol (tests/unit/fakes.py, with a manifest digest)
and the real app on it under the dev profile, ready. A module that needs another engine or profile defines its
own ``engine`` or ``client`` fixture, which overrides these."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from server.settings import load_settings
from tests.unit.fakes import HashedEngine, start


@pytest.fixture
def engine() -> HashedEngine:
    return HashedEngine()


@pytest.fixture
def client(engine: HashedEngine) -> Iterator[TestClient]:
    yield from start(engine, load_settings("dev"))

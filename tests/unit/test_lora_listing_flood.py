"""Issue 57, a hostile finding: 16 clients x 3 ``GET /sdapi/v1/loras`` on a library with many files and metadata
took 5.3 s each and held /health over 1 s. The listing is built once per scan in a worker thread, keyed by the
scan's tuple; requests arriving meanwhile wait on the event loop for that build (no thread each) and get the same
bytes, gzip-encoded where the client accepts it. The build here is held on an event until every request has
arrived, so "once for N concurrent requests" is counted, not timed."""

from __future__ import annotations

import gzip
import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from fastapi.testclient import TestClient

from engines.types.model import LoraInfo
from server.routes import a1111_loras
from server.routes.a1111_loras import Listing, Refresher
from server.settings import load_settings
from tests.unit.fakes import FakeEngine, start

CLIENTS = 16
GUARD_S = 60.0
"""Hang guard for each wait below (a wait ends as soon as its state is reached)."""


def _library(count: int, tag: str) -> tuple[LoraInfo, ...]:
    return tuple(LoraInfo(f"{tag}{i}", f"{tag}{i}", f"{tag}{i}.safetensors", f"{i:064x}", 1000 + i,
                          {"ss_tag_frequency": "x" * 2000, "ss_output_name": f"{tag}{i}"}, "", {"unet": 4})
                 for i in range(count))


class CountingListing(Listing):
    """The route's Listing, counting the requests that reached it."""

    def __init__(self) -> None:
        super().__init__()
        self.arrived = 0
        self.changed = threading.Condition()

    async def body(self, files: tuple[LoraInfo, ...]) -> tuple[bytes, bytes]:
        with self.changed:
            self.arrived += 1
            self.changed.notify_all()
        return await super().body(files)

    def wait_arrived(self, count: int) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: self.arrived >= count, GUARD_S), self.arrived


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[TestClient, FakeEngine, CountingListing,
                                                              threading.Event, list[int]]]:
    """The app with a held build: ``release`` lets it finish; ``built`` holds the listing sizes built."""
    release, built = threading.Event(), []
    real_build = a1111_loras.build

    def held_build(files: tuple[LoraInfo, ...]) -> tuple[bytes, bytes]:
        assert release.wait(GUARD_S), "the build was never released"
        built.append(len(files))
        return real_build(files)

    monkeypatch.setattr(a1111_loras, "build", held_build)
    engine = FakeEngine()
    engine.library = _library(200, "a")
    listing = CountingListing()
    for client in start(engine, load_settings("dev")):
        client.app.state.lora_routes = (listing, Refresher())  # type: ignore[attr-defined]
        yield client, engine, listing, release, built


def test_concurrent_listings_are_built_once_and_health_answers_meanwhile(served: tuple[
        TestClient, FakeEngine, CountingListing, threading.Event, list[int]]) -> None:
    client, engine, listing, release, built = served
    with ThreadPoolExecutor(CLIENTS) as pool:
        answers = [pool.submit(client.get, "/sdapi/v1/loras") for _ in range(CLIENTS)]
        listing.wait_arrived(CLIENTS)  # every request is in, the first one's build held
        assert client.get("/health").status_code == 200  # the event loop is free while the listing builds
        assert listing.builds == 1 and built == []
        release.set()
        replies = [answer.result(GUARD_S) for answer in answers]
    assert built == [200] and listing.builds == 1
    assert all(r.status_code == 200 for r in replies)
    assert len({r.content for r in replies}) == 1
    assert [f["name"] for f in json.loads(replies[0].content)] == [f.name for f in engine.library]
    again = client.get("/sdapi/v1/loras")  # the same scan: served from the cache
    assert again.content == replies[0].content and listing.builds == 1 and built == [200]
    engine.library = _library(3, "b")  # a new scan: a new listing, built once
    assert [f["name"] for f in client.post("/sdapi/v1/refresh-loras").json()] == ["b0", "b1", "b2"]
    assert [f["name"] for f in client.get("/sdapi/v1/loras").json()] == ["b0", "b1", "b2"]
    assert listing.builds == 2 and built == [200, 3]


def test_the_listing_is_sent_gzip_encoded_to_a_client_that_accepts_it(served: tuple[
        TestClient, FakeEngine, CountingListing, threading.Event, list[int]]) -> None:
    client, engine, listing, release, _ = served
    release.set()
    url = str(client.base_url) + "/sdapi/v1/loras"
    raw = client.get(url, headers={"Accept-Encoding": "identity"})
    assert raw.headers.get("content-encoding") is None and len(json.loads(raw.content)) == 200
    packed = client.send(client.build_request("GET", url, headers={"Accept-Encoding": "gzip"}), stream=True)
    body = b"".join(packed.iter_raw())
    assert packed.headers["content-encoding"] == "gzip" and packed.headers["vary"] == "Accept-Encoding"
    assert gzip.decompress(body) == raw.content and len(body) * 10 < len(raw.content)
    assert listing.builds == 1

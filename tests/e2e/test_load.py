"""Serving under load against real `sdserve serve` processes: backpressure, batching, deadlines, disconnects,
drain on SIGTERM."""

from __future__ import annotations

import asyncio
import base64
import io
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import ServerProcess, dev_config

GEN = "/v1/images/generations"


def _server(tmp: Path, model: Path, **queue: object) -> ServerProcess:
    replace = {"max_size = 32": f"max_size = {queue.get('max_size', 32)}",
               'batching = "step"': f'batching = "{queue.get("batching", "step")}"',
               "max_batch = 4": f"max_batch = {queue.get('max_batch', 4)}",
               "max_running = 32": f"max_running = {queue.get('max_running', 32)}",
               "max_queue_delay_ms = 10": f"max_queue_delay_ms = {queue.get('delay_ms', 10)}",
               "drain_timeout_s = 10": f"drain_timeout_s = {queue.get('drain_s', 10)}",
               "[watchdog]\ninterval_s = 5.0": "[watchdog]\nenabled = false\ninterval_s = 5.0"}
    server = ServerProcess("--config", str(dev_config(tmp, replace=replace)), "--model", str(model))
    server.wait_ready()
    return server


def _metric(url: str, name: str, labels: dict[str, str] | None = None) -> float:
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in (labels or {}).items()):
                return float(sample.value)
    return 0.0


def _until(what: str, predicate, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    """Poll ``predicate`` (a server-side observation) until it holds; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"never observed: {what}")
        time.sleep(0.02)


def _started(url: str | None) -> float:
    """Batches' requests that left the queue and started (the queue-wait histogram observes each at start)."""
    return _metric(url or "", "sdserve_queue_wait_seconds_count")


def _queued(url: str | None) -> float:
    return _metric(url or "", "sdserve_queue_depth")


async def _until_async(what: str, predicate, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    """``_until`` inside an event loop (the blocking probe runs in a thread, so the loop keeps sending)."""
    await asyncio.to_thread(_until, what, predicate, timeout)


def _pixels(item: dict[str, str]) -> np.ndarray:
    with Image.open(io.BytesIO(base64.b64decode(item["b64_json"]))) as image:
        return np.asarray(image.convert("RGB"), dtype=np.int16)


@pytest.fixture
def slow(tiny_model: Path, tmp_path: Path) -> Iterator[ServerProcess]:
    """max_size 8, max_batch 4: 32 concurrent requests must overflow."""
    server = _server(tmp_path, tiny_model, max_size=8, max_batch=4)
    yield server
    assert server.stop() == 0, server.log


def test_32_concurrent_requests_get_200_or_429_and_probes_stay_fast(slow: ServerProcess) -> None:
    url = slow.url
    probe_times: list[float] = []
    depths: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        with httpx.Client(timeout=5) as client:
            while not stop.is_set():
                for path in ("/health", "/ready"):
                    t = time.monotonic()
                    assert client.get(f"{url}{path}").status_code == 200
                    probe_times.append(time.monotonic() - t)
                depths.append(_metric(url or "", "sdserve_queue_depth"))
                time.sleep(0.02)

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(client.post(f"{url}{GEN}", json={"prompt": f"a city {i}", "seed": i,
                                                                           "steps": 8}) for i in range(32)))

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        responses = asyncio.run(burst())
    finally:
        stop.set()
        prober.join()
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429}, codes
    assert codes.count(429) > 0 and codes.count(200) >= 8
    for r in responses:
        if r.status_code == 429:
            assert int(r.headers["retry-after"]) >= 1 and "queue full" in r.json()["error"]["message"]
    assert max(probe_times) < 1.0
    assert max(depths) <= 8
    assert httpx.get(f"{url}/performance").json()["queue"]["peak"] <= 8


def test_seeded_image_alone_equals_it_inside_a_batch_of_4(tiny_model: Path, tmp_path: Path) -> None:
    """Micro-batching (queue.batching = "micro"): four requests within the queue delay run as one batch."""
    server = _server(tmp_path, tiny_model, max_batch=4, delay_ms=500, batching="micro")
    try:
        url = server.url
        target = {"prompt": "a red fox in snow", "seed": 77, "steps": 8}

        async def together() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=60) as client:
                others = [{"prompt": p, "seed": s, "steps": 8} for p, s in (("a boat", 1), ("a tree", 2),
                                                                            ("a car", 3))]
                return await asyncio.gather(*(client.post(f"{url}{GEN}", json=b) for b in [target, *others]))

        batched = asyncio.run(together())
        assert [r.headers["x-sdserve-batch-size"] for r in batched] == ["4"] * 4
        alone = httpx.post(f"{url}{GEN}", json=target, timeout=60)
        assert alone.headers["x-sdserve-batch-size"] == "1"
        diff = np.abs(_pixels(batched[0].json()["data"][0]) - _pixels(alone.json()["data"][0]))
        assert diff.max() <= 1
    finally:
        server.stop()


def test_requests_joining_a_running_one_get_their_solo_images_on_both_apis(tiny_model: Path,
                                                                           tmp_path: Path) -> None:
    """Step-level batching (the default): while a 12-step request runs (each tick slowed by a fault, so the others
    arrive while it runs), an OpenAI and an A1111 request join it at a step boundary; each image equals the one the
    same request gets alone, and the requests report that they shared denoiser calls."""
    server = _server(tmp_path, tiny_model, max_batch=4)
    try:
        url = server.url
        assert httpx.put(f"{url}/debug/faults", json={"step_latency_s": 0.15}).status_code == 200
        first = {"prompt": "a lighthouse", "seed": 5, "steps": 12}
        openai = {"prompt": "a red fox in snow", "seed": 77, "steps": 10}
        a1111 = {"prompt": "a blue boat", "seed": 8, "steps": 11, "width": 64, "height": 64, "cfg_scale": 1.0,
                 "sampler_name": "DPM++ 2M"}

        async def together() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=120) as client:
                started = _started(url)
                running = asyncio.create_task(client.post(f"{url}{GEN}", json=first))
                await _until_async("the first request started", lambda: _started(url) > started)
                joined = await asyncio.gather(client.post(f"{url}{GEN}", json=openai),
                                              client.post(f"{url}/sdapi/v1/txt2img", json=a1111))
                return [await running, *joined]

        responses = asyncio.run(together())
        assert [r.status_code for r in responses] == [200, 200, 200]
        assert all(int(r.headers["x-sdserve-batch-size"]) >= 2 for r in responses)
        assert httpx.put(f"{url}/debug/faults", json={"step_latency_s": 0}).status_code == 200
        alone = [httpx.post(f"{url}{GEN}", json=openai, timeout=60),
                 httpx.post(f"{url}/sdapi/v1/txt2img", json=a1111, timeout=60)]
        assert [r.headers["x-sdserve-batch-size"] for r in alone] == ["1", "1"]
        assert np.abs(_pixels(responses[1].json()["data"][0]) - _pixels(alone[0].json()["data"][0])).max() <= 1
        joined_a1111 = _pixels({"b64_json": responses[2].json()["images"][0]})
        assert np.abs(joined_a1111 - _pixels({"b64_json": alone[1].json()["images"][0]})).max() <= 1
    finally:
        server.stop()


@pytest.fixture
def sequential(tiny_model: Path, tmp_path: Path) -> Iterator[ServerProcess]:
    """One request at a time: a 1-image budget per call and one image resident (step-level batching's
    max_running), so the others wait in the queue."""
    server = _server(tmp_path, tiny_model, max_batch=1, max_running=1, drain_s=10)
    yield server
    server.stop()


def _inject(url: str | None, seconds: float) -> None:
    assert httpx.put(f"{url}/debug/faults", json={"latency_s": seconds}).status_code == 200


def test_deadline_passed_before_start_is_504(sequential: ServerProcess) -> None:
    url = sequential.url
    _inject(url, 1.5)

    async def run() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            started = _started(url)
            first = asyncio.create_task(client.post(f"{url}{GEN}", json={"prompt": "slow", "steps": 2}))
            await _until_async("the slow request started", lambda: _started(url) > started)
            late = await client.post(f"{url}{GEN}", json={"prompt": "late", "steps": 2},
                                     headers={"x-sdserve-timeout-s": "0.5"})
            return await first, late

    first, late = asyncio.run(run())
    assert first.status_code == 200
    assert late.status_code == 504 and "not started" in late.json()["error"]["message"]
    assert _metric(url or "", "sdserve_requests_cancelled_total", {"reason": "deadline"}) == 1


def test_client_disconnect_cancels_its_queued_request(sequential: ServerProcess) -> None:
    url = sequential.url
    _inject(url, 1.5)
    before = _metric(url or "", "sdserve_images_generated_total")

    async def run() -> httpx.Response:
        async with httpx.AsyncClient(timeout=60) as client:
            started = _started(url)
            first = asyncio.create_task(client.post(f"{url}{GEN}", json={"prompt": "slow", "steps": 2}))
            await _until_async("the slow request started", lambda: _started(url) > started)
            with pytest.raises(httpx.ReadTimeout):  # queued behind the slow one (1.5 s) when it gives up
                await client.post(f"{url}{GEN}", json={"prompt": "impatient", "steps": 2}, timeout=0.3)
            return await first

    assert asyncio.run(run()).status_code == 200
    _until("the disconnect was noticed",
           lambda: _metric(url or "", "sdserve_requests_cancelled_total", {"reason": "disconnect"}) == 1)
    # FIFO with max_batch 1: had the impatient request been kept, it would run before this one.
    _inject(url, 0)
    assert httpx.post(f"{url}{GEN}", json={"prompt": "after", "steps": 2}, timeout=60).status_code == 200
    assert _metric(url or "", "sdserve_images_generated_total") - before == 2  # slow + after, never impatient


def test_sigterm_drains_queued_work_then_exits_0(sequential: ServerProcess) -> None:
    url = sequential.url
    _inject(url, 0.5)
    results: list[int] = []

    def post(i: int) -> None:
        results.append(httpx.post(f"{url}{GEN}", json={"prompt": f"p{i}", "steps": 2}, timeout=60).status_code)

    started = _started(url)
    threads = [threading.Thread(target=post, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    _until("one request running and two queued", lambda: _started(url) > started and _queued(url) == 2)
    sequential.proc.send_signal(signal.SIGTERM)
    _until("/ready says draining", lambda: httpx.get(f"{url}/ready").json()["state"] == "draining")
    assert httpx.get(f"{url}/ready").status_code == 503
    for t in threads:
        t.join()
    assert results == [200, 200, 200]
    assert sequential.proc.wait(timeout=30) == 0


def test_sigterm_with_more_work_than_the_drain_timeout_answers_503_not_silence(tiny_model: Path,
                                                                                 tmp_path: Path) -> None:
    server = _server(tmp_path, tiny_model, max_batch=1, max_running=1, drain_s=1)
    url = server.url
    _inject(url, 0.8)
    results: list[int] = []

    def post(i: int) -> None:
        results.append(httpx.post(f"{url}{GEN}", json={"prompt": f"p{i}", "steps": 2}, timeout=60).status_code)

    started = _started(url)
    threads = [threading.Thread(target=post, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    _until("one request running and four queued", lambda: _started(url) > started and _queued(url) == 4)
    server.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join()
    assert server.stop() == 0
    assert len(results) == 5 and set(results) <= {200, 503}
    assert results.count(503) >= 1 and results.count(200) >= 1
    assert "not started before the 1s drain deadline" in server.log

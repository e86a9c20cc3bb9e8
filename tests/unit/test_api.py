"""HTTP layer on a fake engine: validation, error bodies, readiness gating."""

from __future__ import annotations

import asyncio
import base64
import io
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from PIL import Image

from engines.errors import NotReadyError
from engines.types.request import Batch, ImageSpec
from server.app import create_app
from server.batcher import Batcher
from server.errors import DeadlineExceededError, QueueFullError
from server.metrics import Metrics
from server.settings import load_settings
from tests.unit.fakes import GPU_MISSING, FakeEngine

URL = "/v1/images/generations"


def _wait_state(client: TestClient, want: str) -> dict[str, object]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        body = client.get("/ready").json()
        if body["state"] == want:
            return dict(body)
        time.sleep(0.02)
    raise AssertionError(f"state never became {want}: {body}")


@pytest.fixture
def client() -> Iterator[TestClient]:
    engine = FakeEngine()
    with TestClient(create_app(engine, load_settings("dev"))) as c:
        _wait_state(c, "ready")
        yield c
    assert engine.closed


@pytest.mark.parametrize(("body", "param", "fragment"), [
    ({"prompt": "a", "size": "100x64"}, "size", "multiple of 16"),
    ({"prompt": "a", "size": "1024x1024"}, "size", "up to 512x512; the model's native size is 64x64"),
    ({"prompt": "a", "size": "big"}, "size", "512x512"),
    ({"prompt": "a", "n": 0}, "n", "between 1 and 4"),
    ({"prompt": "a", "n": 5}, "n", "between 1 and 4"),
    ({"prompt": "a", "scheduler": "pndm"}, "scheduler", "unknown scheduler"),
    ({"prompt": "   "}, "prompt", "must not be empty"),
    ({}, "prompt", "field required"),
    ({"prompt": "a", "steps": 0}, "steps", "greater than or equal to 1"),
    ({"prompt": "a", "steps": 51}, "steps", "at most 50"),
    ({"prompt": "a", "guidance_scale": 99}, "guidance_scale", "less than or equal to 30"),
    ({"prompt": "a", "seed": -1}, "seed", "greater than or equal to 0"),
    ({"prompt": "a", "response_format": "png"}, "response_format", "b64_json"),
    ({"prompt": "a", "colour": "red"}, "colour", "unknown field"),
    ({"prompt": 5}, "prompt", "valid string"),
])
def test_bad_input_is_400_naming_the_field(client: TestClient, body: dict[str, object], param: str,
                                           fragment: str) -> None:
    response = client.post(URL, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert fragment in error["message"]


@pytest.mark.parametrize(("content", "headers", "fragment"), [
    (b"{not json", {"content-type": "application/json"}, "not valid JSON"),
    (b"prompt=a", {}, "not JSON"),
    (b"[1, 2]", {"content-type": "application/json"}, "must be a JSON object"),
    (b"", {"content-type": "application/json"}, "missing"),
])
def test_non_json_bodies_are_400(client: TestClient, content: bytes, headers: dict[str, str],
                                 fragment: str) -> None:
    response = client.post(URL, content=content, headers=headers)
    assert response.status_code == 400
    assert fragment in response.json()["error"]["message"]


def test_generation_returns_pngs_of_the_requested_size_and_seeds(client: TestClient) -> None:
    response = client.post(URL, json={"prompt": "a cat", "n": 3, "size": "32x48", "seed": 7})
    assert response.status_code == 200
    data = response.json()["data"]
    assert len(data) == 3
    for item in data:
        image = Image.open(io.BytesIO(base64.b64decode(item["b64_json"])))
        assert image.format == "PNG" and image.size == (32, 48)
    assert response.headers["x-sdserve-seeds"] == "7,8,9"
    assert "compute;dur=" in response.headers["server-timing"]


def test_provider_header_names_the_provider_that_ran_this_batch(client: TestClient) -> None:
    engine = client.app.state.engine  # type: ignore[attr-defined]
    providers = []
    for ran_on in ("CUDAExecutionProvider", "TensorrtExecutionProvider"):
        engine.provider = ran_on  # what the engine reports for the batch, not a constant the server knows
        providers.append(client.post(URL, json={"prompt": "a cat"}).headers["x-sdserve-provider"])
    assert providers == ["CUDAExecutionProvider", "TensorrtExecutionProvider"]


PROFILE_DEFAULTS = '[defaults]\nsteps = 13\nguidance_scale = 3.25\nscheduler = "ddim"\n'


def test_defaults_come_from_the_profile(tmp_path: Path) -> None:
    """A profile with unusual defaults: a request that leaves the fields out gets exactly those values."""
    profile = tmp_path / "profile.toml"
    profile.write_text('profile = "dev"\n[runtime]\nproviders = ["CPUExecutionProvider"]\nallow_cpu = true\n'
                       + PROFILE_DEFAULTS)
    engine = FakeEngine()
    with TestClient(create_app(engine, load_settings("dev", profile))) as c:
        _wait_state(c, "ready")
        assert c.post(URL, json={"prompt": "a cat"}).status_code == 200
    batch = engine.batches[-1]
    assert (batch.steps, batch.scheduler, batch.width, batch.height) == (13, "ddim", 64, 64)  # 64: the model's size
    assert batch.images[0].guidance_scale == 3.25


def test_unknown_route_is_json_404(client: TestClient) -> None:
    response = client.get("/v1/nothing")
    assert response.status_code == 404
    assert "error" in response.json()


def test_ready_is_503_while_booting_then_200() -> None:
    gate = threading.Event()
    with TestClient(create_app(FakeEngine(load_gate=gate), load_settings("dev"))) as c:
        assert c.get("/health").status_code == 200
        booting = c.get("/ready")
        assert booting.status_code == 503 and booting.json()["state"] in ("preflight", "loading")
        refused = c.post(URL, json={"prompt": "a"})
        assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1  # retryable: come back
        assert "x-should-retry" not in refused.headers
        gate.set()
        _wait_state(c, "ready")
        assert c.get("/ready").status_code == 200


def test_failed_boot_stays_unready_with_reason_in_dev() -> None:
    fatal: list[int] = []
    app = create_app(FakeEngine(fail_load=GPU_MISSING), load_settings("dev"), lambda code, reason: fatal.append(code))
    with TestClient(app) as c:
        body = _wait_state(c, "failed")
        assert "libcublasLt.so.13" in str(body["reasons"])
        response = c.post(URL, json={"prompt": "a"})
        assert response.status_code == 503 and response.headers["x-should-retry"] == "false"
    assert fatal == []


def test_failed_boot_in_production_requests_exit_with_gpu_code() -> None:
    fatal: list[int] = []
    app = create_app(FakeEngine(fail_load=GPU_MISSING), load_settings("production"),
                     lambda code, reason: fatal.append(code))
    with TestClient(app) as c:
        _wait_state(c, "failed")
    assert fatal == [20]


def test_unserved_size_is_400_listing_served_sizes() -> None:
    settings = load_settings("dev")
    settings = settings.model_copy(update={"serving": settings.serving.model_copy(update={"sizes": ("64x64",
                                                                                                    "128x128")})})
    with TestClient(create_app(FakeEngine(), settings)) as client:
        _wait_state(client, "ready")
        response = client.post("/v1/images/generations", json={"prompt": "x", "size": "96x96"})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == ("size 96x96 is not served; served sizes: 64x64, 128x128; the "
                                                   "model's native size is 64x64 (size auto)")


def _exposition(client: TestClient) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {f"{s.name}{s.labels.get('reason', '')}": s.value
            for f in text_string_to_metric_families(client.get("/metrics").text) for s in f.samples
            if s.name in ("sdserve_ready", "sdserve_degraded")}


def test_degraded_server_answers_generation_with_a_retryable_503_then_recovers() -> None:
    settings = load_settings("dev")
    settings = settings.model_copy(update={"watchdog": settings.watchdog.model_copy(
        update={"enabled": False, "idle_before_canary_s": 0.0})})  # the test drives the checks
    engine = FakeEngine()
    with TestClient(create_app(engine, settings)) as c:
        _wait_state(c, "ready")
        watchdog = c.app.state.watchdog  # type: ignore[attr-defined]
        engine.drift_distance = 9.0
        c.portal.call(watchdog.check)  # type: ignore[union-attr]
        ready = c.get("/ready")
        assert ready.status_code == 503 and ready.json()["state"] == "degraded"
        refused = c.post(URL, json={"prompt": "a"})
        assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
        assert "x-should-retry" not in refused.headers
        assert "degraded" in refused.json()["error"]["message"]
        assert _exposition(c)["sdserve_ready"] == 0.0 and _exposition(c)["sdserve_degradedoutput_drift"] == 1.0
        engine.drift_distance = 0.0
        for _ in range(settings.watchdog.recover_after):
            c.portal.call(watchdog.check)  # type: ignore[union-attr]
        assert c.get("/ready").status_code == 200
        assert c.post(URL, json={"prompt": "a"}).status_code == 200
        assert _exposition(c)["sdserve_ready"] == 1.0 and _exposition(c)["sdserve_degradedoutput_drift"] == 0.0


# The request path's batcher on the fake engine: the engine lock is held by the test to keep work queued.


BOUND_S = 5.0
"""Upper bound on any wait in the batcher tests, so a broken batcher fails instead of hanging."""


def _batch(size: int = 64, seed: int = 0) -> Batch:
    return Batch((ImageSpec("a", seed=seed),), size, size, 2)


async def _until(predicate: Callable[[], bool]) -> None:
    for _ in range(10_000):
        if predicate():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("condition never held")


def test_batcher_bounds_the_queue_and_merges_only_compatible_requests() -> None:
    async def scenario() -> tuple[list[tuple[int, int]], type[Exception] | None]:
        engine = FakeEngine()
        engine.load()
        lock = asyncio.Lock()
        batcher = Batcher(engine, Metrics(), lock, max_queue=4, max_batch=2, max_delay_s=0.0)
        runner = asyncio.create_task(batcher.run())
        await lock.acquire()  # the engine is busy
        first = asyncio.create_task(batcher.submit(_batch(seed=1), None))
        await _until(lambda: batcher.running == 1)  # taken from the queue, waiting for the engine
        queued = [asyncio.create_task(batcher.submit(b, None)) for b in (_batch(seed=2), _batch(32, 3),
                                                                          _batch(seed=4), _batch(seed=6))]
        await _until(lambda: len(batcher.queue) == 4)
        refused: type[Exception] | None = None
        try:  # bounded: an accepted request would wait for the held lock
            await asyncio.wait_for(batcher.submit(_batch(seed=5), None), BOUND_S)
        except (QueueFullError, TimeoutError) as exc:
            refused = type(exc)
        lock.release()
        await asyncio.wait_for(asyncio.gather(first, *queued), BOUND_S)
        runner.cancel()
        return [(len(b.images), b.width) for b in engine.batches], refused

    batches, refused = asyncio.run(scenario())
    assert refused is QueueFullError  # the fifth waiting request, at once
    # 64x64 seeds 2 and 4 merged up to max_batch 2 (seed 6 waits for the next batch); the 32x32 one ran alone
    assert batches == [(1, 64), (2, 64), (1, 32), (1, 64)]


def test_batcher_drops_a_request_whose_deadline_passes_in_the_queue_and_refuses_work_when_draining() -> None:
    async def scenario() -> tuple[list[int], bool, bool]:
        engine = FakeEngine()
        engine.load()
        lock = asyncio.Lock()
        batcher = Batcher(engine, Metrics(), lock, max_queue=8, max_batch=1, max_delay_s=0.0)
        runner = asyncio.create_task(batcher.run())
        await lock.acquire()
        first = asyncio.create_task(batcher.submit(_batch(seed=1), None))
        await _until(lambda: batcher.running == 1)
        try:  # bounded: a request kept past its deadline would wait for the held lock
            await asyncio.wait_for(batcher.submit(_batch(seed=2), time.monotonic() + 0.05), BOUND_S)
            timed_out = False
        except DeadlineExceededError:
            timed_out = True
        except TimeoutError:
            timed_out = False
        lock.release()
        await asyncio.wait_for(first, BOUND_S)
        await batcher.drain(0.0)
        try:
            await asyncio.wait_for(batcher.submit(_batch(seed=3), None), BOUND_S)
            refused = False
        except NotReadyError:
            refused = True
        runner.cancel()
        return [b.images[0].seed for b in engine.batches], timed_out, refused

    seeds, timed_out, refused = asyncio.run(scenario())
    assert timed_out and seeds == [1]  # the late request never ran
    assert refused

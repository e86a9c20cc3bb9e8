"""HTTP layer on a fake engine: validation, error bodies, readiness gating."""

from __future__ import annotations

import base64
import io
import threading
import time
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from PIL import Image

from server.app import create_app
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
    ({"prompt": "a", "size": "1024x1024"}, "size", "at most 512"),
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
    assert response.headers["x-sdserve-provider"] == "FakeExecutionProvider"
    assert "compute;dur=" in response.headers["server-timing"]


def test_defaults_come_from_the_profile(client: TestClient) -> None:
    client.post(URL, json={"prompt": "a cat"})
    engine = client.app.state.engine  # type: ignore[attr-defined]
    batch = engine.batches[-1]
    settings = load_settings("dev")
    assert (batch.steps, batch.scheduler, batch.width) == (settings.defaults.steps, settings.defaults.scheduler, 64)
    assert batch.images[0].guidance_scale == settings.defaults.guidance_scale


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
        assert c.post(URL, json={"prompt": "a"}).status_code == 503
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
        while client.get("/ready").status_code != 200:
            pass
        response = client.post("/v1/images/generations", json={"prompt": "x", "size": "96x96"})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "size 96x96 is not served; served sizes: 64x64, 128x128"

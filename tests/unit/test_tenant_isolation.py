"""Isolation between tenants (issue 52 point 4), on a fake engine: /sdapi/v1/progress, /interrupt and /skip see
only the caller's jobs, url links are their maker's (404 for another key), option writes are per tenant, and the
image decoders are shared fairly (server/images_in.py DecoderSlots, on an injected clock)."""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from PIL import Image
from starlette.concurrency import run_in_threadpool

from server import images_in
from server.errors import QueueFullError
from server.images_in import DecoderSlots, decode, decoding_for
from server.settings import AuthSettings, load_settings
from tests.unit.fakes import HashedEngine, start

KEY_A, KEY_B = "sk-tenant-a-0123456789", "sk-tenant-b-0123456789"
A, B = {"authorization": f"Bearer {KEY_A}"}, {"authorization": f"Bearer {KEY_B}"}
PROGRESS = "/sdapi/v1/progress"


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@pytest.fixture
def client(engine: HashedEngine) -> Iterator[TestClient]:
    auth = AuthSettings(api_key_sha256=(_sha(KEY_A), _sha(KEY_B)))
    yield from start(engine, load_settings("dev").model_copy(update={"auth": auth}))


def _poll(client: TestClient, headers: dict[str, str], check: Any, timeout_s: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        body = client.get(PROGRESS, headers=headers).json()
        if check(body):
            return dict(body)
        time.sleep(0.02)
    raise AssertionError(f"progress never matched: {body}")


def _post(client: TestClient, headers: dict[str, str], body: dict[str, Any], out: list[Any]) -> \
        threading.Thread:
    worker = threading.Thread(target=lambda: out.append(client.post("/sdapi/v1/txt2img", json=body,
                                                                    headers=headers)))
    worker.start()
    return worker


def test_progress_interrupt_and_skip_see_only_the_callers_jobs(client: TestClient, engine: HashedEngine) -> None:
    engine.release.clear()
    engine.entered.clear()
    mine: list[Any] = []
    theirs: list[Any] = []
    a_job = _post(client, A, {"prompt": "a's secret", "steps": 6, "width": 64, "height": 64}, mine)
    b_job: threading.Thread | None = None
    try:
        assert engine.entered.wait(10)  # A's batch holds after its first step
        busy = _poll(client, A, lambda b: b["state"]["sampling_step"] == 1)
        assert busy["state"]["sampling_steps"] == 6 and busy["state"]["job_count"] == 1
        idle = client.get(PROGRESS, headers=B).json()
        assert idle["progress"] == 0.0 and idle["eta_relative"] == 0.0 and idle["state"]["job_count"] == 0
        assert idle["state"]["sampling_step"] == idle["state"]["sampling_steps"] == 0 and idle["textinfo"] is None
        for route in ("interrupt", "skip"):  # B stops nothing of A's
            answer = client.post(f"/sdapi/v1/{route}", headers=B)
            assert answer.headers["x-sdserve-interrupt"] == "idle" and answer.json()["interrupted"] is False
        b_job = _post(client, B, {"prompt": "b", "steps": 5, "width": 64, "height": 64}, theirs)  # queued behind A
        queued = _poll(client, B, lambda b: b["state"]["job_count"] == 1)
        assert queued["state"]["job"] == "sdserve: queued" and queued["state"]["sampling_steps"] == 0
        assert "0 running" in queued["textinfo"] and "step 0/0" in queued["textinfo"]
        own = client.get(PROGRESS, headers=A).json()  # A's view: its own running job, B's queued one not counted
        assert own["state"]["job_count"] == 1 and own["state"]["sampling_step"] == 1
        assert own["textinfo"].startswith("0 request(s) queued, 1 running")
        skipped = client.post("/sdapi/v1/skip", headers=B).json()
        assert (skipped["running"], skipped["queued"]) == (0, 0)
        stopped = client.post("/sdapi/v1/interrupt", headers=B).json()
        assert (stopped["running"], stopped["queued"]) == (0, 1)  # B's own queued request, never A's
    finally:
        engine.release.set()
        a_job.join(10)
        if b_job is not None:
            b_job.join(10)
    assert mine[0].status_code == 200 and '"interrupted": false' in mine[0].json()["info"]
    assert theirs[0].status_code == 409 and "a's secret" not in theirs[0].text


def test_url_links_are_served_to_their_maker_and_404_to_another_key(client: TestClient) -> None:
    made = client.post("/v1/images/generations", headers=A,
                       json={"prompt": "a", "size": "64x64", "response_format": "url"})
    assert made.status_code == 200, made.text
    url = made.json()["data"][0]["url"]
    assert client.get(url, headers=A).status_code == 200
    assert client.get(url).status_code == 200  # a link fetched without a key, as clients fetch them
    other = client.get(url, headers=B)
    unknown = client.get(url.rsplit("/", 1)[0] + "/AAAAAAAAAAAAAAAAAAAAAA.png", headers=B)
    assert other.status_code == unknown.status_code == 404 and other.json() == unknown.json()  # nothing leaks
    assert client.get(url, headers={"authorization": "Bearer sk-wrong"}).status_code == 200  # no tenant: a plain fetch


def test_option_writes_change_only_the_writers_tenant(client: TestClient) -> None:
    assert client.post("/sdapi/v1/options", headers=A, json={"send_seed": False}).status_code == 200
    assert client.get("/sdapi/v1/options", headers=A).json()["send_seed"] is False
    assert client.get("/sdapi/v1/options", headers=B).json()["send_seed"] is True  # A1111's default
    refused = client.post("/sdapi/v1/options", headers=B, json={"samples_save": True})
    assert refused.status_code == 422 and "samples_save" in refused.text
    assert client.get("/sdapi/v1/options", headers=A).json()["send_seed"] is False


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_alone_a_tenant_uses_every_decoder() -> None:
    slots = DecoderSlots(4, clock=Clock())
    assert [slots.try_acquire("a") for _ in range(4)] == [None] * 4
    assert "every image decoder of this server is busy" in (slots.try_acquire("a") or "")
    slots.release("a")
    assert slots.try_acquire("a") is None  # its own refusal keeps nothing from it


def test_a_freed_decoder_goes_to_the_tenant_that_waits_until_shares_are_equal() -> None:
    slots = DecoderSlots(4, clock=Clock())
    for _ in range(4):
        assert slots.try_acquire("flood") is None
    assert "busy" in (slots.try_acquire("other") or "")  # the pool is full: other waits
    slots.release("flood")
    assert "kept for another caller's request" in (slots.try_acquire("flood") or "")
    assert slots.try_acquire("other") is None
    assert "busy" in (slots.try_acquire("other") or "")  # it asks for a second one
    slots.release("flood")
    assert slots.try_acquire("flood") is not None  # still kept for other, which holds fewer
    assert slots.try_acquire("other") is None
    assert slots.held == {"flood": 2, "other": 2}  # ceil(4 / 2) each
    slots.release("flood")
    assert slots.try_acquire("flood") is None  # nobody waits now: the pool is used whole


def test_one_decoder_is_taken_in_turns() -> None:
    slots = DecoderSlots(1, clock=Clock())
    assert slots.try_acquire("a") is None
    assert slots.try_acquire("b") is not None
    slots.release("a")
    assert slots.try_acquire("a") is not None  # b waited first
    assert slots.try_acquire("b") is None
    slots.release("b")
    assert slots.try_acquire("b") is not None  # a waits now
    assert slots.try_acquire("a") is None


def test_a_tenant_that_stopped_asking_stops_holding_slots_back() -> None:
    clock = Clock()
    slots = DecoderSlots(2, window_s=10.0, clock=clock)
    assert slots.try_acquire("a") is None and slots.try_acquire("a") is None
    assert slots.try_acquire("b") is not None  # b waits...
    slots.release("a")
    clock.now = 10.5  # ...and never came back
    assert slots.try_acquire("a") is None


def _png() -> bytes:
    import io

    buffer = io.BytesIO()
    Image.new("RGB", (32, 24), (10, 20, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_decodes_count_against_the_requests_tenant_in_worker_threads_too() -> None:
    images_in.configure(images_in.MAX_JPEG_SCANS, 2)
    data = _png()
    try:
        with decoding_for("flood"), images_in._decode_slot("image"), images_in._decode_slot("image"), \
                decoding_for("other"), pytest.raises(QueueFullError, match="init_images.0: every image decoder"):
            decode(data, "init_images.0", 1 << 20)  # other waits from here
        with decoding_for("flood"), images_in._decode_slot("image"):  # one of flood's decodes still runs
            with decoding_for("flood"), pytest.raises(QueueFullError, match="kept for another caller"):
                decode(data, "image", 1 << 20)

            async def other_in_a_thread() -> tuple[int, int]:
                with decoding_for("other"):  # the tenant reaches the worker thread (the context is copied)
                    return (await run_in_threadpool(decode, data, "init_images.0", 1 << 20)).size

            assert asyncio.run(other_in_a_thread()) == (32, 24)
    finally:
        images_in.configure(images_in.MAX_JPEG_SCANS, 4)

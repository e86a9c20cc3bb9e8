"""The A1111 connect surface on a fake engine: /options reads and writes, /progress through boot, idle and busy,
/interrupt and /skip, and every listing route's shape (A1111's modules/api/models.py)."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
from fastapi.testclient import TestClient

from engines.config import SCHEDULER_NAMES
from engines.errors import InvalidRequestError
from engines.types.model import ModelInfo
from server.a1111_options import OptionsStore
from server.app import create_app
from server.hires import UPSCALERS, served_latent_modes
from server.settings import load_settings
from tests.unit.fakes import DIGEST, GPU_MISSING, TITLE, FakeEngine, HashedEngine
from tests.unit.fakes import wait_for as _wait

OPTIONS = "/sdapi/v1/options"
PROGRESS = "/sdapi/v1/progress"


def test_options_name_the_served_model_as_sd_models_does(client: TestClient) -> None:
    options = client.get(OPTIONS).json()
    model = client.get("/sdapi/v1/sd-models").json()[0]
    assert options["sd_model_checkpoint"] == model["title"] == TITLE
    assert options["sd_checkpoint_hash"] == model["sha256"] == DIGEST
    assert options["samples_format"] == "png" and options["samples_save"] is False
    assert options["send_seed"] is True and options["CLIP_stop_at_last_layers"] == 1
    assert "forge_preset" not in options  # SillyTavern would take this server for Forge


def test_honoured_writes_persist_and_echoing_the_get_body_is_a_no_op(client: TestClient) -> None:
    response = client.post(OPTIONS, json={"send_seed": False, "samples_format": "PNG", "sd_vae": "None"})
    assert response.status_code == 200 and response.json() is None  # A1111's set_config returns null
    options = client.get(OPTIONS).json()
    assert options["send_seed"] is False and options["samples_format"] == "png"
    assert client.post(OPTIONS, json=options).status_code == 200  # Open WebUI posts the whole body back
    assert client.get(OPTIONS).json() == options
    for alias in (TITLE, "fake", DIGEST, DIGEST[:10]):
        assert client.post(OPTIONS, json={"sd_model_checkpoint": alias}).status_code == 200


@pytest.mark.parametrize(("body", "param", "fragment"), [
    ({"sd_model_checkpoint": "v1-5-pruned.safetensors"}, "sd_model_checkpoint", f"serves only {TITLE!r}"),
    ({"samples_format": "jpg"}, "samples_format", "PNG images only"),
    ({"CLIP_stop_at_last_layers": 2}, "CLIP_stop_at_last_layers", "clip skip 1"),
    ({"CLIP_stop_at_last_layers": True}, "CLIP_stop_at_last_layers", "clip skip 1"),
    ({"sd_vae": "vae-ft-mse.safetensors"}, "sd_vae", "own VAE"),
    ({"samples_save": True}, "samples_save", "never writes images to disk"),
    ({"sd_checkpoint_hash": "00" * 32}, "sd_checkpoint_hash", "read-only"),
    ({"send_seed": "yes"}, "send_seed", "true or false"),
    ({"eta_noise_seed_delta": 31337}, "eta_noise_seed_delta", "unknown or unsupported option"),
])
def test_writes_sdserve_cannot_honour_are_422_naming_the_key(client: TestClient, body: dict[str, object],
                                                             param: str, fragment: str) -> None:
    response = client.post(OPTIONS, json=body)
    assert response.status_code == 422, response.text
    detail = response.json()["detail"][0]
    assert detail["loc"] == ["body", param]
    assert fragment in detail["msg"] and param in detail["msg"]


def test_a_refused_write_changes_nothing(client: TestClient) -> None:
    response = client.post(OPTIONS, json={"send_seed": False, "live_previews_enable": True, "bogus": 1})
    assert response.status_code == 422
    message = response.json()["detail"][0]["msg"]
    assert "live_previews_enable" in message and "bogus" in message  # every refused key is named
    assert client.get(OPTIONS).json()["send_seed"] is True


def test_options_body_must_be_an_object(client: TestClient) -> None:
    response = client.post(OPTIONS, json=["send_seed"])
    assert response.status_code == 422 and "detail" in response.json()


def test_progress_counts_the_boot_as_a_job_and_options_wait_for_the_model() -> None:
    gate = threading.Event()
    with TestClient(create_app(HashedEngine(load_gate=gate), load_settings("dev"))) as c:
        booting = c.get(PROGRESS).json()
        assert booting["state"]["job_count"] == 1 and booting["state"]["job"].startswith("sdserve: ")
        assert booting["textinfo"]  # the boot reasons
        options = c.get(OPTIONS)
        assert options.status_code == 503 and int(options.headers["retry-after"]) >= 1
        gate.set()
        idle = _wait(c, PROGRESS, lambda r: r.json()["state"]["job_count"] == 0)
        assert idle["progress"] == 0.0 and idle["eta_relative"] == 0.0 and idle["current_image"] is None
        assert c.get(OPTIONS).json()["sd_model_checkpoint"] == TITLE


def test_progress_after_a_failed_boot_is_a_permanent_503() -> None:
    with TestClient(create_app(FakeEngine(fail_load=GPU_MISSING), load_settings("dev"))) as c:
        _wait(c, "/ready", lambda r: r.json()["state"] == "failed")
        response = c.get(PROGRESS)
        assert response.status_code == 503 and response.headers["x-should-retry"] == "false"


def _hold_one_batch(client: TestClient, engine: HashedEngine, body: dict[str, Any]) -> tuple[threading.Thread,
                                                                                             list[Any]]:
    engine.release.clear()
    engine.entered.clear()
    results: list[Any] = []
    worker = threading.Thread(target=lambda: results.append(client.post("/sdapi/v1/txt2img", json=body)))
    worker.start()
    assert engine.entered.wait(10)
    return worker, results


def test_progress_reports_the_running_step(client: TestClient, engine: HashedEngine) -> None:
    worker, results = _hold_one_batch(client, engine, {"prompt": "a", "steps": 4})
    try:
        busy = _wait(client, PROGRESS, lambda r: r.json()["state"]["sampling_step"] == 1)
        assert busy["state"]["sampling_steps"] == 4 and busy["progress"] == 0.25
        assert busy["state"]["job"] == "sdserve: generating" and busy["state"]["job_count"] == 1
        assert "step 1/4" in busy["textinfo"]
    finally:
        engine.release.set()
        worker.join(10)
    assert results[0].status_code == 200 and json.loads(results[0].json()["info"])["interrupted"] is False
    assert _wait(client, PROGRESS, lambda r: r.json()["state"]["job_count"] == 0)["progress"] == 0.0


def test_interrupt_stops_the_running_batch_at_the_next_step(client: TestClient, engine: HashedEngine) -> None:
    idle = client.post("/sdapi/v1/interrupt")
    assert idle.status_code == 200 and idle.headers["x-sdserve-interrupt"] == "idle"
    assert idle.json()["interrupted"] is False and "nothing to stop" in idle.json()["detail"]
    worker, results = _hold_one_batch(client, engine, {"prompt": "a", "steps": 6})
    try:
        response = client.post("/sdapi/v1/interrupt")
        assert response.status_code == 200 and response.headers["x-sdserve-interrupt"] == "stopping"
        assert response.json() == {"interrupted": True, "queued": 0, "running": 1, "detail": response.json()["detail"]}
    finally:
        engine.release.set()
        worker.join(10)
    answer = results[0]
    assert answer.status_code == 200 and len(answer.json()["images"]) == 1  # decoded from the latents so far
    info = json.loads(answer.json()["info"])
    assert info["interrupted"] is True and info["steps_done"] == 1 and info["steps"] == 6
    assert answer.headers["x-sdserve-interrupted"] == "1/6"


def test_interrupt_drops_queued_requests_and_skip_does_not(client: TestClient, engine: HashedEngine) -> None:
    worker, results = _hold_one_batch(client, engine, {"prompt": "a", "steps": 3, "width": 64, "height": 64})
    queued: list[Any] = []
    other = threading.Thread(target=lambda: queued.append(client.post(
        "/sdapi/v1/txt2img", json={"prompt": "b", "steps": 5, "width": 64, "height": 64})))  # not batchable: steps
    other.start()
    try:
        _wait(client, PROGRESS, lambda r: r.json()["state"]["job_count"] == 2)
        skipped = client.post("/sdapi/v1/skip").json()
        assert (skipped["running"], skipped["queued"]) == (1, 0)
        stopped = client.post("/sdapi/v1/interrupt").json()
        assert (stopped["running"], stopped["queued"]) == (0, 1)  # already stopping; the queued one is dropped
    finally:
        engine.release.set()
        worker.join(10)
        other.join(10)
    assert json.loads(results[0].json()["info"])["interrupted"] is True
    assert queued[0].status_code == 409 and "interrupted" in queued[0].text


LIST_KEYS: dict[str, set[str]] = {
    "schedulers": {"name", "label", "aliases", "default_rho", "need_inner_model"},
    "upscalers": {"name", "model_name", "model_path", "model_url", "scale"},
    "latent-upscale-modes": {"name"},
}


@pytest.mark.parametrize("route", ["schedulers", "upscalers", "latent-upscale-modes", "sd-vae", "sd-modules",
                                   "hypernetworks", "face-restorers", "realesrgan-models", "prompt-styles", "loras",
                                   "script-info", "extensions"])
def test_listings_are_lists_in_a1111_item_shapes(client: TestClient, route: str) -> None:
    response = client.get(f"/sdapi/v1/{route}")
    assert response.status_code == 200
    items = response.json()
    assert isinstance(items, list)
    for item in items:
        assert set(item) == LIST_KEYS[route]
    if route in LIST_KEYS:
        assert items  # the one truthful entry: Automatic, and A1111's "None" upscaler first
    names = [i["name"] for i in items]
    assert names in ([], ["None", *list(UPSCALERS)[1:]], served_latent_modes(),
                     ["automatic", "uniform", "karras", "exponential", "sgm_uniform"])
    assert route != "upscalers" or names[0] == "None"  # SillyTavern expects A1111's "None" first


def test_embeddings_memory_flags_and_refresh(client: TestClient) -> None:
    assert client.get("/sdapi/v1/embeddings").json() == {"loaded": {}, "skipped": {}}
    memory = client.get("/sdapi/v1/memory").json()
    assert memory["ram"]["used"] > 0 and memory["ram"]["total"] >= memory["ram"]["used"]
    assert memory["ram"]["free"] == memory["ram"]["total"] - memory["ram"]["used"]
    assert memory["cuda"] == {"error": "unavailable"}  # the fake engine has no GPU telemetry, as A1111 on a CPU
    flags = client.get("/sdapi/v1/cmd-flags").json()
    assert flags["api"] is True and flags["sdserve_profile"] == "dev"
    for route in ("refresh-checkpoints", "refresh-vae", "refresh-embeddings"):
        response = client.post(f"/sdapi/v1/{route}")
        assert response.status_code == 200 and response.json() is None
    refreshed = client.post("/sdapi/v1/refresh-loras")  # the new listing (the fake has no LoRA library)
    assert refreshed.status_code == 200 and refreshed.json() == []


def test_override_settings_check_names_the_served_model() -> None:
    info = ModelInfo("fake", 16, 64, SCHEDULER_NAMES, 77, DIGEST)
    store = OptionsStore()
    store.check({"sd_model_checkpoint": TITLE, "CLIP_stop_at_last_layers": 1}, info, "override_settings.")
    with pytest.raises(InvalidRequestError) as caught:
        store.check({"sd_model_checkpoint": "other"}, info, "override_settings.")
    assert caught.value.param == "override_settings.sd_model_checkpoint"
    assert TITLE in str(caught.value)


def test_unknown_a1111_fields_are_named_not_silently_ignored(client: TestClient) -> None:
    """A1111 clients send fields sdserve has no use for (SillyTavern: denoising_strength, hr_scale, ...): they are
    accepted so the client works, and named in the header and in info.warnings."""
    response = client.post("/sdapi/v1/txt2img", json={"prompt": "a", "steps": 2, "hr_scale": 2, "denoising_strength":
                                                      0.7, "ünïcode": 1})
    assert response.status_code == 200, response.text
    assert response.headers["x-sdserve-ignored-fields"] == "denoising_strength,hr_scale,%C3%BCn%C3%AFcode"
    warnings = json.loads(response.json()["info"])["warnings"]
    assert "ignored A1111 fields: denoising_strength, hr_scale, ünïcode" in warnings
    assert "hr_scale" not in response.json()["parameters"]
    plain = client.post("/sdapi/v1/txt2img", json={"prompt": "a", "steps": 2})
    assert "x-sdserve-ignored-fields" not in plain.headers

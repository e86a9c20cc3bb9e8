"""A1111 clients connecting to a real `sdserve serve`: the request sequences Open WebUI, SillyTavern and webuiapi
send, replayed in order, and every A1111 listing route in its documented shape (modules/api/models.py)."""

from __future__ import annotations

import base64
import io
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import webuiapi
from PIL import Image

SDAPI = "/sdapi/v1"


def _webui(url: str) -> webuiapi.WebUIApi:
    host, port = url.removeprefix("http://").split(":")
    return webuiapi.WebUIApi(host=host, port=int(port), sampler="Euler", steps=2)


@pytest.fixture
def client(dev_server: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=dev_server, timeout=60) as c:
        yield c


@pytest.fixture
def slow_batches(client: httpx.Client) -> Iterator[None]:
    """Every batch takes 1.5 s longer (the dev profile's fault injection), so a test can watch one run."""
    assert client.put("/debug/faults", json={"latency_s": 1.5}).status_code == 200
    yield
    client.put("/debug/faults", json={"latency_s": 0})


def _png(b64: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64)))


def test_open_webui_connect_and_generate(client: httpx.Client) -> None:
    """open-webui/open-webui backend/open_webui/routers/images.py: verify_url, get_models, get_image_model,
    set_image_model (GET options; POST the whole body back only when the model differs), image_generations."""
    auth = {"authorization": ""}  # get_automatic1111_api_auth with no credentials configured
    client.get(f"{SDAPI}/options", headers=auth).raise_for_status()  # verify_url
    models = [{"id": m["title"], "name": m["model_name"]} for m in client.get(f"{SDAPI}/sd-models").json()]
    assert len(models) == 1
    served = client.get(f"{SDAPI}/options", headers=auth).json()["sd_model_checkpoint"]  # get_image_model
    assert served == models[0]["id"]
    # set_image_model(served): the model is already the checkpoint, so Open WebUI posts nothing.
    # set_image_model(another): it posts the whole GET body back with the model changed; refused, naming ours.
    options = client.get(f"{SDAPI}/options", headers=auth).json()
    options["sd_model_checkpoint"] = "sd_xl_base_1.0.safetensors"
    refused = client.post(f"{SDAPI}/options", json=options, headers=auth)
    assert refused.status_code == 422
    assert refused.json()["detail"][0]["loc"] == ["body", "sd_model_checkpoint"]
    assert served in refused.json()["detail"][0]["msg"]
    assert client.get(f"{SDAPI}/options").json()["sd_model_checkpoint"] == served  # nothing changed
    # image_generations: get_image_model, then txt2img with the form's size, n and steps.
    assert client.get(f"{SDAPI}/options", headers=auth).json()["sd_model_checkpoint"] == served
    data = {"prompt": "a red kite", "batch_size": 2, "width": 64, "height": 64, "steps": 2,
            "negative_prompt": "blurry"}
    result = client.post(f"{SDAPI}/txt2img", json=data, headers=auth)
    assert result.status_code == 200, result.text
    assert [_png(b).size for b in result.json()["images"]] == [(64, 64), (64, 64)]


def test_sillytavern_connect_set_model_and_generate(client: httpx.Client, dev_server: str) -> None:
    """SillyTavern/SillyTavern src/endpoints/stable-diffusion.js: /ping, /upscalers, /vaes, /samplers,
    /schedulers, /models, /get-model, /set-model (then poll /progress), /generate, in that order."""
    client.get(f"{SDAPI}/options").raise_for_status()  # /ping: any 2xx
    upscalers = [x["name"] for x in client.get(f"{SDAPI}/upscalers").raise_for_status().json()]
    latent = [x["name"] for x in client.get(f"{SDAPI}/latent-upscale-modes").raise_for_status().json()]
    upscalers[1:1] = latent  # "0 = None, then Latent Upscalers, then Upscalers"
    assert upscalers[0] == "None"
    vaes = [client.get(f"{SDAPI}/sd-vae"), client.get(f"{SDAPI}/sd-modules")]  # either one may answer
    assert all(r.status_code == 200 and isinstance(r.json(), list) for r in vaes)
    samplers = [x["name"] for x in client.get(f"{SDAPI}/samplers").raise_for_status().json()]
    schedulers = [x["name"] for x in client.get(f"{SDAPI}/schedulers").raise_for_status().json()]
    assert "Euler a" in samplers and schedulers == ["automatic", "uniform", "karras", "exponential", "sgm_uniform"]
    models = [{"value": x["title"], "text": x["title"]} for x in client.get(f"{SDAPI}/sd-models").json()]
    current = client.get(f"{SDAPI}/options").json()["sd_model_checkpoint"]  # /get-model
    assert current == models[0]["value"]
    client.post(f"{SDAPI}/options", json={"sd_model_checkpoint": current}).raise_for_status()  # /set-model
    for _ in range(10):  # MAX_ATTEMPTS; the server is idle, so the first poll ends it
        state = client.get(f"{SDAPI}/progress").json()
        if state["progress"] == 0.0 and state["state"]["job_count"] == 0:
            break
    else:
        raise AssertionError(f"progress never idle: {state}")
    options = client.get(f"{SDAPI}/options").raise_for_status().json()  # /generate
    assert "forge_preset" not in options  # not Forge: forge_additional_modules is dropped client-side
    body = {"url": dev_server, "auth": "", "prompt": "a castle", "negative_prompt": "", "sampler_name": "Euler a",
            "scheduler": "Automatic", "steps": 2, "cfg_scale": 7, "width": 64, "height": 64, "seed": 7}
    result = client.post(f"{SDAPI}/txt2img", json=body)  # the server forwards its whole request body
    assert result.status_code == 200, result.text
    assert _png(result.json()["images"][0]).size == (64, 64)


def test_webuiapi_util_helpers(dev_server: str, client: httpx.Client) -> None:
    """webuiapi/webuiapi.py: util_get_current_model, util_set_model, get/set_options, util_wait_for_ready."""
    api = _webui(dev_server)
    title = api.util_get_model_names()[0]
    assert api.util_get_current_model() == title
    api.util_set_model(title.upper())  # find_closest lowercases the name, then picks the nearest listed title
    assert api.util_get_current_model() == title
    assert api.set_options({"send_seed": False}) is None
    try:
        assert api.get_options()["send_seed"] is False
    finally:
        api.set_options({"send_seed": True})
    refused = api.set_options({"samples_format": "webp"})  # webuiapi returns the 422 body as it is
    assert refused["detail"][0]["loc"] == ["body", "samples_format"]
    assert api.get_options()["samples_format"] == "png"
    _bounded(lambda: api.util_wait_for_ready(check_interval=0.1), "util_wait_for_ready on an idle server")
    assert sorted(api.util_get_scheduler_names()) == ["automatic", "exponential", "karras", "sgm_uniform", "uniform"]
    assert client.post(f"{SDAPI}/refresh-checkpoints").status_code == 200 and api.get_sd_models()[0]["title"] == title


def _bounded(call: Any, what: str, timeout: float = 60) -> None:
    done = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # surfaced below
            errors.append(exc)
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    assert done.wait(timeout), f"{what} did not return within {timeout}s"
    if errors:
        raise errors[0]


def test_progress_and_interrupt_while_a_batch_runs(dev_server: str, client: httpx.Client) -> None:
    """What a client watching a job sees: /progress at the running step, /interrupt stopping it at the next step
    boundary (images decoded from the latents so far, the info says so), util_wait_for_ready returning after."""
    api = _webui(dev_server)
    results: list[httpx.Response] = []
    body = {"prompt": "a long one", "steps": 50, "width": 256, "height": 256}  # seconds of steps on 2 CPU cores
    worker = threading.Thread(target=lambda: results.append(
        httpx.post(f"{dev_server}{SDAPI}/txt2img", json=body, timeout=120)))
    worker.start()
    try:
        busy = _poll(client, lambda b: b["state"]["sampling_step"] >= 1)
        assert busy["state"]["sampling_steps"] == 50 and 0 < busy["progress"] < 1
        response = client.post(f"{SDAPI}/interrupt")
        assert response.status_code == 200 and response.headers["x-sdserve-interrupt"] == "stopping"
        assert response.json()["interrupted"] is True and response.json()["running"] == 1
        _bounded(lambda: api.util_wait_for_ready(check_interval=0.1), "util_wait_for_ready after a batch")
        assert client.get(f"{SDAPI}/progress").json()["state"]["job_count"] == 0
    finally:
        worker.join(120)
    answer = results[0]
    info = json.loads(answer.json()["info"])
    assert answer.status_code == 200 and len(answer.json()["images"]) == 1
    assert info["interrupted"] is True and busy["state"]["sampling_step"] <= info["steps_done"] < 50
    assert answer.headers["x-sdserve-interrupted"] == f"{info['steps_done']}/50"
    idle = client.post(f"{SDAPI}/skip")
    assert idle.headers["x-sdserve-interrupt"] == "idle" and idle.json()["interrupted"] is False


def _poll(client: httpx.Client, check: Any, timeout: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = client.get(f"{SDAPI}/progress").json()
        if check(body):
            return dict(body)
        time.sleep(0.02)
    raise AssertionError(f"progress never matched: {body}")


ITEM_KEYS: dict[str, set[str]] = {
    "samplers": {"name", "aliases", "options"},
    "schedulers": {"name", "label", "aliases", "default_rho", "need_inner_model"},
    "upscalers": {"name", "model_name", "model_path", "model_url", "scale"},
    "latent-upscale-modes": {"name"},
    "sd-models": {"title", "model_name", "hash", "sha256", "filename", "config"},
}
LISTS = ["samplers", "schedulers", "upscalers", "latent-upscale-modes", "sd-models", "sd-vae", "sd-modules",
         "hypernetworks", "face-restorers", "realesrgan-models", "prompt-styles", "loras", "script-info",
         "extensions"]


@pytest.mark.parametrize("route", LISTS)
def test_every_listing_route_answers_a_list_of_a1111_items(client: httpx.Client, route: str) -> None:
    response = client.get(f"{SDAPI}/{route}")
    assert response.status_code == 200
    items = response.json()
    assert isinstance(items, list)
    assert (len(items) > 0) == (route in ITEM_KEYS)  # empty exactly where sdserve has nothing of the kind
    assert all(set(item) == ITEM_KEYS[route] for item in items)


def test_dict_routes_answer_in_a1111_shapes(client: httpx.Client) -> None:
    assert client.get(f"{SDAPI}/embeddings").json() == {"loaded": {}, "skipped": {}}
    memory = client.get(f"{SDAPI}/memory").json()
    assert set(memory) == {"ram", "cuda"} and memory["ram"]["total"] > memory["ram"]["used"] > 0
    assert memory["cuda"] == {"error": "unavailable"}  # the dev profile runs on the CPU provider
    assert client.get(f"{SDAPI}/cmd-flags").json()["nowebui"] is True
    assert client.get(f"{SDAPI}/scripts").json() == {"txt2img": [], "img2img": []}
    progress = client.get(f"{SDAPI}/progress", params={"skip_current_image": "true"}).json()
    assert set(progress) == {"progress", "eta_relative", "state", "current_image", "textinfo"}
    assert set(progress["state"]) == {"skipped", "interrupted", "stopping_generation", "job", "job_count",
                                      "job_timestamp", "job_no", "sampling_step", "sampling_steps"}


def test_serve_takes_a1111s_cors_flags(tiny_model: Any) -> None:
    """`sdserve serve --cors-allow-origins ... --cors-allow-origins-regex ...`, spelled as A1111's flags (what
    openOutpaint's CORS message tells its users to pass): a browser origin in the list or matching the regex gets
    CORS headers on /health while the model is still booting; another does not."""
    from tests.e2e.conftest import ServerProcess

    server = ServerProcess("--profile", "dev", "--model", str(tiny_model), "--cors-allow-origins",
                           "https://zero01101.github.io,http://127.0.0.1:3456", "--cors-allow-origins-regex",
                           r"https://.*\.photopea\.example")
    try:
        assert server._found.wait(120), server.log
        for origin, allowed in (("https://zero01101.github.io", True), ("https://a.photopea.example", True),
                                ("https://evil.example", False)):
            answer = httpx.get(f"{server.url}/health", headers={"origin": origin}, timeout=30)
            assert (answer.headers.get("access-control-allow-origin") == origin) is allowed, origin
    finally:
        assert server.stop() == 0, server.log

"""Both client APIs, auth and limits against real `sdserve serve` processes."""

from __future__ import annotations

import base64
import hashlib
import io
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import webuiapi
from PIL import Image

from tests.e2e.conftest import ServerProcess, dev_config

GEN = "/v1/images/generations"


def test_openai_client_url_format_serves_short_lived_pngs(dev_server: str) -> None:
    """The SDK user's url flow as written: generate with response_format url, then httpx.get(url) as returned."""
    client = openai.OpenAI(base_url=f"{dev_server}/v1", api_key="unused", max_retries=0)
    result = client.images.generate(prompt="a kite", n=2, size="64x64", response_format="url",  # type: ignore[arg-type]
                                    extra_body={"steps": 4})
    assert len(result.data) == 2
    for item in result.data:
        assert item.url is not None and item.url.startswith(f"{dev_server}/v1/images/files/")  # absolute
        png = httpx.get(item.url)
        assert png.status_code == 200 and png.headers["content-type"] == "image/png"
        with Image.open(io.BytesIO(png.content)) as image:
            assert image.size == (64, 64)
    assert httpx.get(f"{dev_server}/v1/images/files/not-an-id.png").status_code == 404


def _webui(url: str) -> webuiapi.WebUIApi:
    host, port = url.removeprefix("http://").split(":")
    return webuiapi.WebUIApi(host=host, port=int(port), sampler="Euler a", steps=6)


def test_webuiapi_client_txt2img(dev_server: str) -> None:
    api = _webui(dev_server)
    result = api.txt2img(prompt="a lighthouse", negative_prompt="blurry", seed=5, cfg_scale=6.0, width=64, height=48,
                         batch_size=2, n_iter=2, sampler_name="DPM++ 2M")
    assert len(result.images) == 4 and all(img.size == (64, 48) for img in result.images)
    assert result.info["all_seeds"] == [5, 6, 7, 8]
    assert result.info["sampler_name"] == "DPM++ 2M" and result.info["steps"] == 6
    again = api.txt2img(prompt="a lighthouse", negative_prompt="blurry", seed=5, cfg_scale=6.0, width=64,
                        height=48, sampler_name="DPM++ 2M")
    assert again.images[0].tobytes() == result.images[0].tobytes()
    names = [s["name"] for s in api.get_samplers()]
    assert names[:4] == ["Euler", "Euler a", "DDIM", "DPM++ 2M"] and "DPM++ 2M SDE" in names
    models = api.get_sd_models()
    assert models[0]["model_name"] and len(models[0]["sha256"]) == 64


@pytest.mark.parametrize(("body", "field", "fragment"), [
    ({"prompt": "x", "width": 65, "height": 64}, "size", "multiple of 16"),
    ({"prompt": "x", "sampler_name": "DPM2 Karras"}, "sampler_name", "does not implement it"),
    ({"prompt": "x", "enable_hr": True, "hr_upscaler": "Latent (antialiased)"}, "hr_upscaler", "antialiased"),
    ({"prompt": "x", "batch_size": 9}, "batch_size", "at most 4"),
    ({"prompt": "x", "steps": 0}, "steps", "greater than or equal to 1"),
    ({"negative_prompt": "x"}, "prompt", "field required"),
])
def test_a1111_validation_is_422_naming_the_field(dev_server: str, body: dict[str, object], field: str,
                                                   fragment: str) -> None:
    response = httpx.post(f"{dev_server}/sdapi/v1/txt2img", json=body, timeout=30)
    assert response.status_code == 422
    detail = response.json()["detail"][0]
    assert detail["loc"][-1] == field and fragment in detail["msg"]


def test_long_prompt_is_truncated_with_a_warning(dev_server: str) -> None:
    response = httpx.post(f"{dev_server}{GEN}", json={"prompt": "tree " * 100, "steps": 2}, timeout=30)
    assert response.status_code == 200
    assert "prompt truncated to 77 CLIP tokens" in response.headers["x-sdserve-warnings"]
    a1111 = httpx.post(f"{dev_server}/sdapi/v1/txt2img", json={"prompt": "tree " * 100, "steps": 2}, timeout=30)
    assert "prompt truncated to 77 CLIP tokens" in json.loads(a1111.json()["info"])["warnings"]


def test_oversized_body_is_413(dev_server: str) -> None:
    response = httpx.post(f"{dev_server}{GEN}", content=b'{"prompt": "' + b"a" * (2 << 20) + b'"}',
                          headers={"content-type": "application/json"})
    assert response.status_code == 413


KEY = "sk-sdserve-test-0123456789"


@pytest.fixture(scope="module")
def guarded(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("auth")
    config = dev_config(tmp, append="\n[auth]\nper_key_concurrency = 2\n")
    server = ServerProcess("--config", str(config), "--model", str(tiny_model),
                           env={"SDSERVE_API_KEYS_SHA256": hashlib.sha256(KEY.encode()).hexdigest()})
    server.wait_ready()
    yield server
    assert server.stop() == 0


def test_auth_keys_probes_open_and_keys_never_logged(guarded: ServerProcess) -> None:
    url = guarded.url
    body = {"prompt": "a key", "steps": 2}
    assert httpx.post(f"{url}{GEN}", json=body).status_code == 401
    wrong = httpx.post(f"{url}{GEN}", json=body, headers={"Authorization": "Bearer sk-wrong"})
    assert wrong.status_code == 401 and wrong.headers["www-authenticate"].startswith("Bearer, Basic")
    assert httpx.post(f"{url}{GEN}", json=body, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    for probe in ("/health", "/ready", "/metrics"):
        assert httpx.get(f"{url}{probe}").status_code == 200
    assert httpx.get(f"{url}/capabilities").status_code == 401
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    assert client.images.generate(prompt="x", size="64x64", response_format="b64_json").data  # type: ignore[arg-type]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).images.generate(prompt="x")
    assert KEY not in guarded.log and "sk-wrong" not in guarded.log


def test_per_key_concurrency_limit(guarded: ServerProcess) -> None:
    import asyncio

    url = guarded.url
    httpx.put(f"{url}/debug/faults", json={"latency_s": 0.5}, headers={"Authorization": f"Bearer {KEY}"})

    async def burst() -> list[int]:
        async with httpx.AsyncClient(timeout=30, headers={"Authorization": f"Bearer {KEY}"}) as client:
            rs = await asyncio.gather(*(client.post(f"{url}{GEN}", json={"prompt": f"{i}", "steps": 2})
                                        for i in range(4)))
            return [r.status_code for r in rs]

    try:
        codes = asyncio.run(burst())
    finally:
        httpx.put(f"{url}/debug/faults", json={"latency_s": 0}, headers={"Authorization": f"Bearer {KEY}"})
    assert sorted(codes) == [200, 200, 429, 429]


def test_reject_policy_refuses_long_prompts(tiny_model: Path, tmp_path: Path) -> None:
    config = dev_config(tmp_path, replace={"max_steps = 50": 'max_steps = 50\nprompt_overflow = "reject"'})
    server = ServerProcess("--config", str(config), "--model", str(tiny_model))
    try:
        url = server.wait_ready()
        response = httpx.post(f"{url}{GEN}", json={"prompt": "tree " * 100, "steps": 2})
        assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    finally:
        server.stop()


def test_b64_roundtrip_of_openai_route_is_png(dev_server: str) -> None:
    item = httpx.post(f"{dev_server}{GEN}", json={"prompt": "x", "steps": 2}, timeout=30).json()["data"][0]
    assert base64.b64decode(item["b64_json"])[:8] == b"\x89PNG\r\n\x1a\n"

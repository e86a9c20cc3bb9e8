"""The step cache through a real server (`[cache] policy = "opt-in"`, signing on): the boot gate's verdict in
/capabilities, a cached request named in the response header (OpenAI SDK), the infotext (A1111) and the signed C2PA
manifest, an uncached request unchanged, and a request asking where the cache cannot run refused by name."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from server.provenance_verify import verify_bytes
from tests.e2e.conftest import ServerProcess, dev_config
from tests.provenance_ca import SigningCredential

pytestmark = pytest.mark.slow
CACHE_TABLE = '\n[cache]\npolicy = "opt-in"\ngate_steps = 12\n'


@pytest.fixture(scope="module")
def cache_server(tiny_model: Path, credential: SigningCredential,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("cache")
    env = credential.require_env(folder)
    server = ServerProcess("--profile", "dev", "--config", str(dev_config(folder, append=CACHE_TABLE)),
                           "--model", str(tiny_model), env=env)
    try:
        server.wait_ready(timeout=180)
        yield server
    finally:
        assert server.stop() == 0, server.log


def test_the_boot_gate_is_in_capabilities(cache_server: ServerProcess) -> None:
    caps = httpx.get(f"{cache_server.url}/capabilities").json()["step_cache"]
    assert caps["policy"] == "opt-in" and caps["method"] == "output"
    shapes = caps["gate"]["shapes"]
    assert [s["size"] for s in shapes] == ["64x64"]
    assert shapes[0]["passed"] is True and shapes[0]["reused"] > 0 and shapes[0]["steps"] == 12
    assert shapes[0]["mean_psnr_db"] >= caps["gate"]["min_mean_psnr_db"]


def test_a_cached_openai_request_says_so_in_its_header_and_manifest(cache_server: ServerProcess,
                                                                   credential: SigningCredential) -> None:
    with openai.OpenAI(base_url=f"{cache_server.url}/v1", api_key="unused") as client:
        _cached_and_plain(client, credential)


def _cached_and_plain(client: openai.OpenAI, credential: SigningCredential) -> None:
    raw = client.images.with_raw_response.generate(prompt="a lighthouse", size="64x64",
                                                   extra_body={"steps": 20, "seed": 3, "step_cache": True})
    header = raw.headers["x-sdserve-cache"]
    assert header.startswith("output:0.2; reused=")
    reused, evaluations = (int(v) for v in header.split("reused=")[1].split("/"))
    assert 0 < reused < evaluations == 20
    image = base64.b64decode(raw.parse().data[0].b64_json or "")
    result = verify_bytes(image, credential.ca_pem.decode())
    assert result.verdict == "trusted", result.problems
    assert result.generation is not None
    recorded = result.generation["step_cache"]
    assert recorded["method"] == "output" and recorded["threshold"] == 0.2
    assert (recorded["reused"], recorded["evaluations"]) == (reused, evaluations)
    plain = client.images.with_raw_response.generate(prompt="a lighthouse", size="64x64",
                                                     extra_body={"steps": 20, "seed": 3})
    assert "x-sdserve-cache" not in plain.headers  # opt-in: absent means uncached
    assert plain.parse().data[0].b64_json != raw.parse().data[0].b64_json


def test_a1111_names_the_cache_in_the_infotext(cache_server: ServerProcess) -> None:
    body = {"prompt": "a harbour", "steps": 20, "seed": 4, "width": 64, "height": 64, "step_cache": True}
    response = httpx.post(f"{cache_server.url}/sdapi/v1/txt2img", json=body, timeout=120)
    assert response.status_code == 200, response.text
    infotext = json.loads(response.json()["info"])["infotexts"][0]
    assert "Step cache: output 0.2 reused " in infotext
    assert response.headers["x-sdserve-cache"].startswith("output:0.2")


@pytest.mark.parametrize(("body", "why"), [({"steps": 8}, "at least 9 steps"),
                                           ({"steps": 20, "size": "128x128"}, "no quality gate ran for 128x128")])
def test_asking_where_the_cache_cannot_run_is_refused_by_name(cache_server: ServerProcess, body: dict[str, object],
                                                              why: str) -> None:
    request = {"prompt": "a cube", "size": "64x64", "step_cache": True, **body}
    response = httpx.post(f"{cache_server.url}/v1/images/generations", json=request, timeout=120)
    assert response.status_code in (400, 422), response.text
    error = response.json()["error"]
    assert error["param"] == "step_cache" and why in error["message"]


def test_the_openai_sdk_sees_the_refusal(cache_server: ServerProcess) -> None:
    with openai.OpenAI(base_url=f"{cache_server.url}/v1", api_key="unused", max_retries=0) as client, \
            pytest.raises(openai.APIStatusError) as err:
        client.images.generate(prompt="a cube", size="64x64", extra_body={"steps": 4, "step_cache": True})
    assert err.value.status_code in (400, 422) and "step_cache" in str(err.value)

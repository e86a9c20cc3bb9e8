"""The official `openai` client against a real `sdserve serve` (dev profile: [api] model_aliases): aliases run the
served model and say so, an unknown model is a 400 naming the served ids, GET /v1/models lists both, and a 504 is
answered once: the client does not retry it (counted server-side in sdserve_requests_total)."""

from __future__ import annotations

import base64
import io
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import openai
import pytest
from openai.types import ImagesResponse
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

GEN_ROUTE = "/v1/images/generations"


@contextmanager
def _client(url: str, retries: int = 0) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=retries) as client:
        yield client


def _png_size(result: ImagesResponse) -> tuple[int, int]:
    assert result.data and result.data[0].b64_json is not None
    with Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json))) as image:
        return image.size


def _served(url: str) -> str:
    """The served model id: the model folder's name (the tiny_model fixture's folder, not "tiny")."""
    return str(httpx.get(f"{url}/v1/models").json()["data"][0]["id"])


def _requests(url: str, status: str) -> float:
    """sdserve_requests_total for the generation route and ``status`` (0 before the first one)."""
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if (sample.name == "sdserve_requests_total" and sample.labels.get("route") == GEN_ROUTE
                    and sample.labels.get("status") == status):
                return float(sample.value)
    return 0.0


@pytest.mark.parametrize("alias", ["dall-e-2", "gpt-image-1"])
def test_an_alias_runs_the_served_model_and_the_header_says_which(dev_server: str, alias: str) -> None:
    with _client(dev_server) as client:
        raw = client.images.with_raw_response.generate(model=alias, prompt="a paper boat", size="64x64",
                                                       response_format="b64_json", extra_body={"steps": 2})
    assert raw.headers["x-sdserve-model"] == _served(dev_server)
    assert _png_size(raw.parse()) == (64, 64)


def test_an_unknown_model_is_a_400_naming_the_served_ids(dev_server: str) -> None:
    with _client(dev_server) as client, pytest.raises(openai.BadRequestError) as refused:
        client.images.generate(model="sd_xl_base_1.0", prompt="x", size="64x64")
    assert refused.value.status_code == 400
    body: Any = refused.value.body
    assert body["param"] == "model" and f"[{_served(dev_server)!r}]" in body["message"]
    assert "dall-e-2" in body["message"]


def test_models_list_has_the_served_model_and_the_aliases(dev_server: str) -> None:
    with _client(dev_server) as client:
        models = {m.id: m for m in client.models.list()}
    assert list(models) == [_served(dev_server), "dall-e-2", "dall-e-3", "gpt-image-1", "gpt-image-1-mini",
                            "gpt-image-1.5"]
    assert all(m.owned_by == "sdserve" and m.object == "model" for m in models.values())


def test_size_auto_is_the_native_size(dev_server: str) -> None:
    native = httpx.get(f"{dev_server}/v1/models").json()["data"][0]["native_size"]
    with _client(dev_server) as client:
        result = client.images.generate(prompt="a kite", size="auto", response_format="b64_json",
                                        extra_body={"steps": 2})
    assert _png_size(result) == (native, native)


def _running(url: str) -> bool:
    return bool(httpx.get(f"{url}/sdapi/v1/progress").json()["state"]["job"] == "sdserve: generating")


def test_a_504_is_not_retried_by_the_openai_client(dev_server: str) -> None:
    """openai-python's _base_client.py _should_retry retries every 5xx (max_retries=2 by default) unless the
    response says x-should-retry: false, which sdserve sends with every 504."""
    before = _requests(dev_server, "504")
    assert httpx.put(f"{dev_server}/debug/faults", json={"latency_s": 2.0}).status_code == 200
    blocker = threading.Thread(target=lambda: httpx.post(f"{dev_server}{GEN_ROUTE}", timeout=60,
                                                         json={"prompt": "blocker", "size": "64x64", "steps": 2}))
    blocker.start()
    try:
        deadline = time.monotonic() + 30
        while not _running(dev_server):
            assert time.monotonic() < deadline, "the blocking batch never started"
            time.sleep(0.02)
        with _client(dev_server, retries=2) as client, pytest.raises(openai.InternalServerError) as late:
            client.images.generate(prompt="late", size="64x64", extra_body={"steps": 3},
                                   extra_headers={"x-sdserve-timeout-s": "0.3"})
    finally:
        httpx.put(f"{dev_server}/debug/faults", json={"latency_s": 0})
        blocker.join(60)
    assert late.value.status_code == 504 and late.value.response.headers["x-should-retry"] == "false"
    assert _requests(dev_server, "504") - before == 1  # one attempt reached the server

"""The server's side of LoRA on the fake engine: A1111's tag syntax, the ``loras`` field giving the same set, names
resolved before admission, the batcher merging only requests of one set, admission counting an uncached set's
merge, and the header naming the set that ran."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from engines.errors import InvalidRequestError
from engines.types.model import LoraInfo
from engines.types.request import Batch, ImageSpec, LoraUse
from server.app import create_app
from server.batcher import Job
from server.lora_prompt import header_value, parse_prompt
from server.request_rules import build_batch
from server.schemas import ImageGenerationRequest
from server.settings import load_settings
from tests.unit.fakes import FakeEngine

SHA_A, SHA_B = "a" * 64, "b" * 64
LIBRARY = (LoraInfo("style", "style", "style.safetensors", SHA_A, 10, {}, "", {"unet": 3}),
           LoraInfo("ink", "ink", "sub/ink.safetensors", SHA_B, 10, {}, "", {"unet": 3, "text_encoder": 2}),
           LoraInfo("evil", "evil", "evil.ckpt", "", 10, {}, "evil.ckpt is a pickle file (.ckpt): refused", {}))


@pytest.mark.parametrize(("prompt", "text", "wanted"), [
    ("a cat <lora:style:0.5>", "a cat", [("style", 0.5, 0.5)]),
    ("<lora:style> a cat", "a cat", [("style", 1.0, 1.0)]),
    ("a cat, <lora:style:0.8:0.2>, night", "a cat, , night", [("style", 0.8, 0.2)]),  # A1111 keeps the commas
    ("a cat <lora:style:te=0.3:unet=0.7>", "a cat", [("style", 0.3, 0.7)]),
    ("a cat <lora:style:1:unet=0>", "a cat", [("style", 1.0, 0.0)]),
    ("<lora:style:0.5><lyco:ink:-1>a cat", "a cat", [("style", 0.5, 0.5), ("ink", -1.0, -1.0)]),
    ("a cat <embedding:x>", "a cat <embedding:x>", []),
    ("no tags: <not a tag>", "no tags: <not a tag>", []),
])
def test_a1111_tags_are_parsed_out_of_the_prompt(prompt: str, text: str, wanted: list[tuple[str, float, float]]
                                                 ) -> None:
    stripped, found = parse_prompt(prompt)
    assert stripped == text
    assert [(w.name, w.te, w.unet) for w in found] == wanted


@pytest.mark.parametrize(("prompt", "words"), [("<lora:style:x>", "not a multiplier"),
                                               ("<lora:style:1:2:3>", "more than"),
                                               ("<lora:style:dyn=4>", "dyn="), ("<lora: :1>", "names no LoRA"),
                                               ("<hypernet:h:1>", "hypernetwork")])
def test_malformed_tags_are_refused_naming_the_prompt(prompt: str, words: str) -> None:
    with pytest.raises(InvalidRequestError, match=words) as caught:
        parse_prompt(prompt)
    assert caught.value.param == "prompt"


def _batch(**fields: object) -> Batch:
    engine = FakeEngine()
    req = ImageGenerationRequest.model_validate({"prompt": "a cat", "seed": 1, "size": "64x64", **fields})
    return build_batch(req, load_settings("dev"), engine.info, {f.name: f for f in LIBRARY})


def test_the_tag_and_the_field_give_the_same_set_and_prompt() -> None:
    by_tag = _batch(prompt="a cat <lora:ink:0.5> <lora:style:0.25:1>")
    by_field = _batch(loras=[{"name": "style", "weight": 0.25, "unet_weight": 1.0}, {"name": "ink", "weight": 0.5}])
    assert by_tag.lora_key == by_field.lora_key
    assert by_tag.loras == by_field.loras
    assert by_tag.images[0].prompt == by_field.images[0].prompt == "a cat"
    assert header_value(by_tag.loras) == f"style:{SHA_A[:12]}:0.25:1,ink:{SHA_B[:12]}:0.5:0.5"
    assert _batch().loras == () and header_value(()) == "none"


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"loras": [{"name": "ghost"}]}, "loras.0.name", "unknown LoRA 'ghost'; this server has: ink, style"),
    ({"loras": [{"name": "style"}, {"name": "evil"}]}, "loras.1.name", "pickle"),
    ({"prompt": "a cat <lora:../style:1>"}, "prompt", "unknown LoRA '../style'"),
    ({"loras": [{"name": "style", "weight": 11.0}]}, "loras.0.name", "max_multiplier"),
    ({"loras": [{"name": "style", "weight": float("nan")}]}, "loras.0.name", "outside"),
    ({"loras": [{"name": "style"}] * 9}, "loras.8.name", "at most 8"),
])
def test_bad_sets_are_refused_before_admission_naming_the_field(fields: dict[str, object], param: str,
                                                                 words: str) -> None:
    with pytest.raises(InvalidRequestError, match=words.replace("(", r"\(").replace(".", r"\.")) as caught:
        _batch(**fields)
    assert caught.value.param == param


def test_a_lora_on_a_server_without_a_library_names_the_setting() -> None:
    req = ImageGenerationRequest.model_validate({"prompt": "a <lora:style:1>", "size": "64x64"})
    with pytest.raises(InvalidRequestError, match="no LoRA library"):
        build_batch(req, load_settings("dev"), FakeEngine().info, {})


def test_the_batcher_merges_only_requests_of_one_set() -> None:
    loop = asyncio.new_event_loop()
    try:
        def job(uses: tuple[LoraUse, ...]) -> Job:
            return Job(Batch((ImageSpec("x"),), loras=uses), loop.create_future(), 0.0, None)

        a = (LoraUse("style", SHA_A, 1.0, 1.0),)
        assert job(a).group == job(a).group
        assert job(a).group != job(()).group
        assert job(a).group != job((LoraUse("style", SHA_A, 0.5, 0.5),)).group
        b = (LoraUse("ink", SHA_B, 1.0, 1.0), LoraUse("style", SHA_A, 1.0, 1.0))
        assert job(b).group == job(tuple(reversed(b))).group  # the key is sorted
    finally:
        loop.close()


@pytest.fixture
def lora_client() -> Iterator[tuple[TestClient, FakeEngine]]:
    engine = FakeEngine()
    engine.library = LIBRARY
    with TestClient(create_app(engine, load_settings("dev"))) as client:
        deadline = time.monotonic() + 30
        while client.get("/ready").status_code != 200:
            assert time.monotonic() < deadline, "never ready"
            time.sleep(0.02)
        yield client, engine


def test_served_batches_carry_the_set_and_the_header_names_it(lora_client: tuple[TestClient, FakeEngine]) -> None:
    client, engine = lora_client
    response = client.post("/v1/images/generations", json={"prompt": "a cat <lora:style:0.7>", "size": "64x64"})
    assert response.status_code == 200, response.text
    assert response.headers["x-sdserve-loras"] == f"style:{SHA_A[:12]}:0.7:0.7"
    assert engine.batches[-1].loras == (LoraUse("style", SHA_A, 0.7, 0.7),)
    assert engine.batches[-1].images[0].prompt == "a cat"
    a1111 = client.post("/sdapi/v1/txt2img", json={"prompt": "a cat <lora:ink:1>", "width": 64, "height": 64})
    assert a1111.status_code == 200, a1111.text
    assert 'Lora hashes: "ink: ' in json.loads(a1111.json()["info"])["infotexts"][0]
    listed = client.get("/sdapi/v1/loras").json()
    assert [i["name"] for i in listed] == ["style", "ink", "evil"] and listed[1]["path"] == "sub/ink.safetensors"


def test_admission_counts_the_merge_of_a_set_not_cached(lora_client: tuple[TestClient, FakeEngine]) -> None:
    client, engine = lora_client
    service = client.app.state.service  # type: ignore[attr-defined]
    service.cost.seed(64, 64, 1, 20, 0.2)  # 10 ms per image-step: a 20-step image costs 0.2 s
    engine.merge_s = 30.0
    body = {"prompt": "a cat <lora:style:1>", "size": "64x64", "steps": 20}
    refused = client.post("/v1/images/generations", json=body, headers={"x-sdserve-timeout-s": "5"})
    assert refused.status_code == 400 and "merge a LoRA set" in refused.json()["error"]["message"]
    engine.cached.add(((SHA_A, 1.0, 1.0),))
    admitted = client.post("/v1/images/generations", json=body, headers={"x-sdserve-timeout-s": "5"})
    assert admitted.status_code == 200, admitted.text


def test_a_loras_field_on_an_a1111_route_is_refused_pointing_at_the_prompt_syntax(
        lora_client: tuple[TestClient, FakeEngine]) -> None:
    client, _ = lora_client
    response = client.post("/sdapi/v1/txt2img", json={"prompt": "a cat", "width": 64, "height": 64,
                                                      "loras": [{"name": "style"}]})
    assert response.status_code == 422 and "<lora:name:multiplier>" in response.text

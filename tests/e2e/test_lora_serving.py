"""LoRA served by a real `sdserve serve --lora-dir` (dev profile, tiny SD 1.x): A1111's ``<lora:name:mult>`` through
webuiapi, the ``loras`` extension field through the official openai SDK, the same set by either spelling giving the
same key and the same image, concurrent requests with different sets each answered with their own image, and
hostile library files (pickle, truncated, a huge header, another family's LoRA, a link out of the folder, a
path-traversal name) refused with a 4xx that names the problem."""

from __future__ import annotations

import base64
import io
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import webuiapi
from PIL import Image

from server.provenance_verify import verify_bytes
from tests import lora_files as lf
from tests.e2e.conftest import ServerProcess
from tests.provenance_ca import SigningCredential

pytestmark = pytest.mark.slow
PROMPT = "a lighthouse at dusk"
BODY = {"size": "64x64", "steps": 4, "seed": 21, "scheduler": "euler", "response_format": "b64_json"}


@pytest.fixture(scope="module")
def folder(tiny_build: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    import diffusers

    pipe = diffusers.StableDiffusionPipeline.from_pretrained(tiny_build[1], safety_checker=None)
    root = tmp_path_factory.mktemp("lora-library")
    lf.peft_file(root / "style.safetensors", {
        "unet": lf.lora_factors(pipe.unet, lf.UNET_TARGETS, 4, seed=1, scale=0.6),
        "text_encoder": lf.lora_factors(pipe.text_encoder, lf.TE_TARGETS, 4, seed=2, scale=0.6)})
    lf.kohya_file(root / "other.safetensors", {"unet": lf.lora_factors(pipe.unet, lf.UNET_TARGETS, 4, seed=3,
                                                                       scale=0.6)}, alpha=4.0)
    _hostile(root, tmp_path_factory.mktemp("outside"))
    return root


def _hostile(root: Path, outside: Path) -> None:
    (root / "evil.ckpt").write_bytes(b"\x80\x04\x95" + b"cos\nsystem\n" * 4)  # a pickle: never opened
    good = (root / "style.safetensors").read_bytes()
    (root / "truncated.safetensors").write_bytes(good[: len(good) // 2])
    lf.raw_safetensors(root / "huge_header.safetensors", b"{}", declared=2**40)
    lf.raw_safetensors(root / "not_json.safetensors", b"\x00garbage\xff")
    lf.raw_safetensors(root / "xl_on_sd1.safetensors", {  # SDXL's second text encoder: absent from SD 1.x
        "lora_te2_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight":
            {"dtype": "F32", "shape": [4, 32], "data_offsets": [0, 512]},
        "lora_te2_text_model_encoder_layers_0_self_attn_q_proj.lora_up.weight":
            {"dtype": "F32", "shape": [32, 4], "data_offsets": [512, 1024]}}, bytes(1024))
    lf.raw_safetensors(root / "wrong_shape.safetensors", {  # an SDXL-sized factor on an SD 1.x module
        "lora_unet_down_blocks_1_attentions_0_proj_in.lora_down.weight":
            {"dtype": "F32", "shape": [4, 640], "data_offsets": [0, 10240]},
        "lora_unet_down_blocks_1_attentions_0_proj_in.lora_up.weight":
            {"dtype": "F32", "shape": [640, 4], "data_offsets": [10240, 20480]}}, bytes(20480))
    target = outside / "secret.safetensors"
    target.write_bytes(good)
    os.symlink(target, root / "linked.safetensors")


@pytest.fixture(scope="module")
def server(tiny_model: Path, folder: Path, credential: SigningCredential,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Signing every image (provenance require): the manifest must name the adapter set that ran."""
    env = credential.require_env(tmp_path_factory.mktemp("secret"))
    process = ServerProcess("--profile", "dev", "--model", str(tiny_model), "--lora-dir", str(folder), env=env)
    try:
        yield process.wait_ready(timeout=300)
    finally:
        assert process.stop() == 0, process.log


def _pixels(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"), dtype=np.int16)


def _generate(url: str, prompt: str = PROMPT, **extra: Any) -> tuple[np.ndarray, httpx.Response]:
    response = httpx.post(f"{url}/v1/images/generations", json={**BODY, "prompt": prompt, **extra}, timeout=120)
    assert response.status_code == 200, response.text
    return _pixels(response.json()["data"][0]["b64_json"]), response


def test_the_library_is_listed_with_hashes_and_every_refusal_named(server: str, folder: Path) -> None:
    listed = {item["name"]: item for item in httpx.get(f"{server}/sdapi/v1/loras", timeout=30).json()}
    assert {"name", "alias", "path", "metadata"} <= set(listed["style"])
    assert listed["style"]["problem"] is None and len(listed["style"]["sha256"]) == 64
    assert listed["style"]["components"] == {"unet": 72, "text_encoder": 30}
    assert listed["other"]["alias"] == "other" and listed["other"]["metadata"]["ss_network_dim"] == "4"
    problems = {name: item["problem"] or "" for name, item in listed.items()}
    assert "pickle" in problems["evil"]
    assert "truncated" in problems["truncated"]
    assert "header" in problems["huge_header"]
    assert "not JSON" in problems["not_json"]
    assert "text_encoder_2" in problems["xl_on_sd1"] and "another model family" in problems["xl_on_sd1"]
    assert "640" in problems["wrong_shape"] and "another model family" in problems["wrong_shape"]
    assert "outside the LoRA folder" in problems["linked"]
    assert all(not str(item["path"]).startswith("/") for item in listed.values())  # no server paths shown
    caps = httpx.get(f"{server}/capabilities", timeout=30).json()["lora"]
    assert caps["usable"] == 2 and set(caps["refused"]) >= {"evil.ckpt", "linked.safetensors"}
    assert str(folder) not in json.dumps(caps)


def test_webuiapi_with_a_lora_tag_in_the_prompt(server: str) -> None:
    host, port = server.removeprefix("http://").split(":")
    api = webuiapi.WebUIApi(host=host, port=int(port), sampler="Euler", steps=4)
    plain = api.txt2img(prompt=PROMPT, width=64, height=64, seed=5, cfg_scale=7)
    styled = api.txt2img(prompt=f"{PROMPT} <lora:style:0.9>", width=64, height=64, seed=5, cfg_scale=7)
    a, b = (np.asarray(r.image.convert("RGB"), dtype=np.int16) for r in (plain, styled))
    assert (np.abs(a - b) > 2).mean() > 0.2, "the LoRA changed the image"
    assert 'Lora hashes: "style: ' in styled.info["infotexts"][0]
    assert "<lora:style:0.9>" in styled.info["prompt"]  # the infotext keeps the tag, as A1111's does
    again = api.txt2img(prompt=f"<lora:style:0.9> {PROMPT}", width=64, height=64, seed=5, cfg_scale=7)
    assert np.array_equal(np.asarray(again.image), np.asarray(styled.image))  # tags come out wherever they are


def test_openai_sdk_extension_field_and_prompt_tag_give_the_same_set_and_image(
        server: str, credential: SigningCredential) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="not-needed", max_retries=0)
    extra = {k: v for k, v in BODY.items() if k not in ("size", "response_format")}
    by_field = client.images.with_raw_response.generate(
        prompt=PROMPT, size="64x64", response_format="b64_json",
        extra_body={**extra, "loras": [{"name": "style", "weight": 0.5}]})
    by_tag = client.images.with_raw_response.generate(prompt=f"{PROMPT} <lora:style:0.5>", size="64x64",
                                                      response_format="b64_json", extra_body=extra)
    assert by_field.headers["x-sdserve-loras"] == by_tag.headers["x-sdserve-loras"]
    assert by_field.headers["x-sdserve-loras"].startswith("style:") and ":0.5:0.5" in by_field.headers[
        "x-sdserve-loras"]
    signed = verify_bytes(base64.b64decode(by_field.parse().data[0].b64_json or ""),  # type: ignore[index]
                          credential.ca_pem.decode())
    assert signed.verdict == "trusted" and signed.generation is not None
    (recorded,) = signed.generation["loras"]
    name, short, te, unet = by_field.headers["x-sdserve-loras"].split(":")
    assert (recorded["name"], recorded["sha256"][:12], recorded["te_multiplier"], recorded["unet_multiplier"]) == (
        name, short, float(te), float(unet))
    field_px = _pixels(by_field.parse().data[0].b64_json or "")  # type: ignore[index]
    tag_px = _pixels(by_tag.parse().data[0].b64_json or "")  # type: ignore[index]
    assert np.array_equal(field_px, tag_px)
    plain, response = _generate(server)
    assert response.headers["x-sdserve-loras"] == "none"
    assert (np.abs(plain - field_px) > 2).mean() > 0.1
    recent = httpx.get(f"{server}/capabilities", timeout=30).json()["lora"]["recent_sets"]
    assert any(key.endswith(":0.5:0.5") for key in recent)


def test_two_concurrent_requests_with_different_sets_get_their_own_images(server: str) -> None:
    sets = {"style": [{"name": "style", "weight": 1.0}], "other": [{"name": "other", "weight": 1.0}], "none": []}
    alone = {name: _generate(server, loras=loras)[0] for name, loras in sets.items()}
    got: dict[str, list[np.ndarray]] = {name: [] for name in sets}
    errors: list[BaseException] = []
    start = threading.Barrier(len(sets) * 2)

    def worker(name: str) -> None:
        try:
            start.wait(timeout=60)
            got[name].append(_generate(server, loras=sets[name])[0])
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(name,)) for name in sets for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    for name, images in got.items():
        assert len(images) == 2
        assert all(np.array_equal(image, alone[name]) for image in images), f"{name}: another set leaked in"
    assert not np.array_equal(alone["style"], alone["other"])


@pytest.mark.parametrize(("name", "words"), [
    ("evil", ["pickle"]), ("truncated", ["truncated"]), ("huge_header", ["header"]),
    ("xl_on_sd1", ["text_encoder_2", "another model family"]), ("wrong_shape", ["640"]),
    ("linked", ["outside"]), ("../style", ["unknown LoRA"]), ("ghost", ["unknown LoRA", "style"])])
def test_hostile_or_unknown_loras_are_4xx_naming_the_problem(server: str, name: str, words: list[str]) -> None:
    field = httpx.post(f"{server}/v1/images/generations", json={**BODY, "prompt": PROMPT,
                                                               "loras": [{"name": name}]}, timeout=60)
    assert field.status_code == 400, field.text
    error = field.json()["error"]
    assert error["param"] == "loras.0.name"
    assert all(w in error["message"] for w in words), error["message"]
    tag = httpx.post(f"{server}/sdapi/v1/txt2img", json={"prompt": f"{PROMPT} <lora:{name}:1>", "width": 64,
                                                         "height": 64, "steps": 4}, timeout=60)
    assert tag.status_code == 422, tag.text
    assert "prompt" in tag.text and words[0] in tag.text


def test_malformed_tags_and_multipliers_are_refused_by_field(server: str) -> None:
    for prompt, words in ((f"{PROMPT} <lora:style:abc>", "not a multiplier"),
                          (f"{PROMPT} <lora:style:1e9>", "max_multiplier"),
                          (f"{PROMPT} <hypernet:x:1>", "hypernetwork")):
        response = httpx.post(f"{server}/v1/images/generations", json={**BODY, "prompt": prompt}, timeout=60)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "prompt" and words in response.json()["error"]["message"]


def test_refresh_lists_a_new_file_and_it_serves(server: str, folder: Path) -> None:
    (folder / "late.safetensors").write_bytes((folder / "style.safetensors").read_bytes())
    try:
        refreshed = {i["name"]: i for i in httpx.post(f"{server}/sdapi/v1/refresh-loras", timeout=60).json()}
        assert refreshed["late"]["problem"] is None
        assert refreshed["late"]["sha256"] == refreshed["style"]["sha256"]
        late, _ = _generate(server, loras=[{"name": "late", "weight": 0.7}])
        style, _ = _generate(server, loras=[{"name": "style", "weight": 0.7}])
        assert np.array_equal(late, style)  # the same bytes: the same set key, the same image
    finally:
        (folder / "late.safetensors").unlink()
        httpx.post(f"{server}/sdapi/v1/refresh-loras", timeout=60)
    gone = httpx.post(f"{server}/v1/images/generations", json={**BODY, "prompt": PROMPT,
                                                              "loras": [{"name": "late"}]}, timeout=60)
    assert gone.status_code == 400 and "unknown LoRA" in gone.text


def test_metrics_count_merges_and_cache_hits(server: str) -> None:
    _generate(server, loras=[{"name": "other", "weight": 0.3}])
    _generate(server, loras=[{"name": "other", "weight": 0.3}])
    text = httpx.get(f"{server}/metrics", timeout=30).text
    merges = _sample(text, "sdserve_lora_merges_total")
    hits = _sample(text, "sdserve_lora_cache_hits_total")
    assert merges >= 1 and hits >= 1
    assert _sample(text, "sdserve_lora_cache_bytes") > 0


def _sample(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")

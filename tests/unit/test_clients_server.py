"""What clients meet at the edge, on a fake engine: Basic auth beside Bearer keys (one digest store), the caller's
id reaching /sdapi/v1/interrupt, nothing silently ignored (model, quality, style, styles, override_settings),
/v1/models, HEAD probes, CORS, request ids, the access log, process metrics, the offline /docs page, the OpenAPI
document, the 504 the OpenAI SDK must not retry and the second-signal stop."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from openapi_spec_validator import validate

from server.app import create_app, stop_now
from server.cli.main import JsonFormatter
from server.settings import ApiSettings, AuthSettings, ServerSettings, Settings, load_settings
from tests.unit.fakes import TITLE, HashedEngine
from tests.unit.fakes import start as _start
from tests.unit.fakes import wait_for as _wait

GEN = "/v1/images/generations"
TXT2IMG = "/sdapi/v1/txt2img"
KEY = "sk-unit-key"
BASIC = ("alice", "s3cret:with:colons")


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _basic(user: str, password: str) -> dict[str, str]:
    return {"authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


BEARER = {"authorization": f"Bearer {KEY}"}


def _settings(**sections: Any) -> Settings:
    return load_settings("dev").model_copy(update=sections)


@pytest.fixture
def guarded(engine: HashedEngine) -> Iterator[TestClient]:
    auth = AuthSettings(api_key_sha256=(_sha(KEY), _sha(":".join(BASIC))))
    yield from _start(engine, _settings(auth=auth))


def test_basic_credentials_and_bearer_keys_share_one_digest_store(guarded: TestClient) -> None:
    assert guarded.get("/capabilities", headers=BEARER).status_code == 200
    assert guarded.get("/capabilities", headers=_basic(*BASIC)).status_code == 200
    for headers in ({}, _basic("alice", "wrong"), {"authorization": "Basic !!not-base64!!"},
                    {"authorization": "Basic " + base64.b64encode(b"no-colon").decode()},
                    {"authorization": "Basic " + base64.b64encode(b"\xff\xfe:x").decode()},
                    {"authorization": f"Digest {KEY}"}, {"authorization": "Bearer"}):
        refused = guarded.get("/capabilities", headers=headers)
        assert refused.status_code == 401, headers
        assert refused.headers.get_list("www-authenticate") == ['Bearer, Basic realm="sdserve", charset="UTF-8"']
        assert refused.json()["error"]["type"] == "authentication_error"
    assert guarded.get("/health").status_code == 200  # probes stay open


def _hold(client: TestClient, engine: HashedEngine, headers: dict[str, str]) -> tuple[threading.Thread, list[Any]]:
    """A txt2img whose batch is held after its first step (HashedEngine) until ``engine.release`` is set."""
    engine.release.clear()
    results: list[Any] = []
    worker = threading.Thread(target=lambda: results.append(
        client.post(TXT2IMG, json={"prompt": "held", "steps": 6}, headers=headers)))
    worker.start()
    assert engine.entered.wait(10)
    return worker, results


def test_interrupt_stops_only_the_callers_own_jobs(guarded: TestClient, engine: HashedEngine) -> None:
    worker, results = _hold(guarded, engine, _basic(*BASIC))
    try:
        other = guarded.post("/sdapi/v1/interrupt", headers=BEARER)  # another key: nothing of its own runs
        assert other.status_code == 200 and other.json()["running"] == 0
        assert other.headers["x-sdserve-interrupt"] == "idle"
        own = guarded.post("/sdapi/v1/interrupt", headers=_basic(*BASIC))
        assert own.json()["running"] == 1 and own.headers["x-sdserve-interrupt"] == "stopping"
    finally:
        engine.release.set()
        worker.join(10)
    assert json.loads(results[0].json()["info"])["interrupted"] is True


@pytest.mark.parametrize("model", [None, "fake", TITLE, "dall-e-2", "gpt-image-1"])
def test_served_names_and_profile_aliases_run_the_served_model_and_say_so(client: TestClient,
                                                                           model: str | None) -> None:
    body: dict[str, Any] = {"prompt": "a", "size": "64x64", "steps": 2} | ({"model": model} if model else {})
    response = client.post(GEN, json=body)
    assert response.status_code == 200, response.text
    assert response.headers["x-sdserve-model"] == "fake"


def test_an_unknown_model_is_a_400_naming_the_served_ids(client: TestClient) -> None:
    response = client.post(GEN, json={"prompt": "a", "model": "sd_xl_base_1.0"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "model" and "'sd_xl_base_1.0' is not served" in error["message"]
    assert "['fake']" in error["message"] and "'dall-e-2'" in error["message"]


def test_aliases_are_off_unless_the_profile_maps_them(engine: HashedEngine) -> None:
    for client in _start(engine, _settings(api=ApiSettings())):
        response = client.post(GEN, json={"prompt": "a", "model": "dall-e-2"})
        assert response.status_code == 400 and "aliases" not in response.json()["error"]["message"]
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["fake"]


def test_v1_models_lists_the_served_model_then_the_aliases(client: TestClient) -> None:
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["fake", "dall-e-2", "dall-e-3", "gpt-image-1", "gpt-image-1-mini",
                                               "gpt-image-1.5"]
    for entry in body["data"]:
        assert entry["object"] == "model" and entry["owned_by"] == "sdserve" and isinstance(entry["created"], int)
    assert {m["parent"] for m in body["data"][1:]} == {"fake"}


@pytest.mark.parametrize(("extra", "steps"), [({"quality": "hd"}, 40), ({"quality": "standard"}, 20),
                                              ({"quality": "auto"}, 20), ({"quality": "auto", "steps": 3}, 3),
                                              ({"quality": "high"}, 40), ({"quality": "medium"}, 20),
                                              ({"quality": "low"}, 10)])
def test_quality_maps_to_the_profiles_steps(client: TestClient, engine: HashedEngine, extra: dict[str, Any],
                                            steps: int) -> None:
    assert client.post(GEN, json={"prompt": "q", "size": "64x64", **extra}).status_code == 200
    assert engine.batches[-1].steps == steps


@pytest.mark.parametrize(("extra", "param", "fragment"), [
    ({"quality": "ultra"}, "quality", "supported: ['auto', 'standard', 'hd', 'low', 'medium', 'high']"),
    ({"quality": "hd", "steps": 5}, "quality", "give one of them"),
    ({"style": "cinematic"}, "style", "'vivid' or 'natural'"),
    ({"background": "transparent"}, "background", "images are opaque"),
    ({"output_format": "gif"}, "output_format", "'png', 'jpeg' or 'webp'"),
    ({"output_compression": 101}, "output_compression", "less than or equal to 100"),
])
def test_unmapped_openai_fields_are_400_naming_the_field(client: TestClient, extra: dict[str, Any], param: str,
                                                         fragment: str) -> None:
    response = client.post(GEN, json={"prompt": "q", **extra})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param and fragment in response.json()["error"]["message"]


def test_a_quality_over_the_step_limit_is_a_400_not_a_clamp(engine: HashedEngine) -> None:
    settings = _settings(limits=load_settings("dev").limits.model_copy(update={"max_steps": 30}))
    for client in _start(engine, settings):
        response = client.post(GEN, json={"prompt": "q", "quality": "hd"})
        assert response.status_code == 400 and response.json()["error"]["param"] == "quality"
        assert "40 steps, over this server's limit of 30" in response.json()["error"]["message"]


def test_size_auto_is_the_models_native_size(client: TestClient, engine: HashedEngine) -> None:
    assert client.post(GEN, json={"prompt": "q", "size": "auto", "steps": 2}).status_code == 200
    assert (engine.batches[-1].width, engine.batches[-1].height) == (64, 64)  # the fake's native size


@pytest.mark.parametrize(("extra", "loc", "fragment"), [
    ({"styles": ["cinematic"]}, "styles", "unknown style 'cinematic'"),
    ({"override_settings": {"sd_model_checkpoint": "v1-5-pruned.safetensors"}},
     "override_settings.sd_model_checkpoint", f"serves only {TITLE!r}"),
    ({"override_settings": {"CLIP_stop_at_last_layers": 2}}, "override_settings.CLIP_stop_at_last_layers",
     "clip skip 1"),
])
def test_a1111_styles_and_overrides_are_refused_not_ignored(client: TestClient, extra: dict[str, Any], loc: str,
                                                            fragment: str) -> None:
    response = client.post(TXT2IMG, json={"prompt": "x", "steps": 2, **extra})
    assert response.status_code == 422, response.text
    detail = response.json()["detail"][0]
    assert detail["loc"] == ["body", *loc.split(".")] and fragment in detail["msg"]


@pytest.mark.parametrize("extra", [
    {"styles": [], "override_settings": {"sd_model_checkpoint": TITLE}},  # webuiapi's defaults + our checkpoint
    {"override_settings": {"CLIP_stop_at_last_layers": 1}, "clip_skip": 1, "save_images": True,
     "hr_additional_modules": []},  # SillyTavern's generateAutoImage with its default clip skip and no VAE
])
def test_a1111_overrides_that_match_what_is_served_pass(client: TestClient, extra: dict[str, Any]) -> None:
    body = {"prompt": "x", "steps": 2, "override_settings_restore_afterwards": True, **extra}
    response = client.post(TXT2IMG, json=body)
    assert response.status_code == 200 and response.headers["x-sdserve-model"] == "fake"


def test_head_probes_answer_the_status_without_a_body(client: TestClient) -> None:
    for path in ("/health", "/ready"):
        response = client.head(path)
        assert response.status_code == 200 and response.content == b""


def test_cors_is_off_by_default(client: TestClient) -> None:
    preflight = client.options(GEN, headers={"origin": "https://chat.example.com",
                                             "access-control-request-method": "POST"})
    assert "access-control-allow-origin" not in preflight.headers and preflight.status_code == 405
    assert "access-control-allow-origin" not in client.get("/health", headers={"origin": "https://x.org"}).headers


def test_cors_allows_the_configured_origins_only(engine: HashedEngine) -> None:
    origin = "https://chat.example.com"
    for client in _start(engine, _settings(server=ServerSettings(cors_origins=(origin,)))):
        preflight = client.options(GEN, headers={"origin": origin, "access-control-request-method": "POST",
                                                 "access-control-request-headers": "authorization, content-type"})
        assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == origin
        assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
        refused = client.options(GEN, headers={"origin": "https://evil.example", "access-control-request-method":
                                               "POST"})
        assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
        simple = client.post(GEN, json={"prompt": "c", "size": "64x64", "steps": 2}, headers={"origin": origin})
        assert simple.headers["access-control-allow-origin"] == origin
        assert "x-sdserve-model" in simple.headers["access-control-expose-headers"]
        exposed = {h.strip() for h in simple.headers["access-control-expose-headers"].split(",")}
        carried = {h for h in simple.headers if h.startswith("x-sdserve-")}
        assert carried and carried <= exposed  # a browser can read every x-sdserve-* header this response carries


def test_every_response_header_sdserve_names_is_exposed_to_browsers() -> None:
    """server/headers.py names each header once; CORS exposes RESPONSE, which must hold every header but the
    request-only ones (before, x-sdserve-loras, -provenance and -watermark were missing: browsers could not read
    which LoRA applied or the provenance manifest)."""
    from server import headers
    from server.app import EXPOSED_HEADERS

    names = {v for k, v in vars(headers).items() if k.isupper() and isinstance(v, str)}
    request_only = {headers.TIMEOUT}
    assert names - request_only == set(headers.RESPONSE) == set(EXPOSED_HEADERS)
    assert {"x-sdserve-loras", "x-sdserve-provenance", "x-sdserve-watermark"} <= set(EXPOSED_HEADERS)


@pytest.mark.parametrize(("sent", "kept"), [("req-1:AbC/xyz=", True), ("a" * 128, True), ("a" * 129, False),
                                            ("has space", False), ("", False), ("tab\tid", False)])
def test_request_ids_are_kept_when_bounded_and_printable(client: TestClient, sent: str, kept: bool) -> None:
    got = client.get("/health", headers={"x-request-id": sent}).headers["x-request-id"]
    assert (got == sent) is kept
    if not kept:
        assert len(got) == 16 and int(got, 16) >= 0


def _access(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [r.access for r in caplog.records if r.name == "sdserve.access"]  # type: ignore[attr-defined]


def test_one_access_line_per_request_never_the_prompt(client: TestClient, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="sdserve.access")
    response = client.post(GEN, json={"prompt": "a private lighthouse", "size": "64x64", "steps": 2},
                           headers={"user-agent": "unit/1"})
    client.get("/health?probe=1")
    lines = _access(caplog)
    assert len(lines) == 2
    first = lines[0]
    assert first["request_id"] == response.headers["x-request-id"] and first["status"] == 200
    assert (first["method"], first["path"], first["route"], first["user_agent"]) == ("POST", GEN, GEN, "unit/1")
    assert first["duration_ms"] >= 0 and first["key_id"] is None and "prompt" not in first
    assert lines[1]["path"] == "/health"  # never the query string
    assert "private lighthouse" not in caplog.text and "probe=1" not in caplog.text
    record = next(r for r in caplog.records if r.name == "sdserve.access")
    assert json.loads(JsonFormatter().format(record))["status"] == 200  # --log-format json: one object per line


def test_prompts_are_logged_only_when_the_profile_says_so(guarded: TestClient, engine: HashedEngine,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="sdserve.access")
    guarded.post(GEN, json={"prompt": "a", "size": "64x64", "steps": 2}, headers=BEARER)
    assert _access(caplog)[-1]["key_id"] == _sha(KEY)[:8] and "prompt" not in _access(caplog)[-1]
    settings = _settings(server=ServerSettings(log_prompts=True))
    for client in _start(HashedEngine(), settings):
        client.post(GEN, json={"prompt": "a logged castle", "size": "64x64", "steps": 2})
    assert _access(caplog)[-1]["prompt"] == "a logged castle"


def test_metrics_carry_process_series(client: TestClient) -> None:
    text = client.get("/metrics").text
    assert "process_resident_memory_bytes" in text and "process_open_fds" in text and "python_info" in text


def test_docs_page_is_self_contained(client: TestClient) -> None:
    page = client.get("/docs")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "<script" not in page.text and "cdn" not in page.text.lower() and "https://" not in page.text
    assert "POST /v1/images/generations" in page.text and "504" in page.text
    assert client.get("/redoc").status_code == 404


def test_openapi_is_valid_and_lists_the_real_errors_and_security(guarded: TestClient) -> None:
    spec = guarded.get("/openapi.json", headers=BEARER).json()
    validate(spec)
    assert spec["components"]["securitySchemes"] == {
        "bearerAuth": {"type": "http", "scheme": "bearer", "description": spec["components"]["securitySchemes"]
                       ["bearerAuth"]["description"]},
        "basicAuth": {"type": "http", "scheme": "basic", "description": spec["components"]["securitySchemes"]
                      ["basicAuth"]["description"]}}
    generation = spec["paths"][GEN]["post"]
    assert {"400", "401", "413", "429", "500", "503", "504"} <= set(generation["responses"])
    assert generation["security"] == [{"bearerAuth": []}, {"basicAuth": []}]
    assert {"401", "413", "422", "429", "503", "504"} <= set(spec["paths"][TXT2IMG]["post"]["responses"])
    assert {"401", "413", "422"} <= set(spec["paths"]["/sdapi/v1/options"]["post"]["responses"])
    assert spec["paths"]["/health"]["get"]["security"] == [] and "401" not in spec["paths"]["/health"]["get"][
        "responses"]
    assert "head" in spec["paths"]["/ready"]


def test_a_request_past_its_deadline_is_504_with_do_not_retry(client: TestClient, engine: HashedEngine) -> None:
    worker, results = _hold(client, engine, {})
    try:
        late = client.post(GEN, json={"prompt": "late", "size": "64x64", "steps": 3},
                           headers={"x-sdserve-timeout-s": "0.3"})
    finally:
        engine.release.set()
        worker.join(10)
    assert late.status_code == 504 and late.headers["x-should-retry"] == "false"
    assert results[0].status_code == 200


def test_stop_now_answers_every_waiting_request_503_then_closes_the_engine(engine: HashedEngine) -> None:
    app = create_app(engine, load_settings("dev"))
    with TestClient(app) as client:
        _wait(client, "/ready", lambda r: r.status_code == 200)
        worker, results = _hold(client, engine, {})
        queued: list[Any] = []
        other = threading.Thread(target=lambda: queued.append(client.post(GEN, json={"prompt": "q", "steps": 9})))
        other.start()
        _wait(client, "/sdapi/v1/progress", lambda r: r.json()["state"]["job_count"] == 2)
        stop_now(app)
        other.join(10)
        worker.join(10)
        assert [r.status_code for r in (*results, *queued)] == [503, 503]
        assert "retry it" in queued[0].json()["error"]["message"]
        assert client.get("/ready").json()["state"] == "draining"
        engine.release.set()  # the interrupted batch returns at its next step boundary
    assert engine.closed  # closed only after the batch returned (the lifespan waited for it)

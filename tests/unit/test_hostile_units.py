"""Hostile input on the HTTP layer (fake engine): no 500 from client input, a sanitized 500 that closes the
connection for our own failures, strict JSON and types, the body cap on chunked bodies, nothing internal in the
unauthenticated bodies; the bounded URL store, the log rate limit, the model-file integrity watcher."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from engines.artifacts import sha256_file
from engines.errors import ArtifactError, NotReadyError
from engines.health.integrity import IntegrityWatcher
from engines.types.request import BatchResult
from server.app import create_app
from server.errors import BindError
from server.exitcodes import ExitCode, exit_code_for
from server.images import ImageStore
from server.launcher import RepeatFilter, bind
from server.middleware import Message, Receive, Scope, Send
from server.settings import Settings, load_settings
from server.state import public_reason
from server.strict_json import MAX_OBJECT_KEYS, OFF_LOOP_BYTES, StrictJsonMiddleware, strict_loads
from tests.unit.fakes import FakeEngine

GEN, A1111 = "/v1/images/generations", "/sdapi/v1/txt2img"
JSON = {"content-type": "application/json"}


def _wait_ready(client: TestClient, want: str = "ready") -> dict[str, Any]:
    deadline = time.monotonic() + 10
    body: dict[str, Any] = {}
    while time.monotonic() < deadline:
        body = client.get("/ready").json()
        if body["state"] == want:
            return body
        time.sleep(0.02)
    raise AssertionError(f"state never became {want}: {body}")


def _settings(**server: object) -> Settings:
    data = load_settings("dev").model_dump()
    data["server"].update(server)
    return Settings.model_validate(data)


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def client(engine: FakeEngine) -> Iterator[TestClient]:
    with TestClient(create_app(engine, load_settings("dev"))) as c:
        _wait_ready(c)
        yield c


class Exploding(FakeEngine):
    def generate(self, *args: Any, **kwargs: Any) -> BatchResult:
        raise RuntimeError("boom at /srv/secret/weights.onnx")


def test_unexpected_exception_is_a_sanitized_500_that_closes_the_connection() -> None:
    with TestClient(create_app(Exploding(), load_settings("dev"))) as c:
        _wait_ready(c)
        response = c.post(GEN, json={"prompt": "a", "size": "64x64"}, headers={"x-request-id": "probe-1"})
    assert response.status_code == 500
    assert response.headers["connection"] == "close"
    assert response.headers["x-request-id"] == "probe-1"
    text = response.text
    assert "probe-1" in text and "RuntimeError" not in text and "/srv" not in text and "Traceback" not in text


def test_every_response_carries_a_request_id_and_a_forged_one_is_replaced(client: TestClient) -> None:
    assert len(client.get("/health").headers["x-request-id"]) == 16
    forged = client.get("/health", headers={"x-request-id": "a\tb" + "x" * 100})
    assert forged.headers["x-request-id"] != "a\tb" + "x" * 100 and len(forged.headers["x-request-id"]) == 16


@pytest.mark.parametrize("path", [GEN, A1111])
@pytest.mark.parametrize("field", ["prompt", "negative_prompt"])
def test_lone_surrogate_is_a_4xx_naming_the_field(client: TestClient, path: str, field: str) -> None:
    body = {"prompt": "a", "size": "64x64"} if path == GEN else {"prompt": "a", "width": 64, "height": 64}
    raw = json.dumps(body)[:-1] + f', "{field}": "\\ud800x"}}'
    if field == "prompt":
        raw = raw.replace('"prompt": "a", ', "")
    response = client.post(path, content=raw, headers=JSON)
    assert response.status_code == (400 if path == GEN else 422), response.text
    assert field in response.text and "surrogate" in response.text


def test_blank_prompt_on_a1111_is_422(client: TestClient) -> None:
    response = client.post(A1111, json={"prompt": "   ", "width": 64, "height": 64})
    assert response.status_code == 422 and response.json()["detail"][0]["loc"] == ["body", "prompt"]


def test_a1111_top_seed_with_n_iter_wraps_instead_of_overflowing(client: TestClient) -> None:
    response = client.post(A1111, json={"prompt": "a", "seed": 2**32 - 1, "n_iter": 2, "width": 64, "height": 64})
    assert response.status_code == 200, response.text
    assert json.loads(response.json()["info"])["all_seeds"] == [2**32 - 1, 0]


@pytest.mark.parametrize(("raw", "fragment"), [
    ('{"prompt": "a", "steps": true}', "steps"),
    ('{"prompt": "a", "n": "2"}', "n"),
    ('{"prompt": "a", "seed": 1.0}', "seed"),
    ('{"prompt": 5}', "prompt"),
    ('{"prompt": "a", "size": "\uff16\uff14x64"}', "size"),
    ('{"prompt": "a", "size": "\u0666\u0664x64"}', "size"),
    ('{"prompt": "a", "prompt": "b"}', "duplicate key"),
    ('{"prompt": "a", "guidance_scale": NaN}', "NaN"),
    ('{"prompt": "a", "seed": ' + "1" * 5000 + "}", "longer than 32"),
    ('{"prompt": "a", "size": "' + "1" * 5000 + 'x64"}', "size"),
])
def test_lax_types_and_json_are_refused_with_400(client: TestClient, raw: str, fragment: str) -> None:
    response = client.post(GEN, content=raw.encode(), headers=JSON)
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert fragment in message and "int_max_str_digits" not in message and "Exceeds the limit" not in message


@pytest.mark.parametrize(("path", "status"), [(GEN, 400), (A1111, 422)])
def test_deeply_nested_or_undecodable_json_is_refused_not_500(client: TestClient, path: str, status: int) -> None:
    deep = client.post(path, content=b"[" * 100_000 + b"]" * 100_000, headers=JSON)
    assert deep.status_code == status and "nested too deeply" in deep.text
    undecodable = client.post(path, content=b'{"prompt": "\xff\xfe"}', headers=JSON)
    assert undecodable.status_code == status and "not valid JSON" in undecodable.text


def test_a1111_duplicate_keys_and_bool_steps_are_422(client: TestClient) -> None:
    dup = client.post(A1111, content=b'{"prompt": "a", "steps": 2, "steps": 3}', headers=JSON)
    assert dup.status_code == 422 and dup.json()["detail"][0]["loc"] == ["body", "steps"]
    assert client.post(A1111, json={"prompt": "a", "steps": True}).status_code == 422


def test_integers_are_accepted_for_float_fields(client: TestClient) -> None:
    assert client.post(GEN, json={"prompt": "a", "size": "64x64", "guidance_scale": 7}).status_code == 200


def test_chunked_body_over_the_cap_is_413_not_400(client: TestClient) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"a" * 65536
        yield b'"}'

    response = client.post(GEN, content=chunks(), headers=JSON)
    assert response.status_code == 413, response.text


def test_strict_loads_keeps_nested_surrogates_and_duplicates_out() -> None:
    assert strict_loads(b'{"a": [1, 2.5, {"b": "\\ud83d\\ude00"}]}') == {"a": [1, 2.5, {"b": "\U0001f600"}]}
    with pytest.raises(Exception, match="alwayson_scripts.x: contains an unpaired"):
        strict_loads(b'{"alwayson_scripts": {"x": ["\\udc00"]}}')
    with pytest.raises(Exception, match="x: duplicate key"):
        strict_loads(b'{"o": {"x": 1, "x": 2}}')


URL_BODY = {"prompt": "a", "size": "64x64", "response_format": "url"}


@pytest.mark.parametrize("host", ["evil.example", "localhost.evil.example", "127.0.0.1@evil.example",
                                  "evil.example/127.0.0.1", "[::1].evil", "localhost:80:80", ""])
def test_a_spoofed_host_gets_no_link_built_from_it(host: str) -> None:
    with TestClient(create_app(FakeEngine(), load_settings("dev"))) as c:
        _wait_ready(c)
        response = c.post(GEN, json=URL_BODY, headers={"host": host})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "response_format" and "public_base_url" in error["message"]
        assert "evil" not in response.headers.get("location", "")
        assert c.post(GEN, json={**URL_BODY, "response_format": "b64_json"}, headers={"host": host}).status_code \
            == 200  # only a link needs a Host


@pytest.mark.parametrize(("host", "scheme"), [("localhost:8000", "http"), ("127.0.0.1", "http"),
                                              ("[::1]:9", "http"), ("LOCALHOST:1", "http")])
def test_an_allowed_host_gets_an_absolute_link_that_serves_the_image(host: str, scheme: str) -> None:
    with TestClient(create_app(FakeEngine(), load_settings("dev"))) as c:
        _wait_ready(c)
        url = c.post(GEN, json=URL_BODY, headers={"host": host}).json()["data"][0]["url"]
        assert url.startswith(f"{scheme}://{host}/v1/images/files/") and url.endswith(".png")
        assert c.get(url.removeprefix(f"{scheme}://{host}")).content.startswith(b"\x89PNG")


def test_allowed_hosts_replace_the_default_and_public_base_url_wins_over_any_host() -> None:
    with TestClient(create_app(FakeEngine(), _settings(allowed_hosts=("images.internal",)))) as c:
        _wait_ready(c)
        url = c.post(GEN, json=URL_BODY, headers={"host": "images.internal:8080"}).json()["data"][0]["url"]
        assert url.startswith("http://images.internal:8080/v1/images/files/")
        assert c.post(GEN, json=URL_BODY, headers={"host": "localhost"}).status_code == 400  # not listed now
    with TestClient(create_app(FakeEngine(), _settings(public_base_url="https://img.example.com/"))) as c:
        _wait_ready(c)
        url = c.post(GEN, json=URL_BODY, headers={"host": "evil.example"}).json()["data"][0]["url"]
    assert url.startswith("https://img.example.com/v1/images/files/")


@pytest.mark.parametrize("name", ["host:80", "a/b", "*", "", "exa mple", "ü.example"])
def test_allowed_hosts_entries_must_be_plain_names(name: str) -> None:
    with pytest.raises(ValueError, match="allowed_hosts"):
        _settings(allowed_hosts=(name,))


def test_public_base_url_must_be_plain_http() -> None:
    for bad in ("ftp://x", "https://x/?a=1", "https://x/#f", "javascript:alert(1)"):
        with pytest.raises(ValueError, match="public_base_url"):
            _settings(public_base_url=bad)


def test_ready_and_503_bodies_hide_paths_and_class_names_capabilities_keep_them() -> None:
    failing = FakeEngine(fail_load=ArtifactError("model folder /srv/models/sd15 does not match its manifest: "
                                                 "unet/model.onnx: missing"))
    with TestClient(create_app(failing, load_settings("dev"))) as c:
        body = _wait_ready(c, "failed")
        assert body["codes"] == ["artifact_invalid"]
        assert "/srv" not in json.dumps(body) and "unet/model.onnx: missing" in body["reasons"][0]
        refused = c.post(GEN, json={"prompt": "a"})
        assert refused.status_code == 503 and "/srv" not in refused.text
        assert "/srv/models/sd15" in json.dumps(c.get("/capabilities").json()["server"])
    with TestClient(create_app(FakeEngine(fail_load=KeyError("tokenizer.json")), load_settings("dev"))) as c:
        body = _wait_ready(c, "failed")
        assert "KeyError" not in json.dumps(body) and body["codes"] == ["internal"]
        assert "KeyError" in json.dumps(c.get("/capabilities").json()["server"])


def test_public_reason_redacts_absolute_paths_only() -> None:
    text = "model folder /a/b/c does not match: unet/model.onnx: 1/2 at http://x/y"
    assert public_reason(text) == "model folder <path> does not match: unet/model.onnx: 1/2 at http://x/y"
    assert len(public_reason("x" * 1000)) == 300


def test_image_store_is_bounded_by_bytes_keeping_the_newest() -> None:
    store = ImageStore(max_items=100, max_bytes=1000)
    ids = [store.put(b"x" * 300) for _ in range(5)]
    assert len(store) == 3 and store.bytes == 900
    assert store.get(ids[-1]) == b"x" * 300
    big = store.put(b"y" * 5000)
    assert len(store) == 1 and store.get(big) == b"y" * 5000


def test_repeated_log_lines_are_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("test.repeat")
    repeat = RepeatFilter(interval_s=3600)
    logger.addFilter(repeat)
    try:
        with caplog.at_level(logging.ERROR, logger="test.repeat"):
            for _ in range(1000):
                logger.error("socket.accept() out of system resource")
            logger.error("another message")
        assert [r.getMessage() for r in caplog.records] == ["socket.accept() out of system resource",
                                                            "another message"]
        repeat.interval_s = 0
        with caplog.at_level(logging.ERROR, logger="test.repeat"):
            logger.error("socket.accept() out of system resource")
        assert "[999 more like this" in caplog.records[-1].getMessage()
    finally:
        logger.removeFilter(repeat)


def test_port_in_use_is_bind_error_exit_12() -> None:
    taken = bind("127.0.0.1", 0)
    taken.listen()
    try:
        with pytest.raises(BindError, match="cannot bind 127.0.0.1") as info:
            bind("127.0.0.1", taken.getsockname()[1])
        assert exit_code_for(info.value) == ExitCode.CANNOT_BIND and int(ExitCode.CANNOT_BIND) == 12
    finally:
        taken.close()


def _model(folder: Path) -> Path:
    (folder / "unet").mkdir(parents=True)
    (folder / "unet" / "model.onnx").write_bytes(b"weights")
    manifest = {"format": 2, "files": {"unet/model.onnx": {"sha256": sha256_file(folder / "unet" / "model.onnx"),
                                                            "bytes": 7}}}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def test_integrity_watcher_names_changed_files_and_recovers(tmp_path: Path) -> None:
    model = _model(tmp_path / "m")
    watcher = IntegrityWatcher(model)
    assert [w.rel for w in watcher.files] == ["manifest.json", "unet/model.onnx"]
    watcher.check()
    weights = model / "unet" / "model.onnx"
    weights.write_bytes(b"weights")  # rewritten, same bytes: the stat changes, the hash does not
    watcher.check()
    weights.write_bytes(b"tampered")
    with pytest.raises(NotReadyError, match=r"model file unet/model.onnx changed on disk since boot") as info:
        watcher.check()
    assert str(tmp_path) not in str(info.value)
    weights.write_bytes(b"weights")
    watcher.check()
    (model / "manifest.json").unlink()
    with pytest.raises(NotReadyError, match="model file manifest.json is missing"):
        watcher.check()


def test_integrity_watcher_without_manifest_watches_nothing(tmp_path: Path) -> None:
    assert IntegrityWatcher(tmp_path).files == []
    IntegrityWatcher(tmp_path).check()


class Tampered(FakeEngine):
    def __init__(self) -> None:
        super().__init__()
        self.changed = False

    def check_health(self) -> None:
        if self.changed:
            raise NotReadyError("model file unet/model.onnx changed on disk since boot")


def test_watchdog_degrades_on_a_changed_file_then_recovers() -> None:
    import asyncio

    engine = Tampered()
    app = create_app(engine, load_settings("dev"))
    with TestClient(app) as c:
        _wait_ready(c)
        watchdog = app.state.watchdog
        engine.changed = True
        asyncio.run(watchdog.check())
        body = c.get("/ready").json()
        assert body["state"] == "degraded" and body["codes"] == ["model_files"]
        assert "unet/model.onnx" in body["reasons"][0]
        assert c.post(GEN, json={"prompt": "a", "size": "64x64"}).status_code == 503
        engine.changed = False
        for _ in range(load_settings("dev").watchdog.recover_after):
            asyncio.run(watchdog.check())
        assert c.get("/ready").json()["state"] == "ready"


def _post_through_strict_json(body: bytes) -> int:
    """One POST through StrictJsonMiddleware alone (no TestClient: its portal thread makes garbage of its own)."""
    statuses: list[int] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        raise AssertionError("a refused body must not reach the app")

    async def receive() -> Message:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            statuses.append(int(message["status"]))

    scope: Scope = {"type": "http", "method": "POST", "path": GEN, "headers": [(b"content-type", b"application/json")],
                    "state": {}}
    asyncio.run(StrictJsonMiddleware(app)(scope, receive, send))
    return statuses[0]


def test_refused_many_key_bodies_leave_nothing_for_the_cyclic_gc() -> None:
    """Issue 32's leak: a >64 KiB body (parsed in the threadpool) with over MAX_OBJECT_KEYS keys was refused with
    its key pairs held in a reference cycle (traceback -> parser frames), ~14 MB a request until a full collection.
    With collection off, what the collector finds afterwards must be far below one body's worth of pairs."""
    keys = MAX_OBJECT_KEYS + 500
    body = json.dumps({f"k{i}": "x" * 60 for i in range(keys)}).encode()
    assert len(body) >= OFF_LOOP_BYTES  # the threadpool path, where the cycle formed
    assert _post_through_strict_json(body) == 400  # warm-up: imports, the threadpool
    gc.collect()
    gc.disable()
    try:
        statuses = [_post_through_strict_json(body) for _ in range(20)]
        found = gc.collect()
    finally:
        gc.enable()
    assert statuses == [400] * 20
    assert found < keys, f"{found} objects were left for the cyclic GC after 20 refused bodies of {keys} keys"

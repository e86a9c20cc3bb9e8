"""Operating a real `sdserve serve`: webuiapi with HTTP Basic auth (A1111's --api-auth user:pass), JSON log lines
with one access line per request and no prompt, HEAD probes, process metrics, a valid OpenAPI document listing the
real errors, the offline /docs page, and the documented shutdown: the first SIGTERM drains, the second stops at once
with a 503 for every request in flight and exit code 0."""

from __future__ import annotations

import hashlib
import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import webuiapi
from openapi_spec_validator import validate

from tests.e2e.conftest import ServerProcess, dev_config

USER, PASSWORD = "operator", "correct horse:battery"
BASIC = (USER, PASSWORD)


class JsonLogServer(ServerProcess):
    """A server started with SDSERVE_LOG_FORMAT=json: every stderr line is a JSON object."""

    def __init__(self, *args: str, env: dict[str, str]) -> None:
        super().__init__(*args, env={**env, "SDSERVE_LOG_FORMAT": "json"})

    def _pump(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            message = json.loads(line).get("message", "") if line.startswith("{") else ""
            if message.startswith("sdserve listening on "):
                self.url = message.removeprefix("sdserve listening on ")
                self._found.set()

    def records(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.lines]


@pytest.fixture(scope="module")
def guarded(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[JsonLogServer]:
    config = dev_config(tmp_path_factory.mktemp("basic"))
    digest = hashlib.sha256(f"{USER}:{PASSWORD}".encode()).hexdigest()  # printf %s 'user:pass' | sha256sum
    server = JsonLogServer("--config", str(config), "--model", str(tiny_model),
                           env={"SDSERVE_API_KEYS_SHA256": digest})
    try:
        server.wait_ready()
        yield server
    finally:
        assert server.stop() == 0, server.log


@pytest.fixture
def api(guarded: JsonLogServer) -> Iterator[webuiapi.WebUIApi]:
    assert guarded.url is not None
    host, port = guarded.url.removeprefix("http://").split(":")
    client = webuiapi.WebUIApi(host=host, port=int(port), sampler="Euler", steps=2)
    yield client
    client.session.close()


def test_webuiapi_with_basic_auth_generates_and_without_it_is_refused(api: webuiapi.WebUIApi) -> None:
    with pytest.raises(RuntimeError, match="401"):
        api.txt2img(prompt="no credentials", width=64, height=64)
    api.set_auth(*BASIC)
    result = api.txt2img(prompt="a secret lighthouse", width=64, height=48, seed=3)
    assert [image.size for image in result.images] == [(64, 48)] and result.info["all_seeds"] == [3]
    assert api.get_sd_models()[0]["model_name"]
    assert api.interrupt()["running"] == 0  # nothing of this caller's is running
    api.set_auth(USER, "wrong")
    with pytest.raises(RuntimeError, match="401"):
        api.txt2img(prompt="wrong password", width=64, height=64)


def test_json_logs_have_one_access_line_per_request_and_no_prompt(guarded: JsonLogServer) -> None:
    url = guarded.url
    sent = httpx.post(f"{url}/sdapi/v1/txt2img", auth=BASIC, json={"prompt": "a hidden harbour", "steps": 2,
                                                                   "width": 64, "height": 64},
                      headers={"x-request-id": "e2e-trace-42"}, timeout=60)
    assert sent.status_code == 200 and sent.headers["x-request-id"] == "e2e-trace-42"
    deadline = time.monotonic() + 10
    while not [r for r in guarded.records() if r.get("request_id") == "e2e-trace-42"]:
        assert time.monotonic() < deadline, "no access line for the request"
        time.sleep(0.02)
    records = guarded.records()  # every line parses as JSON
    access = [r for r in records if r.get("request_id") == "e2e-trace-42"]
    assert len(access) == 1 and access[0]["logger"] == "sdserve.access"
    line = access[0]
    assert (line["method"], line["route"], line["status"]) == ("POST", "/sdapi/v1/txt2img", 200)
    assert line["key_id"] == hashlib.sha256(f"{USER}:{PASSWORD}".encode()).hexdigest()[:8]
    assert "hidden harbour" not in guarded.log and PASSWORD not in guarded.log


def test_head_probes_and_process_metrics_need_no_credentials(guarded: JsonLogServer) -> None:
    for probe in ("/health", "/ready"):
        response = httpx.head(f"{guarded.url}{probe}")
        assert response.status_code == 200 and response.content == b""
    metrics = httpx.get(f"{guarded.url}/metrics").text
    assert "process_cpu_seconds_total" in metrics and "process_resident_memory_bytes" in metrics


def test_openapi_is_valid_and_docs_work_offline(guarded: JsonLogServer) -> None:
    assert httpx.get(f"{guarded.url}/openapi.json").status_code == 401
    spec = httpx.get(f"{guarded.url}/openapi.json", auth=BASIC).json()
    validate(spec)
    for path, method, statuses in (("/v1/images/generations", "post", {"400", "401", "413", "429", "503", "504"}),
                                   ("/sdapi/v1/txt2img", "post", {"401", "413", "422", "429", "503", "504"})):
        assert statuses <= set(spec["paths"][path][method]["responses"]), path
    assert set(spec["components"]["securitySchemes"]) == {"bearerAuth", "basicAuth"}
    page = httpx.get(f"{guarded.url}/docs", auth=BASIC)
    assert page.status_code == 200 and "<script" not in page.text and "POST /sdapi/v1/txt2img" in page.text


def _wait_log(server: ServerProcess, text: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while text not in server.log:
        assert time.monotonic() < deadline, f"{text!r} never logged:\n{server.log}"
        time.sleep(0.02)


def test_second_signal_stops_at_once_with_503_for_every_request_in_flight(tiny_model: Path, tmp_path: Path) -> None:
    config = dev_config(tmp_path, replace={"drain_timeout_s = 10": "drain_timeout_s = 120"})
    server = ServerProcess("--config", str(config), "--model", str(tiny_model))
    url = server.wait_ready()
    assert httpx.put(f"{url}/debug/faults", json={"latency_s": 4.0}).status_code == 200
    answers: list[httpx.Response] = []
    posts = [threading.Thread(target=lambda steps=steps: answers.append(httpx.post(
        f"{url}/v1/images/generations", json={"prompt": "p", "size": "64x64", "steps": steps}, timeout=120)))
        for steps in (2, 3, 4)]  # different steps: one runs, two wait in the queue
    for post in posts:
        post.start()
    deadline = time.monotonic() + 30
    while httpx.get(f"{url}/sdapi/v1/progress").json()["state"]["job_count"] < 3:
        assert time.monotonic() < deadline, "the requests never queued"
        time.sleep(0.02)
    server.proc.send_signal(signal.SIGTERM)
    _wait_log(server, "SIGTERM: draining began")
    assert httpx.get(f"{url}/ready").json()["state"] == "draining"
    started = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    for post in posts:
        post.join(30)
    answered = time.monotonic() - started
    assert sorted(r.status_code for r in answers) == [503, 503, 503], server.log
    assert all("retry it" in r.json()["error"]["message"] and r.headers["retry-after"] for r in answers)
    assert answered < 3, f"the 503s took {answered:.1f}s"  # at once, not after the 4 s batch
    assert server.proc.wait(timeout=60) == 0, server.log  # exits by itself once the running batch returned
    assert server.stop() == 0
    assert "SIGTERM again: stopping now" in server.log
    for crash in ("Traceback", "terminate called", "Fatal Python error", "Aborted", "exiting without closing"):
        assert crash not in server.log, server.log

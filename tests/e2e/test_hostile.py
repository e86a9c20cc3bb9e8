"""Hostile clients against real `sdserve serve` processes: bad input never costs the next request, an idle-connection
flood cannot starve the probes, a trickling client cannot stretch shutdown, a model file changed under the server
degrades /ready, forged Host headers are ignored, and each startup failure has its documented exit code."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from tests.e2e.conftest import FAST_WATCHDOG, ServerProcess, dev_config
from tests.unit.test_images_in import raw_png, scan_bomb

GEN, A1111 = "/v1/images/generations", "/sdapi/v1/txt2img"
OK_BODY = {"prompt": "a kite", "size": "64x64", "steps": 2}
HEADER_TIMEOUT_S = 1.5
WRITE_TIMEOUT_S = 3.0
CAP = 64
BOUNDS = {"max_connections = 1000": f"max_connections = {CAP}",
          "header_timeout_s = 10.0": f"header_timeout_s = {HEADER_TIMEOUT_S}\nwrite_timeout_s = {WRITE_TIMEOUT_S}"}


def _wait_ready_body(url: str, predicate: Callable[[dict[str, Any]], bool], timeout: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    body: dict[str, Any] = {}
    while time.monotonic() < deadline:
        body = httpx.get(f"{url}/ready", timeout=5).json()
        if predicate(body):
            return body
        time.sleep(0.1)
    raise AssertionError(f"/ready never matched; last: {body}")


@pytest.fixture(scope="module")
def bounded(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A dev server with a low connection cap and a short request-head timeout (a test profile)."""
    config = dev_config(tmp_path_factory.mktemp("bounded"), replace=BOUNDS)
    server = ServerProcess("--config", str(config), "--model", str(tiny_model))
    try:
        server.wait_ready()
        yield server
    finally:
        assert server.stop() == 0, server.log


def test_bad_input_is_4xx_and_the_kept_alive_connection_serves_the_next_request(bounded: ServerProcess) -> None:
    bad = [(A1111, b'{"prompt": "\\ud800x", "width": 64, "height": 64, "steps": 2}', 422),
           (GEN, b'{"prompt": "a", "negative_prompt": "\\ud800x", "size": "64x64"}', 400),
           (A1111, b'{"prompt": " ", "width": 64, "height": 64}', 422),
           (GEN, b'{"prompt": "a", "prompt": "b"}', 400),
           (GEN, b'{"prompt": "a", "steps": true}', 400),
           (GEN, b'{"prompt": "a", "size": "' + b"9" * 5000 + b'x64"}', 400)]
    with httpx.Client(base_url=bounded.url or "", timeout=30) as client:
        for path, raw, status in bad:
            response = client.post(path, content=raw, headers={"content-type": "application/json"})
            assert response.status_code == status, (path, raw[:60], response.text)
            assert "connection" not in response.headers  # the connection is kept for the next request
            ok = client.post(GEN, json=OK_BODY)
            assert ok.status_code == 200, ok.text
        top = client.post(A1111, json={"prompt": "a", "seed": 2**32 - 1, "n_iter": 2, "width": 64, "height": 64,
                                       "steps": 2})
        assert top.status_code == 200 and json.loads(top.json()["info"])["all_seeds"] == [2**32 - 1, 0]


def test_chunked_body_over_the_cap_is_413(bounded: ServerProcess) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"a" * 32768
        yield b'"}'

    response = httpx.post(f"{bounded.url}{GEN}", content=chunks(), headers={"content-type": "application/json"})
    assert response.request.headers["transfer-encoding"] == "chunked"
    assert response.status_code == 413, response.text


def _closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_idle_connection_flood_cannot_starve_health(bounded: ServerProcess) -> None:
    url = bounded.url or ""
    host, port = url.removeprefix("http://").split(":")
    lines_before = len(bounded.lines)
    idle = [socket.create_connection((host, int(port)), timeout=5) for _ in range(5 * CAP)]
    try:
        for _ in range(10):
            start = time.monotonic()
            response = httpx.get(f"{url}/health", timeout=5)
            assert response.status_code == 200 and time.monotonic() - start < 1.0
        # Every idle connection is closed by the server: evicted by the cap, or at the request-head timeout.
        deadline = time.monotonic() + HEADER_TIMEOUT_S + 10
        pending = list(idle)
        while pending and time.monotonic() < deadline:
            readable, _, _ = select.select(pending, [], [], 0.5)
            pending = [s for s in pending if not (s in readable and _closed_by_peer(s))]
        assert not pending, f"{len(pending)} idle connections still open"
    finally:
        for sock in idle:
            sock.close()
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200
    assert len(bounded.lines) - lines_before < 20, "".join(bounded.lines[lines_before:])


def test_slow_request_head_is_closed_at_the_header_timeout(bounded: ServerProcess) -> None:
    host, port = (bounded.url or "").removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=HEADER_TIMEOUT_S + 10) as sock:
        start = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never the blank line that ends the head
        assert sock.recv(1024) == b""
        assert HEADER_TIMEOUT_S - 0.2 <= time.monotonic() - start < HEADER_TIMEOUT_S + 5


def _slow_body(host: str, port: int) -> socket.socket:
    """A connection whose request head the server has parsed (it answers 100 Continue once the app reads the body)
    and whose body never completes."""
    sock = socket.create_connection((host, port), timeout=10)
    sock.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                 b"expect: 100-continue\r\ncontent-length: 1000\r\n\r\n")
    assert sock.recv(1024).startswith(b"HTTP/1.1 100")
    sock.sendall(b"{")
    return sock


def test_connections_over_the_cap_evict_the_oldest_slow_body_so_probes_answer(bounded: ServerProcess) -> None:
    """Every connection still sending a body (a slowloris body, not a request being served): one more evicts the
    oldest of them and is served, instead of being refused."""
    host, port = (bounded.url or "").removeprefix("http://").split(":")
    slow = [_slow_body(host, int(port)) for _ in range(CAP)]
    try:
        for _ in range(3):
            response = httpx.get(f"{bounded.url}/health", timeout=5)
            assert response.status_code == 200, response.text
        readable, _, _ = select.select(slow[:3], [], [], 10)
        assert readable and all(_closed_by_peer(s) for s in readable), "the oldest slow bodies were not evicted"
    finally:
        for sock in slow:
            sock.close()
    _wait_ready_body(bounded.url or "", lambda b: b["state"] == "ready")


TCP_ESTABLISHED, TCP_CLOSE = 1, 7
"""Linux's TCP states (tcp_info.tcpi_state): CLOSE after a reset (an aborted connection), not a graceful FIN."""


def _tcp_state(sock: socket.socket) -> int:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0]


def _slow_reader(host: str, port: int, request: bytes) -> socket.socket:
    """A client with a tiny receive window that sends ``request`` and never reads."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)  # before connect: the window it advertises
    # and a small segment size: the server's send buffer is sized from it (on loopback, 64 KiB segments would let
    # the kernel take megabytes, as a remote client's would not)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    sock.settimeout(30)
    sock.connect((host, port))
    sock.sendall(request)
    return sock


def _probe(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=10) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            return sock.recv(64).startswith(b"HTTP/1.1 200")
    except OSError:
        return False


def test_slow_readers_cannot_take_the_connection_cap_and_are_cut_off(bounded: ServerProcess) -> None:
    """Issue 32, break 1: clients with a tiny receive window ask for a large reply (/openapi.json, pipelined 3 per
    connection, or with Connection: close) and never read. On main the replies stayed buffered, the slots were
    not released or evictable and 100% of probes failed. Now probes answer (evictions, probe slots) and every
    stuck reply is cut off at server.write_timeout_s with its buffer dropped (a reset, not a FIN after the data)."""
    host, port = (bounded.url or "").removeprefix("http://").split(":")
    assert len(httpx.get(f"{bounded.url}/openapi.json").content) > 20_000  # more than the socket buffers take
    get = b"GET /openapi.json HTTP/1.1\r\nHost: x\r\n"
    requests = (get + b"\r\n") * 3, get + b"connection: close\r\n\r\n"
    readers = [_slow_reader(host, int(port), requests[i % 2]) for i in range(CAP + 16)]
    try:
        for sock in readers:  # the server has begun each reply (or cut the connection off already)
            with contextlib.suppress(OSError):
                sock.recv(1, socket.MSG_PEEK)
        answered = sum(_probe(host, int(port)) for _ in range(100))
        assert answered >= 99, f"{answered}/100 probes answered while slow readers held the connections"
        deadline = time.monotonic() + WRITE_TIMEOUT_S + 30
        while any(_tcp_state(s) == TCP_ESTABLISHED for s in readers) and time.monotonic() < deadline:
            time.sleep(0.1)
        states = [_tcp_state(s) for s in readers]
        assert states.count(TCP_ESTABLISHED) == 0, f"{states.count(TCP_ESTABLISHED)} slow readers still connected"
        assert states.count(TCP_CLOSE) >= CAP, f"only {states.count(TCP_CLOSE)} replies were dropped: {states}"
    finally:
        for sock in readers:
            sock.close()
    assert _probe(host, int(port))


def _solid_png(side: int) -> bytes:
    """A valid side x side PNG of ~50 KB at 4096 (one colour compresses well): cheap to send, costly to decode."""
    buffer = io.BytesIO()
    Image.new("RGB", (side, side), (90, 120, 150)).save(buffer, format="PNG")
    return buffer.getvalue()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


EDIT = {"prompt": "a", "size": "64x64", "steps": "2"}
IMG2IMG = {"prompt": "a", "width": 64, "height": 64, "steps": 2}


def test_a_progressive_jpeg_scan_bomb_is_refused_by_name(bounded: ServerProcess) -> None:
    """Issue 32, break 3: a progressive JPEG of 30,000 tiny scans (26 s of CPU at 4096x4096) was decoded on main,
    then answered 200; its scans are now counted in its bytes and it is refused before decoding."""
    bomb = scan_bomb(30_000)
    refused = httpx.post(f"{bounded.url}/v1/images/edits", files={"image": ("bomb.jpg", bomb, "image/jpeg")},
                         data=EDIT, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "image", refused.text
    assert "JPEG of 30" in refused.json()["error"]["message"]
    refused = httpx.post(f"{bounded.url}/sdapi/v1/img2img", json={**IMG2IMG, "init_images": [_b64(bomb)]},
                         timeout=60)
    assert refused.status_code == 422 and "init_images.0" in refused.text and "scans" in refused.text


def test_sixteen_init_images_of_4096_are_refused_from_their_headers(bounded: ServerProcess) -> None:
    """Issue 32, break 4: img2img with 16 init_images of 4096x4096 (49 KB PNGs) peaked at 1.28 GB on main, then
    answered 200; the per-request pixel budget now refuses it from the headers, naming the image that crossed it."""
    big = _b64(_solid_png(4096))
    refused = httpx.post(f"{bounded.url}/sdapi/v1/img2img", json={**IMG2IMG, "init_images": [big] * 16}, timeout=60)
    assert refused.status_code == 422 and "per-request budget" in refused.text, refused.text[:300]
    assert "init_images.2" in refused.text  # two images of 4096x4096 fit the default budget, the third does not


def test_a_png_cut_short_or_without_iend_is_refused(bounded: ServerProcess) -> None:
    """Issue 32 (lesser): a PNG whose data ends after 10 of 2,048 rows answered 200 with black rows on main, and
    one without IEND was accepted; both are 400 naming the image now, a whole one is still served."""
    for name, data in (("rows", raw_png(64, 2048, 10)), ("iend", raw_png(64, 64, 64, iend=False)),
                       ("whole", raw_png(64, 64, 64))):
        answer = httpx.post(f"{bounded.url}/v1/images/edits", files={"image": ("x.png", data, "image/png")},
                            data=EDIT, timeout=60)
        if name == "whole":
            assert answer.status_code == 200, answer.text
        else:
            assert answer.status_code == 400 and "truncated PNG" in answer.text, (name, answer.text[:300])
            assert answer.json()["error"]["param"] == "image"


def test_content_length_with_transfer_encoding_is_an_error_that_closes_the_connection(bounded: ServerProcess) -> None:
    """RFC 9112 6.3 (issue 32): both framings on one request were served, chunked winning, on a kept-alive
    connection (a request-smuggling shape behind a proxy that uses the length). Now: 400 and the connection closes,
    so the request pipelined behind it is never served."""
    host, port = (bounded.url or "").removeprefix("http://").split(":")
    body = json.dumps(OK_BODY).encode()
    head = (f"POST {GEN} HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "transfer-encoding: chunked\r\n\r\n").encode()
    chunked = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head + chunked + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 400") and b"transfer-encoding" in answer, answer[:300]
    assert answer.count(b"HTTP/1.1 ") == 1, answer


def test_forged_host_gets_no_link_and_no_server_header(bounded: ServerProcess) -> None:
    """A spoofed Host is refused for url responses (never reflected into a link); the bound host gets an absolute
    link that serves the PNG."""
    response = httpx.post(f"{bounded.url}{GEN}", json={**OK_BODY, "response_format": "url"},
                          headers={"host": "evil.example"}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "response_format"
    assert "evil.example" in response.json()["error"]["message"] and "public_base_url" in response.text
    ok = httpx.post(f"{bounded.url}{GEN}", json={**OK_BODY, "response_format": "url"}, timeout=30)
    link = ok.json()["data"][0]["url"]
    assert link.startswith(f"{bounded.url}/v1/images/files/") and "evil" not in link
    png = httpx.get(link)
    assert png.status_code == 200 and png.content.startswith(b"\x89PNG")
    assert "server" not in response.headers and "server" not in png.headers


def test_trickling_client_cannot_stretch_shutdown_past_the_drain_bound(tiny_model: Path, tmp_path: Path) -> None:
    drain = 2.0
    config = dev_config(tmp_path, replace={"drain_timeout_s = 10": f"drain_timeout_s = {drain}"})
    server = ServerProcess("--config", str(config), "--model", str(tiny_model))
    stop = threading.Event()
    host, port = server.wait_ready().removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=5)
    try:
        sock.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 100000\r\n\r\n{")

        def trickle() -> None:
            while not stop.wait(0.2):
                try:
                    sock.sendall(b" ")
                except OSError:
                    return

        threading.Thread(target=trickle, daemon=True).start()
        start = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        code = server.proc.wait(timeout=drain + 30)
        elapsed = time.monotonic() - start
        stop.set()
        sock.settimeout(5)
        answer = sock.recv(4096)
    finally:
        stop.set()
        sock.close()
        server.stop()
    assert code == 0, server.log
    assert elapsed < drain + 5, f"exit took {elapsed:.1f}s\n{server.log}"
    # its request is answered as a shutdown (503, JSON, request id), not with the server's plain-text 500
    assert answer.startswith(b"HTTP/1.1 503") and b"application/json" in answer and b"x-request-id" in answer, answer


def _step_seconds(url: str, timeout: float = 120) -> float:
    """Seconds between two step boundaries of the executing batch, as /sdapi/v1/progress reports them."""
    marks: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    while len(marks) < 2:
        step = httpx.get(f"{url}/sdapi/v1/progress").json()["state"]["sampling_step"]
        if step >= 1 and step not in marks:
            marks[step] = time.monotonic()
        assert time.monotonic() < deadline, "the batch never made two steps"
        time.sleep(0.02)
    (first, t1), (second, t2) = sorted(marks.items())
    return (t2 - t1) / (second - first)


def test_a_batch_running_past_the_drain_deadline_stops_within_one_step_and_is_answered_503(tiny_model: Path,
                                                                                          tmp_path: Path) -> None:
    """SIGTERM while a long batch executes (the issue's 512x512, 4 images, 50 steps): at the drain deadline the
    batch stops at its next step boundary without decoding, its request gets a JSON 503 with a request id (never
    the server's plain-text 500), and the process exits within drain_timeout_s plus about one step, not after the
    batch (or its 4-image decode, several steps long on a CPU) would have finished."""
    drain = 1.0
    config = dev_config(tmp_path, replace={"drain_timeout_s = 10": f"drain_timeout_s = {drain}",
                                           "request_timeout_s = 120": "request_timeout_s = 3600"})
    server = ServerProcess("--config", str(config), "--model", str(tiny_model))
    url = server.wait_ready()
    answers: list[httpx.Response] = []
    body = {"prompt": "a long one", "steps": 50, "size": "512x512", "n": 4}
    worker = threading.Thread(target=lambda: answers.append(
        httpx.post(f"{url}/v1/images/generations", json=body, timeout=600)))
    worker.start()
    try:
        step = _step_seconds(url)
        start = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        code = server.proc.wait(timeout=600)
        elapsed = time.monotonic() - start
    finally:
        worker.join(60)
        server.stop()
    assert code == 0, server.log
    # the bound: drain + one step; the margin (another step and 5 s) absorbs a step slowed by other load
    assert elapsed < drain + 2 * step + 5, f"exit took {elapsed:.1f}s with {step:.1f}s steps\n{server.log}"
    answer = answers[0]
    assert answer.status_code == 503 and answer.headers["content-type"] == "application/json", answer.text
    assert answer.headers["x-request-id"] and "error" in answer.json()


def test_model_file_changed_under_a_running_server_degrades_ready_and_recovers(tiny_model: Path,
                                                                              tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    server = ServerProcess("--config", str(dev_config(tmp_path, replace=FAST_WATCHDOG)), "--model", str(model))
    try:
        url = server.wait_ready()
        manifest = model / "manifest.json"
        original = manifest.read_bytes()
        manifest.write_bytes(original.replace(b"{", b"{ ", 1))
        body = _wait_ready_body(url, lambda b: b["state"] == "degraded")
        assert "model_files" in body["codes"] and "manifest.json changed on disk" in " ".join(body["reasons"])
        assert str(tmp_path) not in json.dumps(body)
        refused = httpx.post(f"{url}{GEN}", json=OK_BODY, timeout=30)
        assert refused.status_code == 503, refused.text  # never a 500 per request
        manifest.write_bytes(original)
        _wait_ready_body(url, lambda b: b["state"] == "ready")
        assert httpx.post(f"{url}{GEN}", json=OK_BODY, timeout=30).status_code == 200
    finally:
        assert server.stop() == 0, server.log


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "server.cli", "serve", "--profile", "dev", *args],
                          capture_output=True, text=True, timeout=120, env={**os.environ})


def _reason_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "(exit code" in line]


def test_missing_model_folder_exits_11(tmp_path: Path) -> None:
    result = _serve("--model", str(tmp_path / "nowhere"), "--port", "0")
    assert result.returncode == 11, result.stderr
    assert len(_reason_lines(result.stderr)) == 1 and "does not exist" in result.stderr


def test_model_path_that_is_a_file_exits_11(tmp_path: Path) -> None:
    (tmp_path / "model.onnx").write_bytes(b"not a folder")
    result = _serve("--model", str(tmp_path / "model.onnx"), "--port", "0")
    assert result.returncode == 11, result.stderr
    assert len(_reason_lines(result.stderr)) == 1 and "is not a folder" in result.stderr


def test_port_in_use_exits_12(tiny_model: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _serve("--model", str(tiny_model), "--port", str(port))
    assert result.returncode == 12, result.stderr
    assert len(_reason_lines(result.stderr)) == 1 and f"cannot bind 127.0.0.1:{port}" in result.stderr


def test_an_edit_that_cannot_meet_its_deadline_is_refused_before_its_image_is_decoded(bounded: ServerProcess) -> None:
    """Issue 32, break 3: admission ran after decoding, so a request refused for its cost had paid for the decode
    first. Now the estimate comes first: an image that would fail to decode (cut short) with a deadline its cost
    cannot meet gets the admission refusal (naming the deadline), never the decode error; with a generous deadline
    the same upload reaches the decoder and is refused as truncated. Both edit routes."""
    cut = raw_png(64, 2048, 10)
    tight = {"x-sdserve-timeout-s": "0.001"}
    for headers, expected in ((tight, "exceeds the request deadline"), ({}, "truncated PNG")):
        openai_edit = httpx.post(f"{bounded.url}/v1/images/edits", files={"image": ("x.png", cut, "image/png")},
                                 data=EDIT, headers=headers, timeout=60)
        a1111 = httpx.post(f"{bounded.url}/sdapi/v1/img2img", json={**IMG2IMG, "init_images": [_b64(cut)]},
                           headers=headers, timeout=60)
        for answer in (openai_edit, a1111):
            assert answer.status_code in (400, 422) and expected in answer.text, (headers, answer.text[:300])

"""Issue 43's reproducers against a real `sdserve serve` (dev profile, tiny model, a small connection cap, a LoRA
folder whose file names are CJK, emoji and a CR): png-info's hostile PNG/WebP answered while the probes keep
answering, a zTXt bomb refused with a small answer and the server's memory bounded under eight at once, every
response sent whatever the field and LoRA names, and every probe answered under connection churn."""

from __future__ import annotations

import base64
import collections
import contextlib
import io
import select
import socket
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import unquote

import httpx
import pytest
from PIL import Image

from server.infotext_parse import MAX_PARSED_CHARS, parse_infotext
from tests import lora_files as lf
from tests.e2e.conftest import ServerProcess, dev_config

CAP = 16
SETTINGS = {"max_connections = 1000": f"max_connections = {CAP}"}
NAMES = ("漢字スタイル", "🎨emoji", "car\rriage")
"""LoRA file names (stems) outside Latin-1, and one with a CR."""
HANG_GUARD_S = 60.0


@pytest.fixture(scope="module")
def lora_dir(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("loras")
    for seed, name in enumerate(NAMES):
        lf.write_safetensors(root / f"{name}.safetensors", lf.numpy_lora(tiny_model, seed=seed, limit=2))
    return root


@pytest.fixture(scope="module")
def server(tiny_model: Path, lora_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    config = dev_config(tmp_path_factory.mktemp("hostile4"), replace=SETTINGS)
    process = ServerProcess("--config", str(config), "--model", str(tiny_model), "--lora-dir", str(lora_dir))
    try:
        process.wait_ready(timeout=120)
        yield process
    finally:
        assert process.stop() == 0, process.log


def _addr(server: ServerProcess) -> tuple[str, int]:
    host, port = (server.url or "").removeprefix("http://").split(":")
    return host, int(port)


# png-info


def _png(*chunks: tuple[bytes, bytes]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (1, 1)).save(buffer, "PNG")
    data, end = buffer.getvalue(), 8 + 12 + 13
    extra = b"".join(struct.pack(">I", len(p)) + k + p + struct.pack(">I", zlib.crc32(k + p)) for k, p in chunks)
    return data[:end] + extra + data[end:]


def _carriers(line: str) -> dict[str, bytes]:
    """The infotext ``line`` in each place png-info reads it from."""
    exif = Image.Exif()
    exif.get_ifd(0x8769)[0x9286] = b"UNICODE\x00" + line.encode("utf-16-be")
    webp = io.BytesIO()
    Image.new("RGB", (8, 8)).save(webp, "WEBP", exif=exif.tobytes())
    key = b"parameters\x00"
    return {"tEXt": _png((b"tEXt", key + line.encode("latin-1"))),
            "zTXt": _png((b"zTXt", key + b"\x00" + zlib.compress(line.encode(), 9))),
            "iTXt": _png((b"iTXt", key + b"\x01\x00\x00\x00" + zlib.compress(line.encode(), 9))),
            "WebP EXIF": webp.getvalue()}


BOMB = _png(*((b"zTXt", f"k{i}".encode() + b"\x00\x00" + zlib.compress(bytes(1 << 20), 9)) for i in range(64)))
"""The issue's bomb: a 64 KB PNG of 64 zTXt chunks, each 1 MiB of zeros once inflated (384 MB answered before)."""


def _post(url: str, data: bytes) -> httpx.Response:
    return httpx.post(f"{url}/sdapi/v1/png-info", json={"image": base64.b64encode(data).decode()},
                      timeout=HANG_GUARD_S)


class Probes:
    """GET /health and /ready in a loop on a thread, each answer's status and end time kept, until stopped."""

    def __init__(self, url: str) -> None:
        self.url, self.stop, self.first = url, threading.Event(), threading.Event()
        self.seen: list[tuple[float, int | str]] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self.stop.is_set():
                for path in ("/health", "/ready"):
                    try:
                        status: int | str = client.get(f"{self.url}{path}").status_code
                    except httpx.HTTPError as exc:
                        status = type(exc).__name__
                    self.seen.append((time.monotonic(), status))
                    self.first.set()

    def __enter__(self) -> Probes:
        self.thread.start()
        assert self.first.wait(30), "no probe answered before the hostile requests"
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)

    def during(self, start: float, end: float) -> list[int | str]:
        return [status for at, status in self.seen if start <= at <= end]


def _rss_kib(pid: int) -> dict[str, int]:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {name: int(fields[name].split()[0]) for name in ("VmRSS", "VmHWM")}


def test_hostile_infotexts_are_answered_while_the_probes_answer(server: ServerProcess) -> None:
    """60,000 and 1,000,000 characters without a colon in tEXt, zTXt, iTXt and a WebP EXIF UserComment (A1111's
    regex: 40 s and about 2.5 h, probes frozen): each answered 200 with the text read back, while probes answer."""
    url = server.url or ""
    work = [(f"{name} {size}", data, "a" * size) for size in (60_000, 1_000_000)
            for name, data in _carriers("a" * size).items()]
    with Probes(url) as probes:
        start = time.monotonic()
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda item: (item, _post(url, item[1])), work))
        end = time.monotonic()
    for (name, _, line), answer in answers:
        assert answer.status_code == 200, (name, answer.text[:300])
        assert answer.json()["info"] == line, name
        assert answer.json()["parameters"] == ({} if len(line) > MAX_PARSED_CHARS else parse_infotext(line)), name
    during = probes.during(start, end)
    assert during and all(status == 200 for status in during), during


def test_eight_ztxt_bombs_at_once_get_small_refusals_and_memory_stays_bounded(server: ServerProcess) -> None:
    """Each bomb is a 422 naming ``image`` in under 2 KB; eight at once raise the server's peak RSS by a bounded
    amount (before: 384 MB answered each, 4.1 GB of peak memory for eight)."""
    url = server.url or ""
    before = _rss_kib(server.proc.pid)
    with Probes(url) as probes, ThreadPoolExecutor(8) as pool:
        start = time.monotonic()
        answers = list(pool.map(lambda _: _post(url, BOMB), range(8)))
        end = time.monotonic()
    after = _rss_kib(server.proc.pid)
    for answer in answers:
        assert answer.status_code == 422 and len(answer.content) < 2000, answer.text[:300]
        assert answer.json()["detail"][0]["loc"] == ["body", "image"] and "bytes of text" in answer.text
    print(f"server RSS around 8 concurrent zTXt bombs: before {before}, after {after} (KiB)")
    assert after["VmHWM"] - before["VmHWM"] < 200 * 1024, (before, after)  # the inflated text: 2 MiB each
    assert all(status == 200 for status in probes.during(start, end))


# Every response is sent


def test_a_field_name_with_a_trailing_space_gets_its_answer(server: ServerProcess) -> None:
    """schemathesis' 205 no-response cases: ``{"x ": 1}`` made an invalid x-sdserve-ignored-fields value, h11
    refused it after the generation ran, and the log said 200."""
    body = {"prompt": "a", "steps": 2, "width": 64, "height": 64, "x ": 1, "y\r": 2, "名前": 3}
    answer = httpx.post(f"{server.url}/sdapi/v1/txt2img", json=body, timeout=120)
    assert answer.status_code == 200, answer.text[:300]
    assert answer.headers["x-sdserve-ignored-fields"] == "x%20,y%0D,%E5%90%8D%E5%89%8D"
    assert [unquote(n) for n in answer.headers["x-sdserve-ignored-fields"].split(",")] == ["x ", "y\r", "名前"]


@pytest.mark.parametrize("name", NAMES)
def test_a_lora_named_outside_latin_1_or_with_a_cr_gets_an_answer(server: ServerProcess, name: str) -> None:
    """Before: a 500 after the whole generation (CJK, emoji: the header was not Latin-1) or a dropped connection
    (CR), logged 200. Now CJK and emoji get their image with the name percent-encoded in x-sdserve-loras; the
    library refuses a name holding a control character (engines/lora/library.py), so naming it is a 400."""
    body = {"prompt": "a lighthouse", "size": "64x64", "steps": 2, "loras": [{"name": name, "weight": 0.5}]}
    answer = httpx.post(f"{server.url}/v1/images/generations", json=body, timeout=120)
    if "\r" in name:
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "loras.0.name", answer.text[:300]
        return
    assert answer.status_code == 200, answer.text[:300]
    header = answer.headers["x-sdserve-loras"]
    assert header.isascii() and unquote(header.split(":")[0]) == name, header
    assert answer.json()["data"][0]["b64_json"]
    tagged = httpx.post(f"{server.url}/sdapi/v1/txt2img", json={"prompt": f"a lighthouse <lora:{name}:0.5>",
                                                                 "width": 64, "height": 64, "steps": 2}, timeout=120)
    assert tagged.status_code == 200 and unquote(tagged.headers["x-sdserve-loras"].split(":")[0]) == name


# Probes under connection churn


class Churn:
    """The issue's churn: the cap held by bodies trickling in (each one evicted is replaced at once) while new
    connections arrive, each sending a request head at once (a client's GET) and leaving without reading."""

    def __init__(self, addr: tuple[str, int], per_second: float) -> None:
        self.addr, self.interval = addr, 1.0 / per_second
        self.stop = threading.Event()
        self.evicted = self.opened = 0
        self.threads = [threading.Thread(target=self._hold, daemon=True),
                        threading.Thread(target=self._churn, daemon=True)]

    def _trickler(self) -> socket.socket:
        sock = socket.create_connection(self.addr, timeout=10)
        sock.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 100000\r\n\r\n{")
        return sock

    def _hold(self) -> None:
        held = [self._trickler() for _ in range(CAP)]
        while not self.stop.is_set():
            readable, _, _ = select.select(held, [], [], 0.05)
            for sock in readable:  # the server closed it (a 408 or an eviction): the attacker opens another
                held.remove(sock)
                sock.close()
                self.evicted += 1
                with contextlib.suppress(OSError):
                    held.append(self._trickler())
            with contextlib.suppress(OSError):
                held[0].sendall(b" ")  # trickling
        for sock in held:
            sock.close()

    def _churn(self) -> None:
        recent: collections.deque[socket.socket] = collections.deque()
        while not self.stop.wait(self.interval):
            try:
                sock = socket.create_connection(self.addr, timeout=10)
                sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
                recent.append(sock)
                self.opened += 1
            except OSError:
                continue
            while len(recent) > 20:
                recent.popleft().close()
        for sock in recent:
            sock.close()

    def __enter__(self) -> Churn:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(30)


def _probe(addr: tuple[str, int], path: str) -> str:
    """A kubelet-style probe: a new connection, one GET, the status line (or what went wrong)."""
    try:
        with socket.create_connection(addr, timeout=10) as sock:
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nconnection: close\r\n\r\n".encode())
            return sock.recv(64).split(b"\r\n")[0].decode("latin-1") or "closed without an answer"
    except OSError as exc:
        return type(exc).__name__


def _until(check: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return False


def test_every_probe_is_answered_under_connection_churn(server: ServerProcess) -> None:
    """The cap held by trickling bodies and ~200 new connections a second: before, the cap closed the newest
    unread connection, often a probe (11-42% reset). Now it closes a trickling body; every probe gets 200."""
    addr = _addr(server)
    with Churn(addr, per_second=200) as churn:
        assert _until(lambda: churn.evicted >= CAP, 30), "the churn never pushed the cap"
        answers = [_probe(addr, path) for path in ("/ready", "/health") * 100]
    bad = [a for a in answers if not a.startswith("HTTP/1.1 200")]
    assert not bad, f"{len(bad)}/{len(answers)} probes failed under churn: {collections.Counter(bad)}"
    print(f"churn: {churn.opened} connections opened, {churn.evicted} trickling bodies evicted, "
          f"{len(answers)} probes all 200")

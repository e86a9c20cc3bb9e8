"""Issue 43, hostile input, fourth pass (the logic; the reproducers against a real server are in
tests/e2e/test_hostile_metadata.py): png-info's infotext parser in linear time with A1111's results, PNG text
bounded before Pillow inflates it, header values that every HTTP stack takes, the access log saying what was sent,
and the connection cap never closing a connection that may be a probe whose head is not read yet."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import random
import re
import struct
import threading
import zlib
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote

import h11
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from engines.errors import InvalidRequestError
from server import headers, images_in, png_text
from server.connections import HEAD_GRACE_S, Bounds
from server.infotext_parse import MAX_PARSED_CHARS, MAX_REPLY_BYTES, pairs, parse_infotext
from server.middleware import GuardMiddleware, Message, Receive, Scope, Send
from server.settings import load_settings
from tests.unit.fakes import FakeEngine, start

PARAM = re.compile(r'\s*(\w[\w \-/]+):\s*("(?:\\.|[^\\"])+"|[^,]*)(?:,|$)')
"""A1111's re_param (modules/infotext_utils.py): what ``pairs`` must agree with."""
PNG_INFO = "/sdapi/v1/png-info"


# png-info: the parser


def test_pairs_finds_what_a1111s_regex_finds() -> None:
    """Seeded random lines over the characters that matter to the pattern (key characters, separators, quotes,
    escapes, Unicode word and space characters), and A1111's own infotexts."""
    rng = random.Random(43)
    alphabet = 'ab_1 -/:,"\\\t\u00e9\u3000x'
    for _ in range(20_000):
        line = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 16)))
        assert pairs(line) == PARAM.findall(line), repr(line)
    real = ('Steps: 20, Sampler: Euler a, Schedule type: Karras, CFG scale: 7, Seed: 5, Size: 512x768, '
            'Model hash: abc, Model: "v1-5, pruned", Lora hashes: "ink: 0123456789ab", Version: sdserve 0.1.0')
    assert pairs(real) == PARAM.findall(real) and len(pairs(real)) == 10


def _finishes(call: Any, *args: object) -> Any:
    """``call(*args)``'s result, or a failure when it has not returned within a hang guard (A1111's regex took
    about 2.5 h on the million-character line)."""
    result: list[Any] = []
    worker = threading.Thread(target=lambda: result.append(call(*args)), daemon=True)
    worker.start()
    worker.join(60)
    assert result, f"{call.__name__} did not return within the 60 s hang guard"
    return result[0]


@pytest.mark.parametrize(("line", "expected"), [
    ("a" * 1_000_000, []), ("a " * 500_000, []), ("-/ " * 300_000 + "ab: c", [("ab", "c")]),
    ("kk: " + '"\\' * 500_000, [("kk", '"\\' * 500_000)]),  # a quote never closed: up to the end
    ("kk: " + '"a, ' * 250_000, [("kk", '"a')]),  # a quote closed after commas, then no comma: to the first one
])
def test_pairs_on_a_million_characters_returns(line: str, expected: list[tuple[str, str]]) -> None:
    found = _finishes(pairs, line)
    assert found == expected


def test_a_long_line_without_pairs_is_all_prompt() -> None:
    parsed = _finishes(parse_infotext, "x" * 1_000_000)
    assert parsed["Prompt"] == "x" * 1_000_000 and parsed["Negative prompt"] == ""


# png-info: PNG text bounded before Pillow


def _png(*chunks: tuple[bytes, bytes]) -> bytes:
    """A 1x1 PNG with ``chunks`` (type, payload) inserted after IHDR, each with its CRC."""
    buffer = io.BytesIO()
    Image.new("RGB", (1, 1)).save(buffer, "PNG")
    data = buffer.getvalue()
    head_end = 8 + 12 + 13
    extra = b"".join(struct.pack(">I", len(p)) + k + p + struct.pack(">I", zlib.crc32(k + p)) for k, p in chunks)
    return data[:head_end] + extra + data[head_end:]


def ztxt(key: str, text: bytes) -> tuple[bytes, bytes]:
    return b"zTXt", key.encode("latin-1") + b"\x00\x00" + zlib.compress(text, 9)


def itxt(key: str, text: str, compressed: bool = False) -> tuple[bytes, bytes]:
    body = zlib.compress(text.encode(), 9) if compressed else text.encode()
    return b"iTXt", key.encode("latin-1") + b"\x00" + bytes([compressed, 0]) + b"\x00\x00" + body


def text(key: str, value: str) -> tuple[bytes, bytes]:
    return b"tEXt", key.encode("latin-1") + b"\x00" + value.encode("latin-1")


def test_a_ztxt_bomb_is_refused_by_name_after_inflating_at_most_the_bound() -> None:
    bomb = _png(*(ztxt(f"k{i}", bytes(1 << 20)) for i in range(64)))
    assert len(bomb) < 80_000  # the 64 KB PNG: 64 MiB of text once inflated
    with pytest.raises(InvalidRequestError, match=r"more than 2097152 bytes of text in all") as caught:
        png_text.check(bomb, "image")
    assert caught.value.param == "image"
    with pytest.raises(InvalidRequestError, match=r"zTXt chunk 'one' holds more than 1048576 bytes"):
        png_text.check(_png(ztxt("one", bytes(100 << 20))), "image")
    with pytest.raises(InvalidRequestError, match=r"iTXt chunk 'i' holds more than 1048576"):
        png_text.check(_png(itxt("i", "a" * (2 << 20), compressed=True)), "image")
    with pytest.raises(InvalidRequestError, match="more than 64 text chunks"):
        png_text.check(_png(*(text(f"k{i}", "v") for i in range(65))), "image")
    png_text.check(_png(*(text(f"k{i}", "v") for i in range(64))), "image")  # at the bound: read


def test_inflating_stops_one_byte_past_the_limit() -> None:
    stream = zlib.compress(bytes(50 << 20), 9)
    assert png_text.inflated_size(stream, 1000) == 1001
    assert png_text.inflated_size(zlib.compress(b"abc"), 1000) == 3
    assert png_text.inflated_size(b"not zlib", 1000) == 0


@pytest.fixture
def client() -> Iterator[TestClient]:
    yield from start(FakeEngine(), load_settings("dev"))


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _webp_with_comment(comment: str) -> bytes:
    exif = Image.Exif()
    exif.get_ifd(0x8769)[0x9286] = b"UNICODE\x00" + comment.encode("utf-16-be")
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buffer, "WEBP", exif=exif.tobytes())
    return buffer.getvalue()


@pytest.mark.parametrize("size", [60_000, 1_000_000])
def test_png_info_answers_long_lines_without_a_colon_in_every_carrier(client: TestClient, size: int) -> None:
    line = "a" * size
    carriers = {"tEXt": _png(text("parameters", line)), "zTXt": _png(ztxt("parameters", line.encode())),
                "iTXt": _png(itxt("parameters", line, compressed=True)), "WebP EXIF": _webp_with_comment(line)}
    for name, data in carriers.items():
        answer = client.post(PNG_INFO, json={"image": _b64(data)})
        assert answer.status_code == 200, (name, answer.text[:300])
        assert answer.json()["info"] == line, name
        assert answer.json()["parameters"] == ({} if size > MAX_PARSED_CHARS else parse_infotext(line)), name


def test_png_info_refuses_a_bomb_with_a_small_answer_naming_the_image(client: TestClient) -> None:
    answer = client.post(PNG_INFO, json={"image": _b64(_png(*(ztxt(f"k{i}", bytes(1 << 20)) for i in range(64))))})
    assert answer.status_code == 422 and len(answer.content) < 2000, answer.text
    assert answer.json()["detail"][0]["loc"] == ["body", "image"] and "bytes of text" in answer.text
    zeros = bytes((1 << 20) - 100)  # within the text bounds, but JSON writes each as \u0000: over the reply bound
    answer = client.post(PNG_INFO, json={"image": _b64(_png(ztxt("parameters", zeros), ztxt("other", zeros)))})
    assert answer.status_code == 422 and f"over the {MAX_REPLY_BYTES}" in answer.text, answer.text[:300]


def test_an_edit_upload_with_a_text_bomb_is_refused_before_pillow_inflates_it() -> None:
    bomb = _png(*(ztxt(f"k{i}", bytes(1 << 20)) for i in range(64)))
    for read in (lambda: images_in.decode(bomb, "init_images.0", 1 << 24),
                 lambda: images_in.check_pixel_budget([("mask", bomb)], 1 << 24, 1 << 25)):
        with pytest.raises(InvalidRequestError, match="bytes of text in all"):
            read()


# Header values


H11_VALUE = re.compile(rb"(?:[^\x00\s]+(?:[ \t]+[^\x00\s]+)*)?")
"""h11's field_value (h11/_abnf.py, with its vchar_or_obs_text): what uvicorn refuses to send otherwise."""


def test_every_value_is_one_h11_sends_and_every_name_comes_back() -> None:
    rng = random.Random(8187)
    alphabet = ["x", " ", "\t", "\r", "\n", "\x00", "%", ",", ":", "é", "漢", "🎉", "\ud800", "\x7f", "~"]
    for _ in range(5_000):
        raw = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        made = headers.value(raw)
        assert made.isascii() and H11_VALUE.fullmatch(made.encode()) and len(made) <= headers.MAX_VALUE_CHARS
        name = headers.token(raw)
        assert re.fullmatch(r"[A-Za-z0-9_.~%-]*", name), name
        if "\ud800" not in raw:
            assert unquote(name) == raw
    assert headers.value("é" * 5000).endswith("%C3%A9") and len(headers.value("é" * 5000)) <= 2000
    assert headers.tokens(["x ", "漢字", "a\rb"]) == "x%20,%E6%BC%A2%E5%AD%97,a%0Db"
    assert headers.value("ok, as it is; 50%") == "ok, as it is; 50%"


def test_repaired_leaves_valid_values_alone() -> None:
    assert headers.repaired(b"c2pa") is None and headers.repaired(b"") is None
    assert headers.repaired(b"x ") == b"x" and headers.repaired("é".encode("latin-1")) == b"%C3%A9"
    assert headers.repaired(b"a\r\nb") == b"a%0D%0Ab"


def _guarded(app: Any, send_fails: bool = False) -> tuple[list[dict[str, Any]], list[Message]]:
    """``app`` behind the guard; the access-log records and what reached the server's send."""
    records: list[dict[str, Any]] = []
    sent: list[Message] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.access)  # type: ignore[attr-defined]

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        if send_fails:  # as uvicorn's send does when h11 refuses the head
            raise h11.LocalProtocolError("Illegal header value b'x '")
        sent.append(message)

    handler, logger = Keep(), logging.getLogger("sdserve.access")
    logger.addHandler(handler)
    level, disabled, logger.disabled = logger.level, logger.disabled, False
    logger.setLevel(logging.INFO)
    try:
        scope: Scope = {"type": "http", "method": "POST", "path": "/sdapi/v1/txt2img", "headers": [], "state": {}}
        asyncio.run(GuardMiddleware(app)(scope, receive, send))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.disabled = disabled
    return records, sent


async def _bad_header_app(scope: Scope, receive: Receive, send: Send) -> None:
    """A builder that bypassed headers.put: a raw value h11 refuses (a trailing space)."""
    await send({"type": "http.response.start", "status": 200, "headers": [(b"x-sdserve-ignored-fields", b"x ")]})
    await send({"type": "http.response.body", "body": b"{}"})


def test_the_guard_repairs_a_value_that_bypassed_the_builder() -> None:
    records, sent = _guarded(_bad_header_app)
    start_message = sent[0]
    assert (b"x-sdserve-ignored-fields", b"x") in start_message["headers"]
    assert records[0]["status"] == 200 and "send_error" not in records[0]


def test_a_response_that_could_not_be_sent_is_not_logged_200() -> None:
    """The issue's log said 200 for a response h11 refused: a send that raises is logged with status 0, the
    status it would have had and the error."""
    async def refused(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"x-bad", b"\x00")]})
        await send({"type": "http.response.body", "body": b"{}"})

    records, _ = _guarded(refused, send_fails=True)
    [record] = records
    assert record["status"] == 0 and record["response_status"] == 200
    assert record["send_error"].startswith("LocalProtocolError")


def test_a1111_field_names_and_lora_names_reach_the_client_encoded(client: TestClient) -> None:
    answer = client.post("/sdapi/v1/txt2img", json={"prompt": "a", "steps": 2, "x ": 1, "漢字": 1, "a\rb": 1})
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-sdserve-ignored-fields"] == "a%0Db,x%20,%E6%BC%A2%E5%AD%97"
    assert any("漢字" in w for w in json.loads(answer.json()["info"])["warnings"])  # the body: names as sent


# The connection cap under churn


class Conn:
    def __init__(self) -> None:
        self.expired = False

    def expire(self) -> None:
        self.expired = True


def test_the_cap_never_closes_a_connection_younger_than_the_grace_without_its_head() -> None:
    """Issue 43: the cap held by slow bodies, new connections arriving faster than their heads are read; the
    oldest connection without a head was the newest unread one, often a probe. Now it is a slow body."""
    bounds = Bounds(2, 10.0, 10.0, probe_slots=1)
    fresh, stale, body, stuck = Conn(), Conn(), Conn(), Conn()
    bounds.waiting[fresh] = 100.0  # type: ignore[index]
    bounds.reading[body] = None  # type: ignore[index]
    assert bounds.evictable(100.0 + HEAD_GRACE_S / 2) is body
    bounds.stalled[stuck] = None  # type: ignore[index]
    assert bounds.evictable(100.0 + HEAD_GRACE_S / 2) is stuck
    assert bounds.evictable(100.0 + HEAD_GRACE_S) is fresh  # it had its time: an idle connection
    bounds.waiting = {stale: 90.0, fresh: 100.0}  # type: ignore[dict-item]
    assert bounds.evictable(100.0) is stale
    only_fresh = Bounds(2, 10.0, 10.0, probe_slots=1)
    only_fresh.waiting[fresh] = 100.0  # type: ignore[index]
    assert only_fresh.evictable(100.5) is None  # a probe slot or a 503 for the newcomer, never the fresh one
    probe = Conn()
    in_slot = Bounds(2, 10.0, 10.0, probe_slots=1)
    in_slot.waiting[probe] = 0.0  # type: ignore[index]
    in_slot.probes[probe] = None  # type: ignore[index]
    assert in_slot.evictable(100.0) is None


def _png_text_after_pixels(value: str, corrupt_pixels: bool) -> bytes:
    """A 4096x4096 PNG with its ``parameters`` text after the image data (where Pillow reads it only by decoding
    every pixel); ``corrupt_pixels``: its IDAT stream cut to a few bytes, so no decode could succeed."""
    buffer = io.BytesIO()
    Image.new("L", (4096, 4096)).save(buffer, "PNG")
    data = buffer.getvalue()
    chunks = list(png_text.chunks(data))
    if corrupt_pixels:
        chunks = [(k, p[:16] if k == b"IDAT" else p) for k, p in chunks]
    chunks.insert(len(chunks) - 1, text("parameters", value))
    return png_text.SIGNATURE + b"".join(struct.pack(">I", len(p)) + k + p + struct.pack(">I", zlib.crc32(k + p))
                                         for k, p in chunks)


def test_png_info_reads_the_text_without_decoding_a_pixel(client: TestClient) -> None:
    """Issue 57: png-info decoded every pixel to read the text, in the decoder slots img2img uses (8 clients posting
    a 4096x4096 PNG denied everyone's uploads). The text is read from the chunks: it answers even when the pixel
    data is corrupt (a decode would be a 422), and a text after the image data is found as A1111 finds it."""
    infotext = "a lighthouse\nSteps: 20, Sampler: Euler, CFG scale: 7, Seed: 1, Size: 512x512"
    for corrupt in (False, True):
        data = _png_text_after_pixels(infotext, corrupt)
        answer = client.post(PNG_INFO, json={"image": _b64(data)})
        assert answer.status_code == 200, answer.text[:300]
        assert answer.json()["info"] == infotext and answer.json()["parameters"]["Seed"] == "1"
    with pytest.raises(InvalidRequestError, match="truncated or corrupt"):
        images_in.decode(_png_text_after_pixels(infotext, True), "image", 1 << 25)
    assert png_text.texts(_png(ztxt("z", b"zipped"), itxt("i", "\u00e9t\u00e9", compressed=True), text("t", "x"))) \
        == {"z": "zipped", "i": "\u00e9t\u00e9", "t": "x"}

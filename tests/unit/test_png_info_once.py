"""Issue 57: png-info answered its text twice (``info``, and again as ``parameters``' prompt), so a 1,061-byte
zTXt chunk made an 8.28 MB reply (7,804x). The reply now carries a text over ``MAX_PARSED_CHARS`` once; an
infotext a generator writes is still parsed as A1111 parses it."""

from __future__ import annotations

import base64
import io
import json
import struct
import zlib
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from PIL import Image

from server.infotext_parse import MAX_PARSED_CHARS
from server.settings import load_settings
from tests.unit.fakes import FakeEngine, start

PNG_INFO = "/sdapi/v1/png-info"


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    yield from start(FakeEngine(), load_settings("dev"))


def _png_with_ztxt(key: str, value: str) -> str:
    """A 1x1 PNG (base64) with one zTXt chunk after IHDR, its CRC written."""
    buffer = io.BytesIO()
    Image.new("RGB", (1, 1)).save(buffer, "PNG")
    data = buffer.getvalue()
    payload = key.encode("latin-1") + b"\x00\x00" + zlib.compress(value.encode("latin-1"), 9)
    chunk = struct.pack(">I", len(payload)) + b"zTXt" + payload + struct.pack(">I", zlib.crc32(b"zTXt" + payload))
    return base64.b64encode(data[:33] + chunk + data[33:]).decode()


def _escaped(text: str) -> int:
    """Bytes ``text`` takes once in the JSON reply."""
    return len(json.dumps(text, ensure_ascii=False).encode())


@pytest.mark.parametrize("char", ['"', "a"])
def test_a_long_text_comes_back_once(client: TestClient, char: str) -> None:
    """1M quotes (each escaped to two bytes) inflate from about 1 KB: the reply holds them once, in ``info``;
    before the fix it was twice that plus the parsed copy."""
    text = char * 1_000_000
    image = _png_with_ztxt("parameters", text)
    assert len(image) < 4000
    answer = client.post(PNG_INFO, json={"image": image})
    assert answer.status_code == 200, answer.text[:300]
    assert answer.json()["info"] == text and answer.json()["parameters"] == {}
    assert len(answer.content) <= _escaped(text) + 200, len(answer.content)


def test_the_bound_is_where_parsing_stops(client: TestClient) -> None:
    params = "\nSteps: 2, Sampler: Euler, Seed: 5, Size: 64x64"
    fits = "p" * (MAX_PARSED_CHARS - len(params)) + params
    parsed = client.post(PNG_INFO, json={"image": _png_with_ztxt("parameters", fits)}).json()
    assert parsed["info"] == fits and parsed["parameters"]["Seed"] == "5"
    assert parsed["parameters"]["Prompt"] == "p" * (MAX_PARSED_CHARS - len(params))
    over = "p" + fits
    once = client.post(PNG_INFO, json={"image": _png_with_ztxt("parameters", over)})
    assert once.json()["info"] == over and once.json()["parameters"] == {}
    assert len(once.content) <= _escaped(over) + 200


def test_a_generators_infotext_is_still_parsed(client: TestClient) -> None:
    text = 'a dog\nNegative prompt: ugly\nSteps: 20, Sampler: Euler a, CFG scale: 7, Seed: 5, Size: 512x768'
    read = client.post(PNG_INFO, json={"image": _png_with_ztxt("parameters", text)}).json()
    assert read["info"] == text
    assert (read["parameters"]["Prompt"], read["parameters"]["Negative prompt"]) == ("a dog", "ugly")
    assert read["parameters"]["Size-2"] == "768"

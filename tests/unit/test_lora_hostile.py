"""The server's side of LoRA against hostile input (issue 43): the tag scan linear in the prompt and equal to
A1111's pattern, aliases resolved as A1111 does, the listing built off the event loop once per scan, and
concurrent refreshes sharing one scan."""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import threading
import time
import unicodedata

import pytest
from fastapi.testclient import TestClient

from engines.errors import InvalidRequestError
from engines.types.model import LoraInfo
from server.app import create_app
from server.lora_prompt import find_tags, lookup, parse_prompt
from server.routes.a1111_loras import Refresher
from server.settings import load_settings
from tests.unit.fakes import FakeEngine

A1111_TAG = re.compile(r"<(\w+):([^>]+)>")
"""A1111's re_extra_net: the reference the linear scan must agree with."""


def _info(name: str, alias: str | None = None, problem: str = "", sha: str = "a") -> LoraInfo:
    return LoraInfo(name, alias or name, f"{name}.safetensors", sha * 64, 10, {}, problem, {"unet": 1})


def test_the_linear_tag_scan_finds_what_a1111s_pattern_finds() -> None:
    rng = random.Random(43)
    alphabet = ["<", ">", ":", "a", "b_", "1", " ", ",", "=", "é", "\n", "lora", "<lora:", ">>", "::"]
    for _ in range(5000):
        prompt = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        expected = [(m.start(), m.end(), m.group(1), m.group(2)) for m in A1111_TAG.finditer(prompt)]
        assert list(find_tags(prompt)) == expected, repr(prompt)


@pytest.mark.parametrize("prompt", ["<a:" * 33_334, "<" + "a" * 100_000, "<lora:x" * 14_286,
                                    "<a:b" * 25_000 + ">", "<lora:a:1>" * 10_000])
def test_a_100k_character_prompt_is_parsed_in_linear_time(prompt: str) -> None:
    """A1111's pattern run by ``re`` took 25 s on the first of these, before admission, on the event loop."""
    start = time.perf_counter()
    with contextlib.suppress(InvalidRequestError):  # "<a:b...>": one tag, a 100k body; what matters is the time
        parse_prompt(prompt)
    assert time.perf_counter() - start < 1.0


def test_an_alias_resolves_the_file_name_wins_and_a_shared_alias_is_refused() -> None:
    library = {i.name: i for i in (_info("film_grain_v2", "filmGrainV2", sha="a"), _info("ink", "style", sha="b"),
                                   _info("style", "other", sha="c"), _info("x1", "twin", sha="d"),
                                   _info("x2", "twin", sha="e"), _info("old", "gone", "refused: NaN", sha="f"))}
    assert lookup("filmGrainV2", "prompt", library).name == "film_grain_v2"  # aiyabot's <lora:filmGrainV2:0.85>
    assert lookup("style", "prompt", library).name == "style"  # the file name wins over ink's alias
    with pytest.raises(InvalidRequestError, match=r"alias 'twin' is ambiguous.*x1.*x2") as caught:
        lookup("twin", "loras.0.name", library)
    assert caught.value.param == "loras.0.name"
    with pytest.raises(InvalidRequestError, match="unknown LoRA 'gone'"):
        lookup("gone", "prompt", library)  # a refused file's alias does not resolve


def test_a_name_is_matched_in_nfc() -> None:
    """The library normalizes file names to NFC (a macOS-made NFD file name); a request's name is too."""
    library = {"café": _info("café"), "水彩画": _info("水彩画")}
    assert lookup(unicodedata.normalize("NFD", "café"), "prompt", library).name == "café"
    assert lookup("水彩画", "prompt", library).name == "水彩画"


def test_the_listing_is_built_once_per_scan_and_survives_any_metadata() -> None:
    engine = FakeEngine()
    engine.library = (LoraInfo("水彩画", "水彩画", "水彩画.safetensors", "a" * 64, 10,
                               {"ss_output_name": "\ud800 lone surrogate", "ss_tag": "\r\n"}, "", {"unet": 1}),)
    with TestClient(create_app(engine, load_settings("dev"))) as client:
        first = client.get("/sdapi/v1/loras")
        assert first.status_code == 200 and first.json()[0]["name"] == "水彩画"
        assert first.json()[0]["metadata"]["ss_tag"] == "\r\n"
        assert client.get("/sdapi/v1/loras").content == first.content
        refreshed = client.post("/sdapi/v1/refresh-loras")
        assert refreshed.status_code == 200 and refreshed.json()[0]["name"] == "水彩画"


class _Slow(FakeEngine):
    """A fake whose refresh waits until the test lets it finish, counting scans."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.scans = 0

    def refresh_loras(self) -> tuple[LoraInfo, ...]:
        self.scans += 1
        assert self.release.wait(timeout=60)
        return self.library


def test_twenty_concurrent_refreshes_run_two_scans_and_hold_one_thread() -> None:
    """While one scan runs, the other 19 callers wait without a worker thread, then share one more scan: the
    flood that re-hashed 1.9 GB forty times (and held every worker thread) runs two scans."""
    engine, refresher = _Slow(), Refresher()

    async def flood() -> list[tuple[LoraInfo, ...]]:
        calls = [asyncio.ensure_future(refresher(engine)) for _ in range(20)]
        deadline = time.monotonic() + 60
        while (refresher._asked < 20 or engine.scans < 1) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert refresher._asked == 20 and engine.scans == 1
        engine.release.set()
        return list(await asyncio.gather(*calls))

    results = asyncio.run(flood())
    assert len(results) == 20 and engine.scans == 2


def test_parsing_stops_at_the_most_tags_any_profile_takes() -> None:
    assert len(parse_prompt("<lora:a:1>" * 64)[1]) == 64
    with pytest.raises(InvalidRequestError, match="more than 64 LoRA tags") as caught:
        parse_prompt("<lora:a:1>" * 65)
    assert caught.value.param == "prompt"


def test_a_file_named_twice_is_applied_once_with_the_sum_held_to_the_bound() -> None:
    """Issue 57: eight copies of one tag at weight 10 were accepted, an 80x delta. A file named more than once (by
    its name or its alias) becomes one use with the summed multipliers (adding its delta once per tag comes to the
    same), and the sum is bounded like one multiplier."""
    from server.lora_prompt import resolve

    library = {i.name: i for i in (_info("ink", "inky", sha="b"), _info("grain", sha="c"))}
    _, wanted = parse_prompt("a <lora:ink:0.5> b <lora:inky:0.25> <lora:grain:1>")
    uses = resolve(wanted, library, 8, 10.0)
    assert sorted((u.name, u.te, u.unet) for u in uses) == [("grain", 1.0, 1.0), ("ink", 0.75, 0.75)]
    _, wanted = parse_prompt("<lora:ink:10>" * 8)
    with pytest.raises(InvalidRequestError, match=r"named more than once and its multipliers add up to 20") as over:
        resolve(wanted, library, 8, 10.0)
    assert over.value.param == "prompt"


def test_of_two_files_with_one_name_the_first_listed_usable_is_the_one_used() -> None:
    """Issue 57: the scan lists the first of two files named "x" usable and the second refused ("another file has
    the same name"); building the request's library by name let the second overwrite the first, so "x" was a 400
    while listed usable. The library by name keeps the first, as the scan decided."""
    from server.lora_prompt import by_name

    first = _info("x", sha="a")
    second = _info("x", problem="another file has the same name (a/x.safetensors); rename one", sha="b")
    library = by_name([first, second])
    assert lookup("x", "prompt", library) is first and not library["x"].problem

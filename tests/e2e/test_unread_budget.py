"""Issue 57, a hostile finding: clients that never read an amplified reply pinned memory by their numbers (64 on an
8 MB png-info reply: RSS 446 -> 918 MB until the 30 s write timeout; 256: 2.26 GB) while every connection was
within its own bounds. A real `sdserve serve` with a 1 MiB budget for reply bytes held unread across connections
(``server.max_unread_reply_mb``) and a write timeout of an hour, so only the budget can cut a reader off: slow readers
of /openapi.json are reset, the oldest first, until what is held fits; probes answer throughout (server/connections.py
Bounds.hold)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import ServerProcess, dev_config
from tests.e2e.test_hostile import _probe, _slow_reader, _tcp_state

TCP_CLOSE = 7
READERS = 24


@pytest.fixture(scope="module")
def budgeted(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    config = dev_config(tmp_path_factory.mktemp("unread"), replace={
        "header_timeout_s = 10.0": "header_timeout_s = 10.0\nwrite_timeout_s = 3600\nmax_unread_reply_mb = 1"})
    server = ServerProcess("--config", str(config), "--model", str(tiny_model))
    try:
        server.wait_ready()
        yield server
    finally:
        assert server.stop() == 0, server.log


def test_readers_that_never_read_are_cut_off_past_the_budget_long_before_their_timeout(
        budgeted: ServerProcess) -> None:
    host, port = (budgeted.url or "").removeprefix("http://").split(":")
    reply = len(httpx.get(f"{budgeted.url}/openapi.json").content)
    request = b"GET /openapi.json HTTP/1.1\r\nHost: x\r\n\r\n" * 3  # pipelined: three replies each, never read
    assert READERS * 3 * reply > 4 << 20, reply  # several times the 1 MiB budget if nothing were cut
    readers = [_slow_reader(host, int(port), request) for _ in range(READERS)]
    try:
        deadline = time.monotonic() + 60  # the write timeout is an hour: only the budget can close them
        while sum(_tcp_state(s) == TCP_CLOSE for s in readers) < READERS // 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        cut = [i for i, s in enumerate(readers) if _tcp_state(s) == TCP_CLOSE]
        assert len(cut) >= READERS // 2, f"only {len(cut)} of {READERS} stalled readers were cut off"
        assert all(_probe(host, int(port)) for _ in range(20)), "a probe failed while readers held replies"
        assert "server.max_unread_reply_mb" in budgeted.log
    finally:
        for sock in readers:
            sock.close()

"""Issue 52 point 0 through a real `sdserve serve` process (dev profile, tiny model): a small request of another
shape never waits out large jobs. A 64x64 1-image request sent while 256x256 4-image 50-step jobs run finishes
before every one of them, on the OpenAI and the A1111 API. Ordered by the completions themselves (each recorded
as it returns); the only wait is for a server state (a large job has run a step), never a sleep.

The deadline guard (server/step_policy.py ``urgent``) is kept out of this order on purpose: on a fresh server the
256x256 cost is scaled from the boot canaries' 64x64 one, text encoding and decode folded in (several times the
real step cost), so with the dev profile's 120 s deadline the second and third large jobs can rank as urgent on that
guess and legitimately go first (CI saw it once). The server here gives requests an hour; tests/unit/
test_step_policy.py covers urgency on its own."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import ServerProcess, dev_config

LARGE = 3


@pytest.fixture(scope="module")
def hour_server(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[str]:
    """The dev profile with a one-hour request deadline: no request here is ever near its deadline."""
    profile = dev_config(tmp_path_factory.mktemp("cross"),
                         replace={"request_timeout_s = 120": "request_timeout_s = 3600"})
    server = ServerProcess("--config", str(profile), "--model", str(tiny_model))
    try:
        yield server.wait_ready()
    finally:
        assert server.stop() == 0, server.log


def _openai(url: str, size: int, n: int, steps: int) -> httpx.Response:
    return httpx.post(f"{url}/v1/images/generations", timeout=300,
                      json={"prompt": "shape", "size": f"{size}x{size}", "n": n, "steps": steps,
                            "response_format": "b64_json"})


def _a1111(url: str, size: int, n: int, steps: int) -> httpx.Response:
    return httpx.post(f"{url}/sdapi/v1/txt2img", timeout=300,
                      json={"prompt": "shape", "width": size, "height": size, "batch_size": n, "steps": steps})


def _running(url: str, timeout: float = 60.0) -> None:
    """Until /sdapi/v1/progress shows a job that has run a step and has steps left (bounded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = httpx.get(f"{url}/sdapi/v1/progress").json()["state"]
        if 1 <= state["sampling_step"] < state["sampling_steps"]:
            return
        time.sleep(0.01)
    raise AssertionError("never observed: a large job running")


@pytest.mark.parametrize("post", [_openai, _a1111], ids=["openai", "a1111"])
def test_a_small_request_finishes_before_the_large_jobs_running(hour_server: str,
                                                               post: Callable[..., httpx.Response]) -> None:
    url = hour_server
    done: list[tuple[str, int]] = []
    lock = threading.Lock()

    def large() -> None:
        response = post(url, 256, 4, 50)
        with lock:
            done.append(("large", response.status_code))

    workers = [threading.Thread(target=large) for _ in range(LARGE)]
    for worker in workers:
        worker.start()
    _running(url)
    small = post(url, 64, 1, 20)
    with lock:
        done.append(("small", small.status_code))
    for worker in workers:
        worker.join(300)
    assert small.status_code == 200, small.text
    assert [code for _, code in done] == [200] * (LARGE + 1), done
    assert done[0][0] == "small", done  # every large job was still running when the small one returned

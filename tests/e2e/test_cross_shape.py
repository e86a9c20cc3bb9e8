"""Issue 52 point 0 through a real `sdserve serve` process (dev profile, tiny model): a small request of another
shape never waits out large jobs. A 64x64 1-image request sent while 256x256 4-image 50-step jobs run finishes
before every one of them, on the OpenAI and the A1111 API. Ordered by the completions themselves (each recorded
as it returns); the only wait is for a server state (a large job has run a step), never a sleep."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx
import pytest

from tests.e2e.conftest import ServerProcess

LARGE = 3


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
def test_a_small_request_finishes_before_the_large_jobs_running(dev_process: ServerProcess,
                                                               post: Callable[..., httpx.Response]) -> None:
    url = dev_process.url
    assert url is not None
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

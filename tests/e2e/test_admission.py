"""Admission by cost and fairness against a real server: a request that cannot finish before its deadline is
refused at once (naming the deadline and the estimate) instead of being computed and thrown away, a short request
behind it is answered, and an A1111 n_iter run is queued one iteration at a time so other callers interleave."""

from __future__ import annotations

import threading
import time

import httpx

A1111 = "/sdapi/v1/txt2img"
GEN = "/v1/images/generations"


def test_a_request_that_cannot_finish_before_its_deadline_is_refused_at_once(dev_server: str) -> None:
    """The issue's in-limit request (512x512, 50 steps, 4 x 4 images): refused in well under its deadline with a
    422 naming the estimate and the deadline; a 64x64 request sent right after it is answered."""
    long = {"prompt": "x", "width": 512, "height": 512, "steps": 50, "batch_size": 4, "n_iter": 4}
    start = time.monotonic()
    refused = httpx.post(f"{dev_server}{A1111}", json=long, headers={"x-sdserve-timeout-s": "20"}, timeout=60)
    assert time.monotonic() - start < 10, "the refusal was not at admission"
    assert refused.status_code == 422, refused.text
    message = refused.json()["detail"][0]["msg"]
    assert "estimated compute" in message and "exceeds the request deadline 20.0s" in message, message
    assert "x-sdserve-timeout-s" in message and "per image-step" in message
    short = httpx.post(f"{dev_server}{GEN}", json={"prompt": "y", "size": "64x64", "steps": 2}, timeout=60)
    assert short.status_code == 200, short.text
    metrics = httpx.get(f"{dev_server}/metrics").text
    assert 'sdserve_requests_refused_total{reason="over_deadline"}' in metrics


def _sampling(url: str) -> int:
    return int(httpx.get(f"{url}/sdapi/v1/progress").json()["state"]["sampling_step"])


def test_n_iter_runs_one_iteration_at_a_time_so_a_later_caller_interleaves(dev_server: str) -> None:
    """n_iter = 4 iterations of one image each: a short request sent while the first iteration runs is answered
    before the whole run ends (queued all at once, the four would merge into one batch ahead of it)."""
    finished: dict[str, float] = {}
    answers: dict[str, httpx.Response] = {}

    def call(name: str, path: str, body: dict[str, object]) -> None:
        answers[name] = httpx.post(f"{dev_server}{path}", json=body, timeout=300)
        finished[name] = time.monotonic()

    long = threading.Thread(target=call, args=("long", A1111, {"prompt": "x", "width": 64, "height": 64,
                                                                "steps": 40, "batch_size": 1, "n_iter": 4}))
    long.start()
    deadline = time.monotonic() + 60
    while _sampling(dev_server) < 1:
        assert time.monotonic() < deadline, "the long run never started"
        time.sleep(0.01)
    call("short", GEN, {"prompt": "y", "size": "64x64", "steps": 2})
    long.join(300)
    assert answers["long"].status_code == 200 and len(answers["long"].json()["images"]) == 4
    assert answers["short"].status_code == 200
    assert finished["short"] < finished["long"], "the short request waited for the whole n_iter run"

"""The rollout gate on synthetic bench results."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from engines.errors import InvalidRequestError
from server.cli.bench import require_loopback
from server.cli.gate import compare, render

BASE: dict[str, Any] = {
    "format": 1,
    "levels": [{"concurrency": 1, "requests": 10, "ok": 10, "rejected_429": 0, "errors": 0, "p50_s": 0.1,
                "p95_s": 0.12, "p99_s": 0.13, "images_per_minute": 600.0},
               {"concurrency": 16, "requests": 10, "ok": 8, "rejected_429": 2, "errors": 0, "p50_s": 1.0,
                "p95_s": 1.5, "p99_s": 1.6, "images_per_minute": 900.0}],
    "fingerprints": {"1": [[[10.0, 20.0, 30.0]]]},
    "capabilities": {"providers": {"unet": ["CUDAExecutionProvider"]}, "accelerated": True,
                     "onnxruntime": "1.31.1", "tensorrt": "10.13.3"},
}


def verdicts(cand: dict[str, Any]) -> dict[str, str]:
    return {r.check: r.verdict for r in compare(BASE, cand)}


def test_identical_results_pass() -> None:
    rows = compare(BASE, copy.deepcopy(BASE))
    assert all(r.verdict == "ok" for r in rows)
    assert "no regression" in render(rows)


def test_p95_and_throughput_regressions_beyond_tolerance() -> None:
    cand = copy.deepcopy(BASE)
    cand["levels"][1]["p95_s"] = 1.5 * 1.11
    cand["levels"][0]["images_per_minute"] = 600.0 * 0.95  # within 10 %
    v = verdicts(cand)
    assert v["c=16 p95 latency"] == "REGRESSION" and v["c=1 throughput"] == "ok"
    cand["levels"][0]["images_per_minute"] = 500.0
    assert verdicts(cand)["c=1 throughput"] == "REGRESSION"


def test_provider_fallback_and_fingerprint_change_are_regressions_versions_are_reported() -> None:
    cand = copy.deepcopy(BASE)
    cand["capabilities"] = {"providers": {"unet": ["CPUExecutionProvider"]}, "accelerated": False,
                            "onnxruntime": "1.31.1", "tensorrt": "10.14.1"}
    cand["fingerprints"]["1"] = [[[10.0, 20.0, 40.0]]]
    v = verdicts(cand)
    assert v["provider unet"] == "REGRESSION" and v["accelerated"] == "REGRESSION"
    assert v["canary seed 1 fingerprint"] == "REGRESSION"
    assert v["tensorrt"] == "changed"


def test_missing_level_is_a_regression() -> None:
    cand = copy.deepcopy(BASE)
    cand["levels"] = cand["levels"][:1]
    assert verdicts(cand)["c=16 present"] == "REGRESSION"


@pytest.mark.parametrize("url", ["http://10.0.0.1:8000", "http://192.168.1.5", "http://8.8.8.8:80"])
def test_bench_refuses_non_loopback_targets(url: str) -> None:
    with pytest.raises(InvalidRequestError, match="only targets loopback"):
        require_loopback(url)


def test_bench_accepts_loopback() -> None:
    require_loopback("http://127.0.0.1:8000")
    require_loopback("http://localhost:8000")


def test_a_session_missing_from_the_old_baseline_is_not_comparable_not_a_regression() -> None:
    cand = copy.deepcopy(BASE)
    cand["capabilities"]["providers"]["scheduler_step"] = ["CUDAExecutionProvider"]
    rows = compare(BASE, cand)
    assert {r.check: r.verdict for r in rows}["provider scheduler_step"] == "not comparable"
    assert not any(r.verdict == "REGRESSION" for r in rows)
    assert "no regression" in render(rows) and "1 check(s) not comparable" in render(rows)
    gone = copy.deepcopy(BASE)
    gone["capabilities"]["providers"] = {}
    assert verdicts(gone)["provider unet"] == "REGRESSION"  # a session the candidate lost still fails

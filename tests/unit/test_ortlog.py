"""Log classification on lines this machine's ONNX Runtime 1.31.1 really printed (tests/data/ort_logs, captured with
engines.ortlog.capture_ort_output around InferenceSession on a machine without a GPU; site-packages path elided)."""

from __future__ import annotations

from pathlib import Path

from engines.runtime.ortlog import classify

DATA = Path(__file__).parent.parent / "data" / "ort_logs"


def _events(name: str) -> list[tuple[str, str]]:
    lines = (DATA / name).read_text().splitlines()
    return [(e.kind, e.detail) for e in classify(lines)]


def test_default_fallback_run_names_the_missing_libraries_and_the_fallback() -> None:
    events = _events("trt_cuda_default_fallback.txt")
    assert ("provider_library_missing", "libcublas.so.13") in events
    assert ("provider_library_missing", "libcublasLt.so.13") in events
    assert ("provider_creation_failed", "CUDAExecutionProvider") in events
    assert ("cpu_fallback", "['CUDAExecutionProvider', 'CPUExecutionProvider']") in events


def test_enable_fallback_0_raises_with_only_the_library_line() -> None:
    assert _events("trt_cuda_enable_fallback_0.txt") == [("provider_library_missing", "libcublas.so.13")]


def test_cuda_only_with_cpu_fallback_disabled() -> None:
    events = _events("cuda_only_disable_cpu_fallback.txt")
    assert events == [("provider_library_missing", "libcublasLt.so.13"),
                      ("provider_creation_failed", "CUDAExecutionProvider")]


def test_unrelated_lines_are_not_events() -> None:
    assert classify(["INFO: Started server process", "", "random text"]) == []


def test_stderr_tee_passes_output_through_and_classifies_lines_after_boot(capfd: object) -> None:
    import os
    import time

    from engines.runtime.ortlog import StderrTee

    tee = StderrTee()
    tee.start()
    try:
        line = (DATA / "trt_cuda_default_fallback.txt").read_text().splitlines()[3]  # "Falling back to [...]"
        os.write(2, (line + "\n").encode())
        os.write(2, b"an ordinary line\n")
        deadline = time.monotonic() + 5
        events = []
        while not events and time.monotonic() < deadline:
            events = tee.drain()
            time.sleep(0.01)
    finally:
        tee.stop()
    assert [e.kind for e in events] == ["cpu_fallback"]
    assert "an ordinary line" in capfd.readouterr().err  # type: ignore[attr-defined]

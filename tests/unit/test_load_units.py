"""Contention read from /proc (a scripted /proc tree), admission by cost, and the edge's small guards: relative
redirects, escaped log text, bounded option errors."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from engines.errors import InvalidRequestError
from server.a1111_options import OptionsStore
from server.admission import Cost, CostModel, admit
from server.cli.main import TEXT_FORMAT, TextFormatter
from server.contention import ContentionProbe, ContentionThresholds, explanations
from server.errors import QueueFullError
from server.middleware import relative_location
from tests.unit.fakes import FakeEngine


def _proc(root: Path, psi_us: int, steal: int, total_other: int, load: float) -> None:
    (root / "pressure").mkdir(parents=True, exist_ok=True)
    (root / "pressure" / "cpu").write_text(f"some avg10=1.00 avg60=1.00 avg300=1.00 total={psi_us}\n"
                                           "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    (root / "stat").write_text(f"cpu  {total_other} 0 0 0 0 0 0 {steal} 0 0\ncpu0 1 0 0 0 0 0 0 0 0 0\n")
    (root / "loadavg").write_text(f"{load} 1.00 1.00 3/100 42\n")


def test_contention_is_the_delta_of_the_kernel_counters_over_the_window(tmp_path: Path) -> None:
    probe = ContentionProbe(lambda: 3, root=tmp_path)
    _proc(tmp_path, psi_us=0, steal=0, total_other=1000, load=0.0)
    start = probe.read()
    # 10 s of stall: more than the real window of this test, so the share is capped at 100%
    _proc(tmp_path, psi_us=10_000_000, steal=50, total_other=1450, load=4.0 * probe.cpus)
    c = probe.since(start)
    assert c.cpu_pressure_percent == 100.0  # capped: the fake stall exceeds the real (tiny) window
    assert c.steal_percent == pytest.approx(10.0)  # 50 of 500 ticks
    assert c.load_per_cpu == pytest.approx(4.0) and c.gpu_other_processes == 3
    found = explanations(c, ContentionThresholds())
    assert any("CPU pressure" in f for f in found) and any("steal" in f for f in found)
    assert any("3 other process" in f for f in found)


def test_missing_kernel_files_are_unknown_not_zero(tmp_path: Path) -> None:
    probe = ContentionProbe(None, root=tmp_path / "absent")
    c = probe.since(probe.read())
    assert (c.cpu_pressure_percent, c.steal_percent, c.load_per_cpu, c.gpu_other_processes) == (None,) * 4
    assert explanations(c, ContentionThresholds()) == []


def test_cost_model_estimates_from_measured_shape_and_scales_unmeasured_ones() -> None:
    model = CostModel()
    assert model.estimate(Cost(64, 64, 20, 1)) is None  # nothing measured: nothing refused on a guess
    model.seed(64, 64, 2, 8, 0.16)  # 10 ms per image-step
    assert model.estimate(Cost(64, 64, 20, 3)).seconds == pytest.approx(0.6)  # type: ignore[union-attr]
    scaled = model.estimate(Cost(512, 512, 50, 4))
    assert scaled is not None and scaled.seconds == pytest.approx(0.01 * 64 * 200) and "scaled" in scaled.basis
    model.observe(Cost(512, 512, 10, 1), 20.0)  # live: 2 s per image-step at 512x512
    assert model.estimate(Cost(512, 512, 50, 4)).seconds == pytest.approx(400.0)  # type: ignore[union-attr]


def test_admission_refuses_what_cannot_finish_alone_and_sheds_what_cannot_finish_behind_the_queue() -> None:
    model = CostModel()
    model.seed(64, 64, 1, 10, 1.0)  # 0.1 s per image-step
    with pytest.raises(InvalidRequestError, match=r"estimated compute 20\.0s .* exceeds the request deadline 10\.0s"):
        admit(model, [Cost(64, 64, 50, 4)], 0.0, 10.0, "x-sdserve-timeout-s")
    with pytest.raises(QueueFullError) as shed:
        admit(model, [Cost(64, 64, 10, 1)], 30.0, 10.0, "queue.request_timeout_s")
    assert shed.value.retry_after == 30
    admit(model, [Cost(64, 64, 10, 1)] * 4, 5.0, 10.0, "queue.request_timeout_s")  # 4 s + 5 s ahead fits


def test_redirects_never_name_a_host() -> None:
    assert relative_location("http://evil.example.com/ready") == "/ready"
    assert relative_location("https://evil.example.com:8443/a/b?x=1") == "/a/b?x=1"
    assert relative_location("http://evil.example.com") == "/"
    assert relative_location("//evil.example.com/x") == "/evil.example.com/x"
    assert relative_location("/ready") == "/ready"


def test_text_log_lines_escape_control_characters() -> None:
    record = logging.LogRecord("sdserve.access", logging.INFO, __file__, 1, "GET %s 404",
                               ("/health\n2026-12-01 INFO sdserve.access: FORGED\r\x1b[31m",), None)
    line = TextFormatter(TEXT_FORMAT).format(record)
    assert "\n" not in line and "\r" not in line and "\x1b" not in line
    assert "/health\\x0a2026-12-01 INFO sdserve.access: FORGED\\x0d\\x1b[31m" in line


def test_option_errors_are_bounded_however_many_keys_are_refused() -> None:
    engine = FakeEngine()
    engine.load()
    body = {f"unknown_{i}": i for i in range(900)}
    with pytest.raises(InvalidRequestError) as refused:
        OptionsStore().check(body, engine.info)
    message = refused.value.message
    assert len(message) < 3000 and "900 refused key(s) in all" in message
    assert message.count("sdserve supports") == 1 and refused.value.param == "unknown_0"

"""Shared fixtures: the tiny model built once per test session, from the same code `make run` uses."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

_PROOF: Counter[str] = Counter()
"""Outcomes of the tests marked plugin_ep (the accelerator proof), for the summary at the end."""


def pytest_report_header(config: pytest.Config) -> list[str]:
    """The machine facts that change results, at the top of the run: a red run on one machine and a green one on
    another read apart at once."""
    from tests.plugin_ep import header_lines

    return header_lines()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if "plugin_ep" in report.keywords and (report.when == "call" or report.outcome != "passed"):
        _PROOF[report.outcome] += 1


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    from tests.plugin_ep import accelerator

    if not _PROOF:
        terminalreporter.write_line("accelerator proof: NOT run (no plugin_ep test was selected)", yellow=True)
        return
    counts = ", ".join(f"{n} {outcome}" for outcome, n in sorted(_PROOF.items()))
    try:
        how = accelerator().how
    except (AssertionError, ImportError, OSError) as exc:
        how = f"nothing ({exc})"
    terminalreporter.write_line(f"accelerator proof: {counts}; ran on {how}",
                                green=set(_PROOF) == {"passed"}, red="failed" in _PROOF)


@pytest.fixture(scope="session")
def tiny_build(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(ONNX folder, diffusers folder) of the tiny model with identical weights."""
    from engines.build.tiny import build_tiny

    root = tmp_path_factory.mktemp("tiny")
    onnx_dir, diffusers_dir = root / "onnx", root / "diffusers"
    build_tiny(onnx_dir, diffusers_out=diffusers_dir)
    return onnx_dir, diffusers_dir


@pytest.fixture(scope="session")
def tiny_model(tiny_build: tuple[Path, Path]) -> Path:
    return tiny_build[0]


@pytest.fixture(scope="session")
def openvino_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the tiny model with OpenVINO EP-context artifacts, built by a real `sdserve engines build --profile
    openvino` process (tests/plugin_ep.py); the tests that change it work on their own copies."""
    from tests.plugin_ep import build_artifacts

    return build_artifacts(tiny_model, tmp_path_factory.mktemp("openvino") / "model")


@pytest.fixture(scope="session")
def dit_build(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Path]]:
    """(ONNX folder, diffusers folder) of a tiny DiT family (flux, flux-schnell, sd3, sd35), built once per test
    session on first use: parity tests and served-model tests share them. Every family but flux-schnell has its VAE
    encoder (img2img); flux-schnell's folder is the txt2img-only one (tests/integration/test_dit_parity.py)."""
    from engines.build.dit import build_tiny_dit

    built: dict[str, tuple[Path, Path]] = {}

    def build(family: str) -> tuple[Path, Path]:
        if family not in built:
            root = tmp_path_factory.mktemp(family)
            build_tiny_dit(family, root / "onnx", diffusers_out=root / "diffusers",
                           vae_encoder=family != "flux-schnell")
            built[family] = (root / "onnx", root / "diffusers")
        return built[family]

    return build

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


def _snapshot(folder: Path) -> tuple[tuple[str, int, int], ...]:
    """Every file under ``folder`` with its size and modification time: a folder a test wrote into reads apart."""
    return tuple((p.relative_to(folder).as_posix(), p.stat().st_size, p.stat().st_mtime_ns)
                 for p in sorted(folder.rglob("*")))


class TinyFolders:
    """The ONNX folders of tiny models built so far this session, each with what `sdserve engines tiny --family F`
    builds: the builds are seeded and the diffusers twin does not change the export (the same bytes), so one
    family's folder serves every test that only reads it. A folder is handed out again only while unchanged."""

    def __init__(self) -> None:
        self.built: dict[str, tuple[Path, tuple[tuple[str, int, int], ...]]] = {}
        """family -> (its ONNX folder, the snapshot taken when it was built)."""

    def add(self, family: str, folder: Path) -> None:
        self.built.setdefault(family, (folder, _snapshot(folder)))

    def get(self, family: str) -> Path | None:
        folder, snapshot = self.built.get(family, (None, ()))
        return folder if folder is not None and _snapshot(folder) == snapshot else None


@pytest.fixture(scope="session")
def tiny_folders() -> TinyFolders:
    return TinyFolders()


@pytest.fixture(scope="session")
def tiny_family(tiny_folders: TinyFolders, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The ONNX folder `sdserve engines tiny --family F` builds (in process, as `make refs` does), built once per
    session on first use, or the same export a session fixture (``tiny_build``, ``dit_build``) already made. Read
    only: a test that changes a model works on its own copy."""
    from server.cli import matrix

    def build(family: str) -> Path:
        folder = tiny_folders.get(family)
        if folder is None:
            folder = matrix.tiny_folders(tmp_path_factory.mktemp(f"tiny-{family}"), (family,))[family]
            tiny_folders.built[family] = (folder, _snapshot(folder))
        return folder

    return build


@pytest.fixture(scope="session")
def tiny_build(tmp_path_factory: pytest.TempPathFactory, tiny_folders: TinyFolders) -> tuple[Path, Path]:
    """(ONNX folder, diffusers folder) of the tiny model with identical weights."""
    from engines.build.tiny import build_tiny

    root = tmp_path_factory.mktemp("tiny")
    onnx_dir, diffusers_dir = root / "onnx", root / "diffusers"
    build_tiny(onnx_dir, diffusers_out=diffusers_dir)
    tiny_folders.add("sd1", onnx_dir)
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
def dit_build(tmp_path_factory: pytest.TempPathFactory,
              tiny_folders: TinyFolders) -> Callable[[str], tuple[Path, Path]]:
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
            if family != "flux-schnell":  # `engines tiny` exports every family's VAE encoder
                tiny_folders.add(family, root / "onnx")
        return built[family]

    return build

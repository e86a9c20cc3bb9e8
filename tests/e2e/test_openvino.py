"""`sdserve serve --profile openvino`: the tiny model served by OpenVINO's plugin EP from EP-context artifacts built
in another folder and moved (no rebuild: the artifact folder is byte- and mtime-identical after boot and serving),
every node on the EP, the self-test and the watchdog's canaries running on it, a blob tampered while serving
turning /ready 503 naming the file."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import ServerProcess
from tests.plugin_ep import ARTIFACTS, EP, listing, profile

pytestmark = pytest.mark.plugin_ep
FAST_WATCHDOG = {"interval_s = 5.0": "interval_s = 0.3", "idle_before_canary_s = 1.0": "idle_before_canary_s = 0.1"}


@pytest.fixture(scope="module")
def moved(openvino_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private copy of the built folder (the session's build is shared), then moved: renamed to another root."""
    staged = tmp_path_factory.mktemp("built") / "model"
    shutil.copytree(openvino_model, staged)
    dest = tmp_path_factory.mktemp("moved") / "served-model"
    staged.rename(dest)
    assert not staged.exists()
    return dest


@pytest.fixture(scope="module")
def before(moved: Path) -> dict[str, tuple[str, int]]:
    return listing(moved / ARTIFACTS)


@pytest.fixture(scope="module")
def server(moved: Path, before: dict[str, tuple[str, int]],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    config = profile(tmp_path_factory.mktemp("profile"), FAST_WATCHDOG)
    process = ServerProcess("--config", str(config), "--model", str(moved))
    try:
        process.wait_ready(timeout=120)
        yield process
    finally:
        process.stop()


def test_generation_runs_on_openvino(server: ServerProcess) -> None:
    url = server.url
    assert httpx.get(f"{url}/ready").status_code == 200
    response = httpx.post(f"{url}/v1/images/generations", json={"prompt": "a lighthouse", "size": "64x64",
                                                              "steps": 4}, timeout=120)
    assert response.status_code == 200, response.text
    assert response.headers["x-sdserve-provider"] == EP


def test_capabilities_show_every_node_on_the_ep(server: ServerProcess, moved: Path) -> None:
    caps = httpx.get(f"{server.url}/capabilities").json()
    assert caps["accelerated"] is True and caps["verdict"]["status"] == "pass"
    assert caps["policy"]["plugin"]["name"] == EP and caps["policy"]["providers"] == []
    placement = caps["placement_summary"]
    assert placement["unet@64x64"]["nodes_by_provider"] == {EP: 1}  # the EPContext node
    assert all(set(p["nodes_by_provider"]) == {EP} for p in placement.values()), placement
    engines = caps["artifacts"]["engines"]
    assert engines["path"] == str(moved / ARTIFACTS)
    assert set(engines["build_placement"]["unet"]) == {EP} and engines["build_placement"]["unet"][EP] > 1000
    plugin = caps["observations"]["plugin"]
    assert plugin["package"] == "onnxruntime-ep-openvino" and plugin["package_version"] == "1.8.1"
    assert plugin["library_version"].startswith("1.8.1") and Path(plugin["library"]).is_file()
    assert caps["observations"]["provider_libraries"][EP]["missing"] == {}
    assert caps["self_test"]["passed"] is True


def test_watchdog_canaries_run_on_the_ep(server: ServerProcess) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        watchdog = httpx.get(f"{server.url}/capabilities").json()["watchdog"]
        if "canary" in watchdog["last"] and watchdog["checks"] >= 2:
            break
        time.sleep(0.1)
    assert "canary" in watchdog["last"], watchdog
    assert watchdog["active"] == {}, watchdog


def test_no_rebuild_after_moving_and_serving(server: ServerProcess, moved: Path,
                                             before: dict[str, tuple[str, int]]) -> None:
    assert httpx.post(f"{server.url}/v1/images/generations", json={"prompt": "a boat", "size": "64x64",
                                                                   "steps": 2}, timeout=120).status_code == 200
    assert listing(moved / ARTIFACTS) == before


def test_blob_tampered_while_serving_turns_ready_503(server: ServerProcess, moved: Path) -> None:
    """Last in the module: it breaks the served copy. The blob is replaced (a new file renamed over it, as a deploy
    does), not rewritten in place: OpenVINO maps the blob into memory, and an in-place rewrite changes the weights of
    the live compiled model under it (seen here: Reshape errors, then SIGSEGV, exit 139); mount artifacts read-only."""
    blob = moved / ARTIFACTS / "64x64" / f"unet_ctx_{EP}.bin"
    replacement = blob.with_suffix(".new")
    replacement.write_bytes(blob.read_bytes()[::-1])
    replacement.replace(blob)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and httpx.get(f"{server.url}/ready").status_code == 200:
        time.sleep(0.1)
    ready = httpx.get(f"{server.url}/ready")
    assert ready.status_code == 503
    assert f"unet_ctx_{EP}.bin" in ready.text

"""The TensorRT build estimate of a DiT folder (engines/health/build_memory.py) from the released Qwen-Image configs
(tests/data/qwen_image_configs.json: a config-only folder, the 20,430,401,088-parameter transformer), and
`sdserve engines build` refusing by name before it starts on a node that cannot hold it (server/cli/engines.py):
only the node's RAM and disk readings are replaced."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engines.errors import ArtifactError
from engines.health import build_memory as bm
from engines.health.memory_plan import OVERHEAD
from server.cli.engines import _require_node_holds

RELEASED = json.loads((Path(__file__).resolve().parents[1] / "data" / "qwen_image_configs.json").read_text())
TRANSFORMER, TEXT = 20_430_401_088, 7_070_619_136
"""The released transformer's and Qwen2.5-VL language model's parameters (tests/unit/test_qwen_memory.py counts
them with torch)."""
GIB = 1 << 30


@pytest.fixture
def qwen(tmp_path: Path) -> Path:
    folder = tmp_path / "qwen-image"
    for rel, body in RELEASED["qwen-image"].items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(json.dumps(body), encoding="utf-8")
    return folder


def test_the_estimate_from_the_parameter_counts(qwen: Path) -> None:
    """bf16 engines (the registry's, no export yet), the transformer's build sets the peaks: host = the fp32 export
    it reads (4 B/param) + 2 x the 2 B/param engine + the overhead; every size adds all engines on disk."""
    found = bm.estimate(qwen, 3)
    assert found.engines["transformer"] == 2 * TRANSFORMER and found.engines["text_encoder"] == 2 * TEXT
    assert set(found.precision.values()) == {"bf16"} and found.largest == "transformer"
    assert found.host_peak == 4 * TRANSFORMER + 2 * 2 * TRANSFORMER + OVERHEAD
    assert found.device_build_peak == 2 * 2 * TRANSFORMER + OVERHEAD
    assert found.disk_per_size == sum(found.engines.values()) and found.disk_total == 3 * found.disk_per_size
    assert 38 * GIB < found.engines["transformer"] < 38.1 * GIB  # the 38 GiB
    assert any(line.startswith("  host RAM peak while building (transformer): 154.") for line in found.lines())


def _node(monkeypatch: pytest.MonkeyPatch, ram: int, disk: int) -> None:
    monkeypatch.setattr(bm, "host_memory", lambda: (ram, "physical memory"))
    monkeypatch.setattr(bm, "free_disk", lambda folder: disk)


def test_a_node_without_the_host_ram_is_refused_by_name(qwen: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _node(monkeypatch, 128 * GIB, 4096 * GIB)
    with pytest.raises(ArtifactError) as err:
        _require_node_holds(qwen, 2)
    text = str(err.value)
    assert "TensorRT build of qwen-image refused before starting" in text
    assert "the build of transformer peaks at about 154.22 GiB, this node has 128.00 GiB (physical memory)" in text
    assert "disk" not in text.split("(estimates")[0]


def test_a_node_without_the_disk_is_refused_with_the_numbers(qwen: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _node(monkeypatch, 512 * GIB, 100 * GIB)
    per_size = bm.estimate(qwen, 2).disk_per_size
    with pytest.raises(ArtifactError) as err:
        _require_node_holds(qwen, 2)
    assert f"disk: 2 size(s) x {per_size / GIB:.2f} GiB of engines = {2 * per_size / GIB:.2f} GiB" in str(err.value)
    assert "100.00 GiB free" in str(err.value) and "host RAM" not in str(err.value).split("(estimates")[0]


def test_a_node_that_holds_it_builds(qwen: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _node(monkeypatch, 512 * GIB, 4096 * GIB)
    _require_node_holds(qwen, 2)  # no refusal


def test_the_unet_families_are_not_estimated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only DiT folders: SD 1.5 (its released configs, tests/data/model_configs.json) whatever the readings say."""
    configs = json.loads((Path(__file__).resolve().parents[1] / "data" / "model_configs.json").read_text())
    for rel, body in configs["sd15"].items():
        (tmp_path / "sd15" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "sd15" / rel).write_text(json.dumps(body), encoding="utf-8")
    _node(monkeypatch, 0, 0)
    _require_node_holds(tmp_path / "sd15", 1)


def test_the_node_readings_are_real(tmp_path: Path) -> None:
    ram, source = bm.host_memory()
    assert ram > 0 and source in ("physical memory", "the container's cgroup memory.max")
    assert bm.free_disk(tmp_path) > 0

"""`sdserve engines tiny --family qwen-image-edit --variant 2511`: the released 2511 configuration in miniature (the
transformer's ``zero_cond_t`` on, its graph taking ``modulate_index``), served by the same family as 2509
(engines/pipelines/qwen_edit.py); a variant no family has is refused naming the ones that exist."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import onnx

ROOT = Path(__file__).resolve().parents[2]


def _tiny(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "server.cli", "engines", "tiny", "--out", str(out), *args],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)


def test_the_2511_variant_is_built_with_zero_cond_t_and_its_index_input(tmp_path: Path) -> None:
    done = _tiny(tmp_path / "edit-2511", "--family", "qwen-image-edit", "--variant", "2511")
    assert done.returncode == 0, done.stderr[-2000:]
    config = json.loads((tmp_path / "edit-2511" / "transformer" / "config.json").read_text())
    assert config.get("zero_cond_t") is True
    graph = onnx.load(str(tmp_path / "edit-2511" / "transformer" / "model.onnx"), load_external_data=False).graph
    assert "modulate_index" in {i.name for i in graph.input}


def test_an_unknown_variant_is_refused_naming_what_exists(tmp_path: Path) -> None:
    for family, variant in (("qwen-image-edit", "2512"), ("sd1", "2511")):
        done = _tiny(tmp_path / "x", "--family", family, "--variant", variant)
        assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
        assert "2511" in done.stderr and "variant" in done.stderr, done.stderr[-2000:]
        assert not (tmp_path / "x" / "model_index.json").exists()

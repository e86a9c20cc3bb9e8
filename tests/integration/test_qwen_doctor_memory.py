"""`sdserve doctor` prints the memory plan of a Qwen-Image folder that holds only the released config files
(tests/data/qwen_image_configs.json): the 20B transformer and the 7B Qwen2.5-VL language model at the released
bf16 under TensorRT, sized from their configs (engines/health/memory_plan.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RELEASED = json.loads((ROOT / "tests" / "data" / "qwen_image_configs.json").read_text())["qwen-image"]


def test_doctor_prints_the_plan_of_a_config_only_qwen_folder(tmp_path: Path) -> None:
    folder = tmp_path / "qwen-image"
    for rel, body in RELEASED.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(json.dumps(body), encoding="utf-8")
    done = subprocess.run([sys.executable, "-m", "server.cli", "doctor", "--model", str(folder), "--plan-size",
                           "1024x1024", "--plan-images", "1", "--device-memory-gib", "80"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode != 0, done.stdout  # nothing to load: the boot checks fail as before
    out = done.stdout
    assert "memory plan — qwen-image (qwen-image), 1024x1024, 1 image(s) per batch (2 rows), TensorRT" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("  ") and " config " in line}
    assert rows["transformer"][1:6] == ["config", "20.430", "B", "bf16", "38.05"]
    assert rows["text_encoder"][1:6] == ["config", "7.071", "B", "bf16", "13.17"]
    assert re.search(r"device without LoRA: [0-9.]+ GiB .* fits in 80\.00 GiB \(--device-memory-gib\)", out), out
    assert re.search(r"device with LoRA on the transformer: [0-9.]+ GiB  DOES NOT FIT in 80\.00 GiB", out), out

"""`sdserve bench` against a real server, and `sdserve gate` on its output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "server.cli", *args], capture_output=True, text=True, timeout=180)


def test_bench_writes_levels_fingerprints_and_plot_and_gate_judges_it(dev_server: str, tmp_path: Path) -> None:
    out, plot = tmp_path / "a.json", tmp_path / "a.png"
    done = _cli("bench", "--url", dev_server, "--concurrency", "1,4", "--requests", "8", "--steps", "2",
                "--out", str(out), "--plot", str(plot))
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert [lv["concurrency"] for lv in result["levels"]] == [1, 4]
    assert all(lv["ok"] + lv["rejected_429"] + lv["errors"] == lv["requests"] == 8 for lv in result["levels"])
    assert all(lv["errors"] == 0 and lv["p95_s"] > 0 for lv in result["levels"])
    assert len(result["fingerprints"]) == 4
    assert result["capabilities"]["providers"]["unet"] == ["CPUExecutionProvider"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    same = _cli("gate", "--baseline", str(out), "--candidate", str(out))
    assert same.returncode == 0 and "no regression" in same.stdout
    worse = json.loads(out.read_text())
    worse["levels"][1]["p95_s"] *= 3
    worse["capabilities"]["providers"]["unet"] = ["SomethingElse"]
    (tmp_path / "b.json").write_text(json.dumps(worse))
    regressed = _cli("gate", "--baseline", str(out), "--candidate", str(tmp_path / "b.json"))
    assert regressed.returncode == 30, regressed.stdout
    assert "c=4 p95 latency" in regressed.stdout and "REGRESSION" in regressed.stdout

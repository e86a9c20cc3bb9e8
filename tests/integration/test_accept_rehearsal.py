"""`sdserve accept` rehearsed end to end on the openvino profile (a real accelerator EP on the CPU): build the
EP-context artifacts in a copy, move it, boot strictly from the prebuilt artifacts, doctor, placement from the
sessions that served, the 10-job protocol, signature, parity, latency and both reports, as a real subprocess.
The CUDA-only steps say "not applicable" with their reason, never "pass". The baseline given is far off, so the
one failing section is a parity miss (exit 30); the other failures (a wrong artifact, a build that wrote nothing, a
budget spent) are shown in tests/unit/test_accept_steps.py and tests/unit/test_gpu_path.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engines.accept.report import SECTIONS, STEP_BUDGETS_S, validate
from server.exitcodes import ExitCode
from tests.plugin_ep import EP, profile, sdserve

pytestmark = pytest.mark.plugin_ep

APPLICABLE = ("doctor", "boots", "placement", "relocation", "protocol", "parity", "latency")
CUDA_ONLY = ("staging", "copies", "signature")


def test_accept_runs_end_to_end_on_the_openvino_profile(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    baseline = tmp_path / "baseline.toml"
    baseline.write_text(f'["{EP} CPU"]\njobs_per_hour = 1.0\n')  # no node is this slow: a parity miss
    done = sdserve("accept", "--config", str(profile(tmp_path)), "--model", str(tiny_model), "--out", str(out),
                   "--size", "64", "--steps", "4", "--skip-torch-reference", "--baseline", str(baseline),
                   timeout=600)
    assert done.returncode == ExitCode.GATE_REGRESSION, done.stderr[-3000:]
    report = json.loads((out / "accept_report.json").read_text())
    assert validate(report) == []
    sections = report["verdict"]["sections"]
    assert report["verdict"]["failing"] == ["parity"] and report["parity"]["status"] == "above_band"
    assert {name: sections[name] for name in APPLICABLE if name != "parity"} == dict.fromkeys(
        (n for n in APPLICABLE if n != "parity"), True)
    for name in CUDA_ONLY:  # not this EP's: said so, with the reason, never ok
        assert sections[name] is None and report[name]["state"] == "not applicable" and report[name]["reason"]
    assert report["relocation"]["moved_to"].endswith("accepted") and not report["relocation"]["engine_built_on_load"]
    # Relocation by hard links (no copy of the weights), and a user's model without fingerprints accepted by
    # recording them in the accept work folder, said in the notes, the user's folder left as it was.
    moved = Path(report["relocation"]["moved_to"])
    assert (moved / "unet" / "model.onnx").stat().st_ino == (tiny_model / "unet" / "model.onnx").stat().st_ino
    assert any(n.startswith("relocation: ") and "files hard-linked" in n and not n.startswith("relocation: 0 ")
               for n in report["notes"]), report["notes"]
    assert any("has no selftest.json" in n for n in report["notes"]), report["notes"]
    assert (moved / "selftest.json").is_file() and not (tiny_model / "selftest.json").exists()
    assert all(p["gpu_nodes"] > 0 and EP in p["providers"] for p in report["placement"])
    assert report["protocol"]["stats"]["count"] == 10 and report["protocol"]["stats"]["all_ok"]
    steps = {s["step"]: s for s in report["steps"]}
    assert set(steps) == set(STEP_BUDGETS_S) == set(SECTIONS) - {"doctor"} | {"model"}
    assert {s["state"] for n, s in steps.items() if n in CUDA_ONLY} == {"not applicable"}
    assert all(s["seconds"] <= s["budget_s"] for s in steps.values())
    markdown = (out / "accept_report.md").read_text()
    assert "# sdserve accept: FAIL (parity)" in markdown and "| staging | n/a | not applicable: " in markdown
    assert "| Step | Seconds | Budget (s) | State |" in markdown and "| 300 | not applicable |" in markdown

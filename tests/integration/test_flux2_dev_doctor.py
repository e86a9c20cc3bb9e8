"""`sdserve doctor` on a config-only FLUX.2 [dev] folder at the released configuration (diffusers'
``Flux2Transformer2DModel`` defaults: 32,223,281,152 parameters; transformers' ``Mistral3Config`` defaults, read as
far as ``Flux2Pipeline`` reads them: 17,343,754,240): the honest answer on an 80 GB card in bf16 is that it does not
fit, with what would (engines/health/fit_advice.py from the memory plan's own numbers), instead of an out-of-memory
error at boot. The budget is given as 80 GiB, more than an 80 GB card's NVML reading: what does not fit it does not
fit the card."""

from __future__ import annotations

import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from engines.build.flux2 import SCHEDULER

ROOT = Path(__file__).resolve().parents[2]
TRANSFORMER_PARAMS = 32_223_281_152
TEXT_PARAMS = 17_343_754_240
GIB = 1 << 30


@pytest.fixture(scope="module")
def flux2_dev(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel
    from transformers import Mistral3Config

    def defaults(cls: type) -> dict[str, object]:
        return {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items() if k != "self"}

    folder = tmp_path_factory.mktemp("configs") / "flux2-dev"
    files = {"model_index.json": {"_class_name": "Flux2Pipeline"},
             "transformer/config.json": {"_class_name": "Flux2Transformer2DModel",
                                         **defaults(Flux2Transformer2DModel)},
             "vae/config.json": {"_class_name": "AutoencoderKLFlux2", **defaults(AutoencoderKLFlux2)},
             "text_encoder/config.json": Mistral3Config().to_dict(),
             "scheduler/scheduler_config.json": {"_class_name": "FlowMatchEulerDiscreteScheduler", **SCHEDULER}}
    for rel, body in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(json.dumps(body), encoding="utf-8")
    return folder


def _doctor(model: Path, gib: float, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "server.cli", "doctor", "--model", str(model), "--plan-size",
                           "1024x1024", "--plan-images", "1", "--device-memory-gib", str(gib), *args],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_an_80_gb_card_is_told_it_does_not_fit_and_what_would(flux2_dev: Path) -> None:
    done = _doctor(flux2_dev, 80)
    out = done.stdout
    assert "memory plan — flux2-dev (flux2-dev), 1024x1024" in out, out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("  text_encoder ")
            or line.startswith("  transformer ")}
    assert rows["transformer"][1:6] == ["config", "32.223", "B", "bf16", "60.02"]  # 2 bytes x 32.2 B
    assert rows["text_encoder"][1:6] == ["config", "17.344", "B", "bf16", "32.31"]  # layers 1-30 of Mistral
    assert re.search(r"device without LoRA: 10[0-9]\.\d\d GiB .* DOES NOT FIT in 80\.00 GiB", out), out
    assert "does not fit: the plan needs" in out and "what would fit:" in out
    assert "- a bigger card: " in out and "fits a 141 GB card (H200)" in out
    second = re.search(r"- the text encoder on a second device: this device needs ([0-9.]+) GiB \(fits", out)
    assert second and float(second.group(1)) < 80, out
    assert re.search(r"- a lower precision: the transformer in fp8 .*: ([0-9.]+) GiB \(fits", out), out


def test_the_json_plan_carries_the_counts_and_the_advice(flux2_dev: Path) -> None:
    plan = json.loads(_doctor(flux2_dev, 80, "--json").stdout)["memory_plan"]
    parts = {c["name"]: c for c in plan["components"]}
    assert parts["transformer"]["params"] == TRANSFORMER_PARAMS
    assert parts["text_encoder"]["params"] == TEXT_PARAMS
    assert (parts["transformer"]["weights"], parts["text_encoder"]["weights"]) == (2 * TRANSFORMER_PARAMS,
                                                                                   2 * TEXT_PARAMS)
    base = plan["device"]["verdicts"]["base"]
    assert not base["fits"] and base["need"] > 2 * (TRANSFORMER_PARAMS + TEXT_PARAMS)  # ~99 GB of weights alone
    advice = plan["advice"]
    assert advice[0].startswith("does not fit") and any("141 GB card (H200)" in line for line in advice)
    moved = 2 * TEXT_PARAMS + parts["text_encoder"]["activations"]
    assert f"this device needs {(base['need'] - moved) / GIB:.2f} GiB" in "\n".join(advice)


def test_a_141_gb_card_fits_and_gets_no_advice(flux2_dev: Path) -> None:
    plan = json.loads(_doctor(flux2_dev, 141, "--json").stdout)["memory_plan"]
    assert plan["device"]["verdicts"]["base"]["fits"] and plan["advice"] == []


def test_the_boot_refuses_it_on_an_80_gb_card_before_a_session_is_built(flux2_dev: Path) -> None:
    """engines/engine.py ``load`` calls engines/health/boot_fit.py ``require_fits`` with NVML's reading of the served
    device before any session: on 80 GB (decimal, the card's marketed size) the production policy's plan for one
    image is refused with its numbers and what would fit, never an out-of-memory halfway through the load; on
    141 GB it passes; with the device's memory unknown (CPU) nothing is checked."""
    from engines.errors import ModelLoadError
    from engines.health.boot_fit import require_fits
    from server.settings import load_settings

    runtime = load_settings("production").runtime
    with pytest.raises(ModelLoadError) as refused:
        require_fits(flux2_dev, runtime, 80 * 10**9, "CUDA device 0")
    said = str(refused.value)
    need = float(re.search(r"needs ([0-9.]+) GiB for one 512x512 image", said).group(1))  # type: ignore[union-attr]
    assert need > 2 * (TRANSFORMER_PARAMS + TEXT_PARAMS) / GIB, said  # the bf16 weights alone pass 80 GB
    assert "the device has 74.51 GiB" in said and "flux2-dev" in said, said
    assert "141 GB card (H200)" in said and "text encoder on a second device" in said and "fp8" in said, said
    require_fits(flux2_dev, runtime, 141 * 10**9, "CUDA device 0")
    require_fits(flux2_dev, runtime, None, "")

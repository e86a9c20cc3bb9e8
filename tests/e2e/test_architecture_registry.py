"""An architecture added by one pipeline class and one registry row (engines/architectures.py), with its family row,
is detected and served by a real `sdserve serve` process, touching no production file: the recipe of
docs/architecture.md, "How to add an architecture". The class overrides one hook of the flow-matching base
(engines/pipelines/flow.py ``schedule``: the scheduler's own spacing instead of Flux's evenly spaced sigmas), and
the registration runs at interpreter start (a sitecustomize module on PYTHONPATH), as a row in
engines/architectures.py would."""

from __future__ import annotations

import base64
import io
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from engines.artifacts import read_manifest, write_model_manifest
from server.exitcodes import ExitCode
from tests.e2e.conftest import ServerProcess, dev_config

pytestmark = pytest.mark.slow
Builder = Callable[[str], tuple[Path, Path]]

REGISTRATION = """
import dataclasses

import engines.architectures as architectures
import engines.families as families
from engines.pipelines.flow import FlowPipeline
from engines.pipelines.flux import FluxPipeline


class DryFlux(FluxPipeline):
    def schedule(self, steps, h, w):  # the flow base's spacing, not Flux's evenly spaced sigmas
        return FlowPipeline.schedule(self, steps, h, w)


architectures.register(dataclasses.replace(
    architectures.get("flux"), name="flux-dry", classes=frozenset({"DryFluxPipeline"}),
    pipeline="sitecustomize:DryFlux"))
families.register(families.FamilyFacts(
    "flux-dry", ("flux-dry",), "transformer", 5, 3.5, "Flux.1 on the base schedule (a dry run of an architecture)",
    t5_length=256, own_defaults=True, trained_size=1024, distilled_guidance=True))
"""
REQUEST = {"prompt": "a red cube on a table", "size": "64x64", "seed": 7}
"""sdserve's OpenAI extension fields: a fixed seed, the tiny model's size."""


def _image(url: str) -> np.ndarray:
    response = httpx.post(f"{url}/v1/images/generations", json=REQUEST, timeout=120)
    assert response.status_code == 200, response.text
    data = base64.b64decode(response.json()["data"][0]["b64_json"])
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.int16)


def _served(model: Path, env: dict[str, str] | None = None) -> tuple[dict[str, object], np.ndarray]:
    server = ServerProcess("--profile", "dev", "--model", str(model), env=env)
    try:
        url = server.wait_ready(timeout=180)
        family = httpx.get(f"{url}/capabilities").json()["family"]
        return family, _image(url)
    finally:
        assert server.stop() == 0, server.log


def test_an_architecture_added_by_one_class_and_one_row_is_served(dit_build: Builder, tmp_path: Path) -> None:
    flux = dit_build("flux")[0]
    model = shutil.copytree(flux, tmp_path / "model")
    index = json.loads((model / "model_index.json").read_text())
    (model / "model_index.json").write_text(json.dumps({**index, "_class_name": "DryFluxPipeline"}))
    manifest = read_manifest(model / "manifest.json")
    write_model_manifest(model, {k: v for k, v in manifest.items() if k not in ("files", "format")})
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(REGISTRATION)
    root = Path(__file__).resolve().parents[2]

    family, dry = _served(model, env={"PYTHONPATH": f"{site}:{root}"})
    assert (family["family"], family["default_steps"]) == ("flux-dry", 5)
    _, plain = _served(flux)
    # the overridden hook ran: the same request and seed on the same weights, another schedule, another image
    assert np.abs(dry - plain).max() > 0
    # without the row the folder is no architecture sdserve serves: the boot refuses it (exit 11)
    profile = dev_config(tmp_path, replace={'on_boot_failure = "stay_unready"': 'on_boot_failure = "exit"'})
    done = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--port", "0", "--config", str(profile),
                           "--model", str(model)], capture_output=True, text=True, timeout=180)
    assert done.returncode == int(ExitCode.MODEL_INVALID), done.stderr[-3000:]

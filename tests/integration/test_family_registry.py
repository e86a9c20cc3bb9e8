"""A family added by one registry entry (engines/families.py) is detected and served by a real `sdserve serve`
process with its own facts, touching no other production file: the recipe of docs/architecture.md, "How to add a
family". The entry is registered at interpreter start (a sitecustomize module on PYTHONPATH), as a line in
engines/families.py would be."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest

from engines.artifacts import read_manifest, write_model_manifest
from tests.e2e.conftest import ServerProcess

pytestmark = pytest.mark.slow

REGISTRATION = """
import engines.families as families

families.register(families.FamilyFacts(
    "sd1-dry", ("sd1",), "unet", 3, 2.0, "SD 1.x under another name (a dry run of adding a family)",
    claim=lambda configs: configs.get("index", {}).get("sdserve_family") == "sd1-dry",
    own_defaults=True, a1111_config=lambda encoders, prediction: "sd1-dry.yaml"))
"""


def test_a_family_added_by_one_registry_entry_is_detected_and_served(tiny_model: Path, tmp_path: Path) -> None:
    model = shutil.copytree(tiny_model, tmp_path / "model")
    index = json.loads((model / "model_index.json").read_text())
    (model / "model_index.json").write_text(json.dumps({**index, "sdserve_family": "sd1-dry"}))
    manifest = read_manifest(model / "manifest.json")
    write_model_manifest(model, {k: v for k, v in manifest.items() if k not in ("files", "format")})
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(REGISTRATION)
    root = Path(__file__).resolve().parents[2]
    server = ServerProcess("--profile", "dev", "--model", str(model), env={"PYTHONPATH": f"{site}:{root}"})
    try:
        url = server.wait_ready(timeout=120)
        family = httpx.get(f"{url}/capabilities").json()["family"]
        assert (family["family"], family["default_steps"], family["default_guidance"]) == ("sd1-dry", 3, 2.0)
        models = httpx.get(f"{url}/sdapi/v1/sd-models").json()
        assert models[0]["config"] == "sd1-dry.yaml"
        response = httpx.post(f"{url}/v1/images/generations", json={"prompt": "a cat", "size": "64x64"}, timeout=120)
        assert response.status_code == 200, response.text
        assert response.json()["data"][0]["b64_json"]
    finally:
        assert server.stop() == 0, server.log
    # without the entry the same folder is plain SD 1.x: the registry, nothing else, made the family
    plain = ServerProcess("--profile", "dev", "--model", str(model))
    try:
        url = plain.wait_ready(timeout=120)
        assert httpx.get(f"{url}/capabilities").json()["family"]["family"] == "sd1"
    finally:
        assert plain.stop() == 0, plain.log

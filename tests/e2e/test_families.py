"""A real `sdserve serve` per family (the tiny SD 2.x, Turbo and SDXL builds; SD 1.x is every other e2e test's
model) answering the official openai client and webuiapi, with the family in /capabilities, /v1/models,
/sdapi/v1/sd-models and the boot log; and a folder of no served family refused at boot with exit 11, named."""

from __future__ import annotations

import base64
import io
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import onnx
import openai
import pytest
import webuiapi
from onnx import TensorProto, helper
from PIL import Image

from engines.artifacts import write_model_manifest
from engines.build.tiny import build_tiny
from server.exitcodes import ExitCode
from tests.e2e.conftest import ServerProcess, dev_config

A1111_CONFIG = {"sd2": "v2-inference-v.yaml", "turbo": "v2-inference.yaml", "sdxl": "sd_xl_base.yaml"}


@pytest.fixture(scope="module", params=["sd2", "turbo", "sdxl"])
def family_server(request: pytest.FixtureRequest,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, ServerProcess]]:
    family = str(request.param)
    model = build_tiny(tmp_path_factory.mktemp(family) / f"tiny-{family}", family=family)
    server = ServerProcess("--profile", "dev", "--model", str(model))
    try:
        yield family, server.wait_ready(timeout=180), server
    finally:
        assert server.stop() == 0, server.log


def test_family_is_reported_everywhere(family_server: tuple[str, str, ServerProcess]) -> None:
    family, url, server = family_server
    caps = httpx.get(f"{url}/capabilities").json()
    assert caps["family"]["family"] == family
    models = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0).models.list().data
    served = [m.to_dict() for m in models if m.id == f"tiny-{family}"]  # the others are the profile's aliases
    assert len(served) == 1
    listed = served[0]
    assert listed["family"] == family and listed["native_size"] == caps["family"]["native_size"]
    assert listed["text_encoders"] == (2 if family == "sdxl" else 1)
    assert listed["cfg_default"] is (family != "turbo")
    assert listed["vae_scaling_factor"] == (0.13025 if family == "sdxl" else 0.18215)
    assert listed["prediction_type"] == ("v_prediction" if family == "sd2" else "epsilon")
    assert httpx.get(f"{url}/sdapi/v1/sd-models").json()[0]["config"] == A1111_CONFIG[family]
    assert f"family {family} (base " in server.log  # the boot log names it


def test_openai_client_generates_at_the_native_size(family_server: tuple[str, str, ServerProcess]) -> None:
    family, url, _ = family_server
    size = httpx.get(f"{url}/capabilities").json()["family"]["native_size"]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    guidance = 0.0 if family == "turbo" else 5.0
    result = client.images.generate(prompt="a lighthouse at dusk", n=2, size=f"{size}x{size}",
                                    response_format="b64_json", extra_body={"steps": 2, "guidance_scale": guidance})
    images = [Image.open(io.BytesIO(base64.b64decode(d.b64_json or ""))) for d in result.data or []]
    assert [im.size for im in images] == [(size, size)] * 2
    assert images[0].tobytes() != images[1].tobytes()  # seeds seed+0, seed+1


def test_webuiapi_txt2img_non_square(family_server: tuple[str, str, ServerProcess]) -> None:
    family, url, _ = family_server
    host, port = url.removeprefix("http://").split(":")
    api = webuiapi.WebUIApi(host=host, port=int(port), sampler="Euler a", steps=2)
    result = api.txt2img(prompt="a red cube", width=64, height=96, cfg_scale=0 if family == "turbo" else 6,
                         seed=7)
    assert result.image.size == (64, 96)


def test_folder_of_no_served_family_exits_11_naming_what_it_found(tiny_model: Path, tmp_path: Path) -> None:
    """A UNet with inputs no family has: `sdserve serve` refuses it at boot, exit 11, naming the inputs."""
    import shutil

    folder = tmp_path / "odd"
    shutil.copytree(tiny_model, folder)
    unet = onnx.load(folder / "unet" / "model.onnx")
    unet.graph.input.append(helper.make_tensor_value_info("controlnet_cond", TensorProto.FLOAT, [1, 3, 64, 64]))
    onnx.save(unet, folder / "unet" / "model.onnx")
    write_model_manifest(folder, json.loads((tiny_model / "manifest.json").read_text()))  # re-signed: only the
    # family check can refuse it
    profile = dev_config(tmp_path, replace={'on_boot_failure = "stay_unready"': 'on_boot_failure = "exit"'})
    done = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--port", "0", "--config", str(profile),
                           "--model", str(folder)], capture_output=True, text=True, timeout=180)
    assert done.returncode == int(ExitCode.MODEL_INVALID), done.stderr[-3000:]
    assert "inputs ['controlnet_cond'] that a sd1 UNet does not take" in done.stderr

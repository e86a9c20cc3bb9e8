"""The A1111 samplers and schedule types per model on the 2026 families (issue 54 point 4): FLUX.2 [klein] and
Z-Image-Turbo are flow-matching models whose pipelines step with Euler, Euler a, DPM++ 2M and UniPC on their flow
schedule (engines/pipelines/flow.py ``SAMPLERS``, engines/numerics/flow_samplers.py), so /sdapi/v1/samplers lists
those four and /sdapi/v1/schedulers Automatic, as their ModelInfo says; a client's "DPM++ 2M Karras" runs DPM++ 2M
on the flow schedule with a note, as A1111 falls back for a schedule it cannot use; SD-only samplers (DDIM, PLMS,
LMS, Heun, DPM++ 2M SDE) are refused naming ``sampler_name`` (422 with FastAPI's ``detail`` list, as A1111's API
validates) with the list, on txt2img and on Z-Image's img2img. The app runs in this
process on the real tiny builds (engines/build/flux2.py, engines/build/zimage.py) over ONNX Runtime's CPU provider
(onnxruntime/core/providers/cpu)."""

from __future__ import annotations

import base64
import io
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from PIL import Image

from engines.engine import OrtEngine
from server.app import create_app
from server.settings import load_settings

Builder = Callable[[str], tuple[Path, Path]]
SDAPI = "/sdapi/v1"
SD_SAMPLERS = ({"sampler_name": "DDIM"}, {"sampler_name": "PLMS"}, {"sampler_name": "LMS", "scheduler": "Karras"},
               {"sampler_name": "Heun"}, {"sampler_name": "DPM++ 2M SDE Karras"})
"""Samplers an SD model serves (the modern field pair and A1111's legacy combined name) that a flow model does not."""
FLOW_LABELS = ["Euler", "Euler a", "DPM++ 2M", "UniPC"]
"""The A1111 samplers a flow-matching model serves, in /sdapi/v1/samplers' order."""


@pytest.fixture(scope="module", params=["flux2-klein", "z-image-turbo"])
def served(request: pytest.FixtureRequest, dit_build: Builder) -> Iterator[tuple[TestClient, OrtEngine]]:
    settings = load_settings("dev")
    engine = OrtEngine(dit_build(request.param)[0], settings.runtime)
    with TestClient(create_app(engine, settings), base_url="http://localhost") as client:
        deadline = time.monotonic() + 240
        while client.get("/ready").status_code != 200:
            assert time.monotonic() < deadline, client.get("/ready").text
            time.sleep(0.05)
        assert engine.info.family == request.param
        yield client, engine


def _init_image() -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 40, 40)).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def test_the_listings_follow_the_models_schedulers(served: tuple[TestClient, OrtEngine]) -> None:
    client, engine = served
    assert engine.info.schedulers == ("euler", "euler_a", "dpmpp_2m", "unipc")
    samplers = client.get(f"{SDAPI}/samplers").json()
    assert [s["name"] for s in samplers] == FLOW_LABELS
    assert samplers[0]["aliases"] == ["k_euler"]
    assert [s["options"] for s in samplers] == [{}] * 4  # DPM++ 2M's Automatic is no Karras schedule here
    assert [s["label"] for s in client.get(f"{SDAPI}/schedulers").json()] == ["Automatic"]


@pytest.mark.parametrize("fields", SD_SAMPLERS, ids=lambda f: " ".join(f.values()))
def test_an_sd_sampler_is_refused_naming_sampler_name(served: tuple[TestClient, OrtEngine],
                                                      fields: dict[str, str]) -> None:
    client, engine = served
    refused = client.post(f"{SDAPI}/txt2img", json={"prompt": "a fox", "width": 64, "height": 64, "steps": 2,
                                                    **fields})
    assert refused.status_code == 422, refused.text
    detail = refused.json()["detail"][0]
    assert detail["loc"] == ["body", "sampler_name"], detail
    assert fields["sampler_name"].split(" Karras")[0] in detail["msg"] and str(FLOW_LABELS) in detail["msg"], detail


@pytest.mark.parametrize(("fields", "label"), [({"sampler_name": "Euler a"}, "Euler a"),
                                               ({"sampler_name": "k_dpmpp_2m"}, "DPM++ 2M"),
                                               ({"sampler_name": "UniPC", "scheduler": "Automatic"}, "UniPC"),
                                               ({"sampler_name": "DPM++ 2M Karras"}, "DPM++ 2M")],
                         ids=["euler-a", "dpmpp-2m", "unipc", "dpmpp-2m-karras"])
def test_the_clients_samplers_run(served: tuple[TestClient, OrtEngine], fields: dict[str, str], label: str) -> None:
    """webuiapi's and aiyabot's default "Euler a", DPM++ 2M and UniPC run and label their images; a Karras schedule
    falls back to the flow schedule with a note, as A1111 does for a schedule it cannot use."""
    client, engine = served
    body = {"prompt": "a fox", "width": 64, "height": 64, "steps": 3, "seed": 5}
    done = client.post(f"{SDAPI}/txt2img", json={**body, **fields})
    assert done.status_code == 200, done.text
    info = json.loads(done.json()["info"])
    assert info["sampler_name"] == label and info["scheduler"] == "Automatic", info
    assert f"Sampler: {label}, Schedule type: Automatic" in info["infotexts"][0], info["infotexts"][0]
    assert ("Karras" in fields["sampler_name"]) == ("'Karras' ignored for DPM++ 2M" in done.text), done.text[-400:]
    euler = client.post(f"{SDAPI}/txt2img", json={**body, "sampler_name": "Euler"})
    assert euler.status_code == 200 and euler.json()["images"][0] != done.json()["images"][0]


def test_euler_runs_and_is_the_label_the_image_carries(served: tuple[TestClient, OrtEngine]) -> None:
    client, engine = served
    done = client.post(f"{SDAPI}/txt2img", json={"prompt": "a fox", "width": 64, "height": 64, "steps": 2,
                                                 "seed": 3, "sampler_name": "k_euler", "scheduler": "Automatic"})
    assert done.status_code == 200, done.text
    info = json.loads(done.json()["info"])
    assert info["sampler_name"] == "Euler" and info["scheduler"] == "Automatic", info
    assert "Sampler: Euler, Schedule type: Automatic" in info["infotexts"][0], info["infotexts"][0]


def test_z_image_img2img_takes_the_flow_samplers(served: tuple[TestClient, OrtEngine]) -> None:
    """Z-Image serves img2img (ZImageImg2ImgPipeline), with its txt2img samplers; FLUX.2 [klein] serves no img2img
    (tests/e2e/test_flux2_serving.py refuses it)."""
    client, engine = served
    if "img2img" not in engine.info.modes:
        assert engine.info.family == "flux2-klein" and engine.info.edit_schedulers == ()
        return
    assert engine.info.edit_schedulers == ("euler", "euler_a", "dpmpp_2m", "unipc")
    body = {"prompt": "a red barn", "init_images": [_init_image()], "width": 64, "height": 64, "steps": 4,
            "denoising_strength": 0.6}
    refused = client.post(f"{SDAPI}/img2img", json={**body, "sampler_name": "DDIM"})
    assert refused.status_code == 422, refused.text
    assert refused.json()["detail"][0]["loc"] == ["body", "sampler_name"]
    assert str(FLOW_LABELS) in refused.json()["detail"][0]["msg"]
    for sampler in FLOW_LABELS:
        done = client.post(f"{SDAPI}/img2img", json={**body, "sampler_name": sampler})
        assert done.status_code == 200, done.text
        assert json.loads(done.json()["info"])["sampler_name"] == sampler

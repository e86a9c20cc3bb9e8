"""Edit routes behind the engine protocol (a fake engine): a model without the VAE encoder says so everywhere and
refuses edits naming why; edit jobs batch only with jobs of the same mode and strength."""

from __future__ import annotations

import asyncio
import dataclasses
import io
from collections.abc import Iterator

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from engines.config import SCHEDULER_NAMES
from engines.types.model import ModelInfo
from engines.types.request import Batch, EditImage, ImageSpec
from server.app import create_app
from server.batcher import Batcher
from server.metrics import Metrics
from server.settings import load_settings
from tests.unit.fakes import FakeEngine
from tests.unit.test_api import _wait_state

WHY = "fake has no vae_encoder/model.onnx: it serves txt2img only"


class TxtOnly(FakeEngine):
    @property
    def info(self) -> ModelInfo:
        return ModelInfo("fake", 16, 64, SCHEDULER_NAMES, 77, edits_unavailable=WHY)


@pytest.fixture
def client() -> Iterator[TestClient]:
    with TestClient(create_app(TxtOnly(), load_settings("dev"))) as c:
        _wait_state(c, "ready")
        yield c


def _png() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (64, 64), (10, 20, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_a_txt2img_only_model_says_so_and_refuses_edits_naming_why(client: TestClient) -> None:
    model = client.get("/v1/models").json()["data"][0]
    assert model["modes"] == "txt2img" and model["edits_unavailable"] == WHY
    for path in ("/v1/images/edits", "/v1/images/variations"):
        r = client.post(path, files={"image": ("a.png", _png(), "image/png")}, data={"prompt": "x"})
        assert r.status_code == 400 and WHY in r.json()["error"]["message"], r.text
    r = client.post("/sdapi/v1/img2img", json={"init_images": ["aGk="], "prompt": "x"})
    assert r.status_code == 422 and WHY in r.text


def test_edit_bodies_may_be_larger_than_json_bodies(client: TestClient) -> None:
    big = b"x" * (2 << 20)  # over queue.max_body_bytes (1 MiB), under limits.max_upload_bytes (16 MiB)
    assert client.post("/v1/images/generations", content=big).status_code == 413
    r = client.post("/v1/images/edits", files={"image": ("a.png", big, "image/png")}, data={"prompt": "x"})
    assert r.status_code == 400  # read, then refused as a txt2img-only model


def test_edits_batch_only_with_the_same_mode_and_strength() -> None:
    engine = FakeEngine()
    engine.load()

    async def main() -> list[int]:
        batcher = Batcher(engine, Metrics(0), asyncio.Lock(), 16, 8, 0.2)
        runner = asyncio.create_task(batcher.run())
        edit = EditImage(np.zeros((64, 64, 3), np.uint8))
        base = Batch((ImageSpec("a", edit=edit),), steps=4, strength=0.5)
        batches = [base, base, dataclasses.replace(base, strength=0.8), Batch((ImageSpec("a"),), steps=4)]
        await asyncio.gather(*(batcher.submit(b, None) for b in batches))
        runner.cancel()
        return [len(b.images) for b in engine.batches]

    assert sorted(asyncio.run(main())) == [1, 1, 2]

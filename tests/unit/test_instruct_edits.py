"""Instruction edits on the routes, behind the engine protocol (a fake engine with ModelInfo.instruct_images=2 and
an instruct_size rule): /v1/images/edits and /sdapi/v1/img2img pass every input image as EditImage.references at
its own size, the first resized to the batch's size as EditImage.image; the output size follows instruct_size
unless size is given; more images than the model takes, and a mask on a model that cannot inpaint, are 400s
naming the field; strength and input_fidelity are named as ignored."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from engines.config import SCHEDULER_NAMES
from engines.types.model import ModelInfo
from server.app import create_app
from server.settings import load_settings
from tests.unit.fakes import FakeEngine
from tests.unit.test_api import _wait_state


def _half_of_first(sizes: tuple[tuple[int, int], ...]) -> tuple[int, int]:
    """The fake model's output-size rule: half the first input's width and height, to multiples of 16."""
    return sizes[0][0] // 32 * 16, sizes[0][1] // 32 * 16


class InstructFake(FakeEngine):
    @property
    def info(self) -> ModelInfo:
        return ModelInfo("fake-edit", 16, 64, SCHEDULER_NAMES, 77, modes=("txt2img", "img2img"),
                         edit_schedulers=SCHEDULER_NAMES, instruct_images=2, instruct_size=_half_of_first)


@pytest.fixture
def engine() -> InstructFake:
    return InstructFake()


@pytest.fixture
def client(engine: InstructFake) -> Iterator[TestClient]:
    with TestClient(create_app(engine, load_settings("dev"))) as c:
        _wait_state(c, "ready")
        yield c


def _png(width: int, height: int, colour: tuple[int, int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buffer, format="PNG")
    return buffer.getvalue()


def _edit(client: TestClient, images: list[bytes], **fields: str) -> Any:
    files = [("image[]", (f"in{i}.png", data, "image/png")) for i, data in enumerate(images)]
    steps = {} if "quality" in fields else {"steps": "2"}  # quality is honoured as a step count
    return client.post("/v1/images/edits", data={"prompt": "put a hat on it", **steps, **fields}, files=files)


def test_two_images_are_the_references_and_the_size_follows_the_models_rule(client: TestClient,
                                                                             engine: InstructFake) -> None:
    first, second = _png(128, 96, (200, 10, 10)), _png(48, 80, (10, 200, 10))
    response = _edit(client, [first, second])
    assert response.status_code == 200, response.text
    assert response.headers["x-sdserve-mode"] == "instruct"
    batch = engine.batches[-1]
    assert (batch.width, batch.height) == (64, 48) and batch.mode == "instruct"
    edit = batch.images[0].edit
    assert edit is not None and edit.mask is None
    assert [r.shape for r in edit.references] == [(96, 128, 3), (80, 48, 3)]
    assert tuple(edit.references[0][0, 0]) == (200, 10, 10) and tuple(edit.references[1][0, 0]) == (10, 200, 10)
    assert edit.image.shape == (48, 64, 3) and tuple(edit.image[0, 0]) == (200, 10, 10)


def test_size_given_wins_and_auto_is_the_models_rule(client: TestClient, engine: InstructFake) -> None:
    image = _png(128, 64, (1, 2, 3))
    assert _edit(client, [image], size="32x32").status_code == 200
    assert (engine.batches[-1].width, engine.batches[-1].height) == (32, 32)
    assert _edit(client, [image], size="auto").status_code == 200
    assert (engine.batches[-1].width, engine.batches[-1].height) == (64, 32)
    assert engine.batches[-1].images[0].edit.references[0].shape == (64, 128, 3)  # type: ignore[union-attr]


def test_more_images_than_the_model_takes_is_a_400_naming_image_and_the_limit(client: TestClient,
                                                                            engine: InstructFake) -> None:
    response = _edit(client, [_png(64, 64, (i, i, i)) for i in range(3)])
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "image" and "at most 2 input images" in error["message"] and "got 3" in error["message"]
    assert engine.batches == []


def test_a_mask_on_a_model_that_cannot_inpaint_is_a_400_naming_mask(client: TestClient,
                                                                   engine: InstructFake) -> None:
    files = [("image", ("a.png", _png(64, 64, (9, 9, 9)), "image/png")),
             ("mask", ("m.png", _png(64, 64, (255, 255, 255)), "image/png"))]
    response = client.post("/v1/images/edits", data={"prompt": "x"}, files=files)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "mask" and "cannot inpaint" in error["message"]
    assert engine.batches == []


def test_strength_and_input_fidelity_are_named_as_ignored(client: TestClient, engine: InstructFake) -> None:
    response = _edit(client, [_png(64, 64, (5, 5, 5))], strength="0.3", input_fidelity="high",
                     output_format="jpeg", quality="high")
    assert response.status_code == 200, response.text
    ignored = response.headers["x-sdserve-ignored-fields"]
    assert "strength" in ignored and "input_fidelity" in ignored
    assert engine.batches[-1].strength == 1.0
    assert base64.b64decode(response.json()["data"][0]["b64_json"])[:3] == b"\xff\xd8\xff"


def test_a1111_init_images_are_the_references(client: TestClient, engine: InstructFake) -> None:
    images = [base64.b64encode(_png(96, 64, (30, 40, 50))).decode(), base64.b64encode(_png(64, 32, (7, 8, 9))).decode()]
    response = client.post("/sdapi/v1/img2img", json={"prompt": "a hat", "steps": 2, "init_images": images})
    assert response.status_code == 200, response.text
    batch = engine.batches[-1]
    assert batch.mode == "instruct" and (batch.width, batch.height) == (48, 32)
    edit = batch.images[0].edit
    assert edit is not None and [r.shape for r in edit.references] == [(64, 96, 3), (32, 64, 3)]
    assert json.loads(response.json()["info"])["mode"] == "instruct"
    too_many = client.post("/sdapi/v1/img2img", json={"prompt": "a hat", "init_images": images * 2})
    assert too_many.status_code == 422 and "init_images" in too_many.text and "at most 2" in too_many.text
    assert np.array_equal(edit.references[1][0, 0], [7, 8, 9])


def test_admission_sees_the_references_before_any_pixel_is_decoded(client: TestClient, engine: InstructFake,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch priced before decoding is the instruction edit's shape: references at the declared sizes, after
    the EXIF orientation (a JPEG turned 90 degrees: 128x96 stored, 96x128 shown), and the output size follows."""
    service = client.app.state.service  # type: ignore[attr-defined]
    priced: list[Any] = []
    real = service.preadmit

    def spy(batches: list[Any], *args: Any, **kwargs: Any) -> float:
        priced.extend(batches)
        return float(real(batches, *args, **kwargs))

    monkeypatch.setattr(service, "preadmit", spy)
    exif = Image.Exif()
    exif[0x0112] = 6
    buffer = io.BytesIO()
    Image.new("RGB", (128, 96), (50, 60, 70)).save(buffer, format="JPEG", exif=exif.tobytes())
    response = _edit(client, [buffer.getvalue(), _png(64, 64, (1, 1, 1))])
    assert response.status_code == 200, response.text
    batch = priced[0]
    assert batch.mode == "instruct" and (batch.width, batch.height) == (48, 64)
    assert [r.shape for r in batch.images[0].edit.references] == [(128, 96, 3), (64, 64, 3)]
    ran = engine.batches[-1].images[0].edit
    assert ran is not None and [r.shape for r in ran.references] == [(128, 96, 3), (64, 64, 3)]


def test_qwen_edit_refuses_an_input_image_past_its_aspect_bound_naming_image() -> None:
    """engines/pipelines/qwen_edit.py ``MAX_ASPECT``: an input image wider than 8:1 gets no engine of the production
    plan (engines/build/trtplan_edit.py reads the same bound), so it is a 400 naming ``image``; 8:1 passes."""
    from engines.errors import InvalidRequestError
    from engines.pipelines.qwen_edit import MAX_ASPECT, QwenEditPipeline
    from engines.types.request import Batch, EditImage, ImageSpec

    def batch(width: int, height: int) -> Batch:
        image = np.zeros((height, width, 3), np.uint8)
        return Batch((ImageSpec("a hat", edit=EditImage(image, references=(image,))),), 64, 64, 2)

    assert MAX_ASPECT == 8.0
    assert len(QwenEditPipeline._references(None, batch(512, 64))[0]) == 1  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="wider than 8:1") as refused:
        QwenEditPipeline._references(None, batch(64, 520))  # type: ignore[arg-type]
    assert refused.value.param == "image"

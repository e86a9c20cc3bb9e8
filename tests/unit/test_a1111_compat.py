"""Clients, third pass, on a fake engine behind the protocol: A1111's lax numbers (against A1111's own field types),
``styles: ["None"]``, infotexts in every image and POST /sdapi/v1/png-info reading them back (also from images
sdserve did not make), img2img's ignored-fields header, image_cfg_scale and inpainting_fill 2/3, Hires fix (stages,
step arithmetic, admission of both passes), OpenAI's 1024 sizes through Hires fix, and A1111's CORS flags."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
from collections.abc import Iterator
from typing import Any, Optional

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image, PngImagePlugin
from pydantic import TypeAdapter, ValidationError

from engines.config import SCHEDULER_NAMES
from engines.errors import ConfigError, InvalidRequestError
from engines.types.model import ModelInfo
from engines.types.request import Batch, BatchResult, ImageSpec, StepHook
from server.app import create_app
from server.cli.serve import with_cors
from server.hires import UPSCALERS, make_plan, second_pass, target_size, upscale, upscale_latents
from server.images import embed_infotext
from server.routes.a1111 import Txt2ImgRequest
from server.routes.a1111_img2img import Img2ImgRequest
from server.routes.a1111_infotext import parse_infotext
from server.settings import ServerSettings, Settings, load_settings
from tests.unit.fakes import DIGEST, HashedEngine
from tests.unit.fakes import wait_for as _wait

TXT2IMG, IMG2IMG, PNG_INFO = "/sdapi/v1/txt2img", "/sdapi/v1/img2img", "/sdapi/v1/png-info"
GEN = "/v1/images/generations"

# A1111's own field types: modules/processing.py StableDiffusionProcessing / StableDiffusionProcessingTxt2Img /
# StableDiffusionProcessingImg2Img annotations, which modules/api/models.py wraps as Optional[...] in a lax model.
A1111_TYPES: dict[str, type] = {
    "seed": int, "steps": int, "cfg_scale": float, "width": int, "height": int, "batch_size": int, "n_iter": int,
    "denoising_strength": float, "hr_scale": float, "hr_second_pass_steps": int, "hr_resize_x": int,
    "hr_resize_y": int}
A1111_IMG2IMG_TYPES: dict[str, type] = {
    **A1111_TYPES, "resize_mode": int, "mask_blur": int, "inpainting_fill": int, "inpaint_full_res_padding": int,
    "inpainting_mask_invert": int, "image_cfg_scale": float, "initial_noise_multiplier": float}
STRINGS = ["1", " 2 ", "3.0", "0.5", "1_0", "1e1", "abc", "", "+1", "0x1"]
"""What clients put in number fields: openOutpaint's "-1"-style field values, toString()s, a Discord bot's "7.0"."""


EDIT_INFO = ModelInfo("fake", 16, 64, SCHEDULER_NAMES, 77, DIGEST, modes=("txt2img", "img2img", "inpaint"),
                      edit_schedulers=SCHEDULER_NAMES)


class EditEngine(HashedEngine):
    """The fake as a model that serves edits (so Hires fix can run its second pass) and hands out latents when
    asked (seeded noise at the latent size, as the protocol's GeneratedImage.latents)."""

    @property
    def info(self) -> ModelInfo:
        super().info  # noqa: B018 (raises until loaded, as the real engine)
        return EDIT_INFO

    def generate(self, batch: Batch, on_step: StepHook | None = None) -> BatchResult:
        result = super().generate(batch, on_step)
        shape = (4, batch.height // 8, batch.width // 8)
        images = tuple(dataclasses.replace(g, latents=np.random.default_rng(g.seed).standard_normal(
            shape, dtype=np.float32)) if spec.keep_latents else g for g, spec in zip(result.images, batch.images,
                                                                                       strict=True))
        return dataclasses.replace(result, images=images)


def _start(engine: HashedEngine, settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(engine, settings), base_url="http://localhost") as client:
        _wait(client, "/ready", lambda r: r.status_code == 200)
        yield client


def _dev(**sections: dict[str, Any]) -> Settings:
    dev = load_settings("dev")
    return dev.model_copy(update={name: getattr(dev, name).model_copy(update=values)
                                  for name, values in sections.items()})


@pytest.fixture
def engine() -> EditEngine:
    return EditEngine()


@pytest.fixture
def client(engine: EditEngine) -> Iterator[TestClient]:
    yield from _start(engine, load_settings("dev"))


def _b64(image: Image.Image, fmt: str = "PNG", **save: Any) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **save)
    return base64.b64encode(buffer.getvalue()).decode()


def _image(text: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(text)))


# 1. Lax numbers


@pytest.mark.parametrize(("model", "types"), [(Txt2ImgRequest, A1111_TYPES), (Img2ImgRequest, A1111_IMG2IMG_TYPES)])
def test_numeric_strings_are_read_as_a1111s_lax_models_read_them(model: type[Txt2ImgRequest],
                                                                   types: dict[str, type]) -> None:
    base = {"prompt": "x", "init_images": ["x"]}
    for name, kind in types.items():
        assert name in model.model_fields, name  # every A1111 number field sdserve reads is declared
        for text in STRINGS:
            theirs = _outcome(lambda: TypeAdapter(Optional[kind]).validate_python(text))  # noqa: UP045, B023
            ours = _outcome(lambda: getattr(model.model_validate({**base, name: text}), name))  # noqa: B023
            if theirs[0] == "error":  # A1111's 422, the same error type, at the field
                assert ours == ("error", ((name,), theirs[1][1])), (name, text)
            elif ours[0] == "error":  # parsed as A1111 does, then out of sdserve's bounds ("0.5" steps)
                assert ours[1][0] == (name,) and not ours[1][1].endswith("_parsing"), (name, text, ours)
            else:
                assert ours == theirs and type(ours[1]) is type(theirs[1]), (name, text, ours, theirs)


def _outcome(call: Any) -> tuple[str, Any]:
    """("ok", value) or ("error", (loc, type)) of a validation."""
    try:
        return "ok", call()
    except ValidationError as exc:
        return "error", (exc.errors()[0]["loc"], exc.errors()[0]["type"])


def test_only_strings_are_coerced_booleans_stay_refused() -> None:
    with pytest.raises(ValidationError) as exc:
        Txt2ImgRequest.model_validate({"prompt": "x", "seed": True})
    assert exc.value.errors()[0]["loc"] == ("seed",)
    with pytest.raises(ValidationError):
        Txt2ImgRequest.model_validate({"prompt": "x", "enable_hr": "true"})  # a bool field is not lax
    assert Txt2ImgRequest.model_validate({"prompt": "x", "sampler_name": "Euler"}).sampler_name == "Euler"


def test_openoutpaint_string_numbers_generate_and_abc_is_a_422_naming_the_field(client: TestClient,
                                                                                 engine: EditEngine) -> None:
    body = {"prompt": "x", "seed": "-1", "steps": "2", "cfg_scale": "7.0", "width": "64", "height": "64",
            "batch_size": "1", "n_iter": "1"}
    assert client.post(TXT2IMG, json=body).status_code == 200
    assert (engine.batches[-1].steps, engine.batches[-1].images[0].guidance_scale) == (2, 7.0)
    bad = client.post(TXT2IMG, json={**body, "seed": "abc"})
    assert bad.status_code == 422
    detail = bad.json()["detail"][0]
    assert detail["loc"] == ["body", "seed"] and "valid integer" in detail["msg"]


def test_a_neutral_extra_sent_as_a_string_is_accepted(client: TestClient) -> None:
    answer = client.post(TXT2IMG, json={"prompt": "x", "steps": 2, "subseed_strength": "0", "clip_skip": "1"})
    assert answer.status_code == 200, answer.text
    assert client.post(TXT2IMG, json={"prompt": "x", "steps": 2, "clip_skip": "2"}).status_code == 422


@pytest.mark.parametrize("styles", [["None"], [""], ["None", ""]])
def test_the_no_style_choice_is_accepted_and_named(client: TestClient, styles: list[str]) -> None:
    answer = client.post(TXT2IMG, json={"prompt": "x", "steps": 2, "styles": styles})
    assert answer.status_code == 200, answer.text
    assert "styles" in answer.headers["x-sdserve-ignored-fields"].split(",")
    refused = client.post(TXT2IMG, json={"prompt": "x", "steps": 2, "styles": [*styles, "cinematic"]})
    assert refused.status_code == 422 and refused.json()["detail"][0]["loc"] == ["body", "styles"]


# 2. img2img: the header, image_cfg_scale, inpainting_fill 2 and 3


def test_img2img_names_ignored_fields_in_the_header_like_txt2img(client: TestClient) -> None:
    body = {"init_images": [_b64(Image.new("RGB", (64, 64), (9, 9, 9)))], "steps": 4, "image_cfg_scale": 0.7,
            "save_images": False, "hr_scale": 2}
    answer = client.post(IMG2IMG, json=body)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-sdserve-ignored-fields"] == "hr_scale,image_cfg_scale,save_images"
    assert "ignored A1111 fields: hr_scale, image_cfg_scale, save_images" in json.loads(answer.json()["info"])[
        "warnings"]


@pytest.mark.parametrize(("fill", "expected"), [(0, "original"), (1, "original"), (2, "noise"), (3, "nothing")])
def test_inpainting_fill_reaches_the_engine(client: TestClient, engine: EditEngine, fill: int, expected: str) -> None:
    mask = Image.new("L", (64, 64), 0)
    mask.paste(255, (16, 16, 48, 48))
    body = {"init_images": [_b64(Image.new("RGB", (64, 64), (200, 10, 10)))], "mask": _b64(mask), "steps": 4,
            "inpainting_fill": fill, "inpaint_full_res": False, "denoising_strength": 0.75}
    answer = client.post(IMG2IMG, json=body)
    assert answer.status_code == 200, answer.text
    edit = engine.batches[-1].images[0].edit
    assert edit is not None and edit.fill == expected
    infotext = json.loads(answer.json()["info"])["infotexts"][0]
    assert f"Masked content: {['fill', 'original', 'latent noise', 'latent nothing'][fill]}" in infotext


# 3. Infotexts and png-info


def test_a_txt2img_png_round_trips_through_png_info(client: TestClient) -> None:
    answer = client.post(TXT2IMG, json={"prompt": "a cat, sitting", "negative_prompt": "blurry", "steps": 3,
                                        "seed": 42, "batch_size": 2})
    info = json.loads(answer.json()["info"])
    for index, image in enumerate(answer.json()["images"]):
        assert _image(image).info["parameters"] == info["infotexts"][index]
        read = client.post(PNG_INFO, json={"image": image}).json()
        assert read["info"] == info["infotexts"][index]
        parsed = read["parameters"]
        assert (parsed["Prompt"], parsed["Negative prompt"]) == ("a cat, sitting", "blurry")
        assert (parsed["Seed"], parsed["Steps"], parsed["Size-1"]) == (str(42 + index), "3", "64")


def test_png_info_reads_images_sdserve_did_not_make(client: TestClient) -> None:
    text = 'a dog\nNegative prompt: ugly\nSteps: 20, Sampler: Euler a, CFG scale: 7, Seed: 5, Size: 512x768, ' \
           'Model: "v1-5, pruned"'
    meta = PngImagePlugin.PngInfo()
    meta.add_text("parameters", text)
    meta.add_text("Software", "a painter")
    png = client.post(PNG_INFO, json={"image": "data:image/png;base64," + _b64(Image.new("RGB", (8, 8)),
                                                                             pnginfo=meta)}).json()
    assert png["info"] == text and png["items"] == {"Software": "a painter"}
    assert png["parameters"]["Model"] == "v1-5, pruned" and png["parameters"]["Size-2"] == "768"
    exif = Image.Exif()
    exif.get_ifd(0x8769)[0x9286] = b"UNICODE\x00" + text.encode("utf-16-be")  # piexif's UserComment.dump
    jpeg = client.post(PNG_INFO, json={"image": _b64(Image.new("RGB", (8, 8)), "JPEG", exif=exif.tobytes())})
    assert jpeg.json()["info"] == text
    plain = client.post(PNG_INFO, json={"image": _b64(Image.new("RGB", (8, 8)))}).json()
    assert plain == {"info": "", "items": {}, "parameters": {}}
    bad = client.post(PNG_INFO, json={"image": "bm90IGFuIGltYWdl"})
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["body", "image"]


@pytest.mark.parametrize("fmt", ["png", "jpeg", "webp"])
def test_openai_images_carry_the_infotext(client: TestClient, fmt: str) -> None:
    body = {"prompt": "a boat", "size": "64x64", "steps": 2, "seed": 7, "output_format": fmt}
    image = _image(client.post(GEN, json=body).json()["data"][0]["b64_json"])
    text = image.info.get("parameters") or image.getexif().get_ifd(0x8769)[0x9286][8:].decode("utf-16-be")
    assert text.startswith("a boat\nSteps: 2, Sampler: Euler") and "Seed: 7, Size: 64x64" in text


def test_the_profile_switch_keeps_prompts_out_of_the_files(engine: EditEngine) -> None:
    for client in _start(engine, _dev(api={"infotext": False})):
        image = client.post(TXT2IMG, json={"prompt": "private", "steps": 2}).json()["images"][0]
        assert "parameters" not in _image(image).info
        assert client.post(PNG_INFO, json={"image": image}).json()["info"] == ""
        data = client.post(GEN, json={"prompt": "private", "steps": 2}).json()["data"][0]["b64_json"]
        assert b"private" not in base64.b64decode(data)


def test_infotext_embedding_keeps_the_pixels() -> None:
    image = Image.new("RGB", (16, 8), (1, 2, 3))
    for fmt in ("PNG", "JPEG", "WEBP"):
        buffer = io.BytesIO()
        image.save(buffer, format=fmt)
        embedded = embed_infotext(buffer.getvalue(), "ünï, côde")
        assert list(Image.open(io.BytesIO(embedded)).getdata()) == list(Image.open(buffer).getdata())


def test_parse_follows_a1111_quoting_and_multiline_prompts() -> None:
    parsed = parse_infotext('line one\nline two\nNegative prompt: bad\nworse\nSteps: 4, Sampler: "a: b", Seed: 1')
    assert (parsed["Prompt"], parsed["Negative prompt"], parsed["Sampler"]) == ("line one\nline two",
                                                                               "bad\nworse", "a: b")
    assert parsed["Clip skip"] == "1" and parsed["Schedule type"] == "Automatic"  # A1111's defaults
    short = parse_infotext("just a prompt\nSteps: 4")  # fewer than 3 pairs: all prompt
    assert short["Prompt"] == "just a prompt\nSteps: 4"


# 4. Hires fix


@pytest.mark.parametrize(("size", "scale", "resize", "expected"), [
    ((64, 64), 2.0, (0, 0), (128, 128, 0, 0)),
    ((64, 48), 1.5, (0, 0), (96, 72, 0, 0)),
    ((64, 64), 2.0, (96, 0), (96, 96, 0, 0)),
    ((64, 48), 2.0, (0, 96), (128, 96, 0, 0)),
    ((64, 64), 2.0, (128, 96), (128, 128, 0, 4)),
    ((48, 64), 2.0, (128, 96), (128, 170, 0, 9)),
])
def test_target_size_follows_calculate_target_resolution(size: tuple[int, int], scale: float,
                                                         resize: tuple[int, int],
                                                         expected: tuple[int, int, int, int]) -> None:
    assert target_size(*size, scale, *resize) == expected


def test_upscalers_are_pil_resamplers_as_a1111_runs_them() -> None:
    image = Image.effect_mandelbrot((32, 24), (-2, -1, 1, 1), 50).convert("RGB")
    lanczos = upscale(image, "Lanczos", 64, 48)
    assert lanczos.tobytes() == image.resize((64, 48), Image.Resampling.LANCZOS).tobytes()
    nearest = upscale(image, "Nearest", 64, 48)
    assert nearest.getpixel((5, 7)) == image.getpixel((2, 3))  # each pixel repeated 2x2
    odd = upscale(image, "Nearest", 100, 60)  # nearest to 2.5x (80x60 after the multiple-of-8 fix-up), then LANCZOS
    assert odd.size == (100, 60)
    assert list(UPSCALERS)[0] == "None" and upscale(image, "None", 64, 48).tobytes() == lanczos.tobytes()


@pytest.mark.parametrize("strength", [0.05, 0.3, 0.5, 0.7, 0.75, 0.99, 1.0])
@pytest.mark.parametrize("steps", [1, 2, 7, 20, 33])
def test_the_second_pass_runs_exactly_its_steps(strength: float, steps: int) -> None:
    first = Batch((ImageSpec("x", seed=1),), 64, 64, 20)
    plan = make_plan(first, EDIT_INFO, steps=steps, upscaler="Lanczos", denoising_strength=strength)
    schedule = int(steps / min(strength, 0.999))  # A1111's setup_img2img_steps with explicit steps
    assert plan.schedule_steps == schedule and int(schedule * plan.strength) == steps and plan.strength <= 1.0


def test_the_second_pass_is_an_img2img_of_the_upscaled_images_with_the_same_seeds() -> None:
    info = EDIT_INFO
    first = Batch((ImageSpec("x", seed=3), ImageSpec("x", seed=4)), 64, 64, 10)
    plan = make_plan(first, info, scale=1.5, upscaler="Nearest", denoising_strength=0.5)
    images = [Image.new("RGB", (64, 64), (i * 50, 0, 0)) for i in range(2)]
    second = second_pass(first, images, plan, info)
    assert (second.width, second.height, second.steps, second.mode) == (96, 96, 20, "img2img")
    assert [s.seed for s in second.images] == [3, 4] and int(second.steps * second.strength) == 10
    assert second.images[1].edit is not None and second.images[1].edit.image[0, 0].tolist() == [50, 0, 0]


@pytest.mark.parametrize(("fields", "param", "fragment"), [
    ({"hr_upscaler": "Latent (bicubic antialiased)"}, "hr_upscaler", "antialiased"),
    ({"hr_upscaler": "R-ESRGAN 4x+"}, "hr_upscaler", "no such upscaler"),
    ({"hr_upscaler": "Lanczos", "denoising_strength": 0}, "denoising_strength", "above 0"),
    ({"hr_upscaler": "Lanczos", "denoising_strength": 0.01, "hr_second_pass_steps": 20}, "denoising_strength",
     "at most"),
])
def test_hires_settings_sdserve_cannot_run_are_named(client: TestClient, fields: dict[str, Any], param: str,
                                                     fragment: str) -> None:
    answer = client.post(TXT2IMG, json={"prompt": "x", "steps": 2, "enable_hr": True, **fields})
    assert answer.status_code == 422, answer.text
    detail = answer.json()["detail"][0]
    assert detail["loc"] == ["body", param] and fragment in detail["msg"]


def test_hires_second_pass_settings_must_match_the_first(client: TestClient) -> None:
    body = {"prompt": "a", "steps": 2, "enable_hr": True, "hr_upscaler": "Lanczos", "hr_scale": 1.5}
    same = client.post(TXT2IMG, json={**body, "hr_prompt": "", "hr_sampler_name": "Euler",
                                      "hr_checkpoint_name": "Use same checkpoint"})
    assert same.status_code == 200, same.text
    assert same.headers["x-sdserve-ignored-fields"] == "hr_checkpoint_name,hr_prompt,hr_sampler_name"
    for name, value in (("hr_prompt", "another"), ("hr_sampler_name", "DDIM"), ("hr_checkpoint_name", "x.ckpt")):
        refused = client.post(TXT2IMG, json={**body, name: value})
        assert refused.status_code == 422 and refused.json()["detail"][0]["loc"] == ["body", name]
    too_big = client.post(TXT2IMG, json={**body, "hr_scale": 16})
    assert too_big.status_code == 422 and too_big.json()["detail"][0]["loc"] == ["body", "hr_scale"]
    target = client.post(TXT2IMG, json={**body, "hr_resize_x": 1024})
    assert target.status_code == 422 and target.json()["detail"][0]["loc"] == ["body", "hr_resize_x"]
    assert "over this server's largest 512" in target.json()["detail"][0]["msg"]


def test_hires_fix_runs_both_passes_and_says_so(client: TestClient, engine: EditEngine) -> None:
    body = {"prompt": "a castle", "steps": "4", "seed": 9, "enable_hr": True, "hr_scale": "2", "batch_size": 2,
            "hr_upscaler": "Lanczos", "denoising_strength": "0.5", "hr_second_pass_steps": 3}
    answer = client.post(TXT2IMG, json=body)
    assert answer.status_code == 200, answer.text
    first, second = engine.batches[-2:]
    assert (first.width, first.mode, second.width, second.height, second.mode) == (64, "txt2img", 128, 128,
                                                                                    "img2img")
    assert second.steps == 6 and int(second.steps * second.strength) == 3  # 3 steps at the end of 3 / 0.5
    assert [s.seed for s in second.images] == [9, 10] and "x-sdserve-ignored-fields" not in answer.headers
    assert {_image(i).size for i in answer.json()["images"]} == {(128, 128)}
    info = json.loads(answer.json()["info"])
    assert (info["width"], info["denoising_strength"], info["hires"]) == (64, 0.5, [128, 128])
    assert "Size: 64x64" in info["infotexts"][0]
    assert "Denoising strength: 0.5, Hires upscale: 2, Hires steps: 3, Hires upscaler: Lanczos" in info["infotexts"][0]


def test_hires_admission_counts_both_passes(client: TestClient, engine: EditEngine) -> None:
    client.app.state.service.cost.per_image_step = {(64, 64): 0.01}  # type: ignore[attr-defined]
    body = {"prompt": "x", "steps": 20, "enable_hr": True, "hr_upscaler": "Lanczos"}
    headers = {"x-sdserve-timeout-s": "0.5"}  # the first pass (0.2 s) fits; both (0.2 s + 4 x 0.2 s) do not
    assert client.post(TXT2IMG, json={"prompt": "x", "steps": 20}, headers=headers).status_code == 200
    count = len(engine.batches)
    refused = client.post(TXT2IMG, json=body, headers=headers)
    assert refused.status_code == 422 and "exceeds the request deadline" in refused.text
    assert len(engine.batches) == count  # refused before the first pass ran


# 5. OpenAI 1024-class sizes through Hires fix


def test_openai_1024_sizes_through_hires_fix_under_the_option(engine: EditEngine) -> None:
    for client in _start(engine, _dev(serving={"openai_sizes_hires": True})):
        for size, base in (("1024x1024", (64, 64)), ("1792x1024", (80, 48))):
            answer = client.post(GEN, json={"prompt": "a", "size": size, "steps": 2})
            assert answer.status_code == 200, answer.text
            assert answer.json()["size"] == size and _image(answer.json()["data"][0]["b64_json"]).size == \
                tuple(int(v) for v in size.split("x"))
            assert (engine.batches[-2].width, engine.batches[-2].height) == base
            assert "through Hires fix" in answer.headers["x-sdserve-warnings"]
            assert any("openai_sizes_hires" in w for w in answer.json()["warnings"])
    for client in _start(EditEngine(), load_settings("dev")):
        refused = client.post(GEN, json={"prompt": "a", "size": "1024x1024"})
        assert refused.status_code == 400 and "openai_sizes_hires" in refused.json()["error"]["message"]


# 6. CORS, as A1111 spells it


def test_cors_flags_replace_the_profile_and_a_regex_allows_matching_origins(engine: EditEngine) -> None:
    dev = load_settings("dev")
    assert with_cors(dev, None, None) is dev
    flagged = with_cors(dev, "https://a.example,http://localhost:3456", r"https://.*\.tools\.example")
    assert flagged.server.cors_origins == ("https://a.example", "http://localhost:3456")
    with pytest.raises(ConfigError, match="cors"):
        with_cors(dev, "not an origin", None)
    with pytest.raises(ConfigError, match="regular expression"):
        with_cors(dev, None, "(")
    for client in _start(engine, flagged):
        for origin, allowed in (("https://x.tools.example", True), ("http://localhost:3456", True),
                                ("https://x.tools.example.evil", False), ("https://b.example", False)):
            answer = client.get("/health", headers={"origin": origin})
            assert (answer.headers.get("access-control-allow-origin") == origin) is allowed, origin


def test_the_serve_command_takes_a1111s_cors_flags() -> None:
    from server.cli.main import parser

    args = parser().parse_args(["serve", "--cors-allow-origins", "https://a.example", "--cors-allow-origins-regex",
                                "https://.*"])
    assert (args.cors_allow_origins, args.cors_allow_origins_regex) == ("https://a.example", "https://.*")


def test_server_settings_refuse_a_bad_regex() -> None:
    with pytest.raises(ValueError, match="regular expression"):
        ServerSettings(cors_origin_regex="[")


def test_hires_needs_an_edits_model() -> None:
    with pytest.raises(InvalidRequestError) as exc:
        make_plan(Batch((ImageSpec("x"),)), ModelInfo("fake", 16, 64, SCHEDULER_NAMES, 77), upscaler="Lanczos")
    assert exc.value.param == "enable_hr"


def test_a_latent_upscale_starts_the_second_pass_from_the_first_pass_latents(client: TestClient,
                                                                             engine: EditEngine) -> None:
    """A1111's default hr_upscaler (Latent): the first pass keeps its latents, the second starts from them
    resized (bilinear) instead of from encoded pixels; Latent (nearest) repeats each latent pixel."""
    body = {"prompt": "a", "steps": 4, "seed": 5, "enable_hr": True, "denoising_strength": 0.6}
    answer = client.post(TXT2IMG, json=body)
    assert answer.status_code == 200, answer.text
    first, second = engine.batches[-2:]
    assert [s.keep_latents for s in first.images] == [True] and not second.images[0].keep_latents
    kept = np.random.default_rng(5).standard_normal((4, 8, 8), dtype=np.float32)  # what the fake handed out
    edit = second.images[0].edit
    assert edit is not None and edit.latents is not None
    assert np.array_equal(edit.latents, upscale_latents(kept, 16, 16, "bilinear"))
    assert "Hires upscale: 2" in json.loads(answer.json()["info"])["infotexts"][0]
    client.post(TXT2IMG, json={**body, "hr_upscaler": "Latent (nearest)"})
    nearest = engine.batches[-1].images[0].edit
    assert nearest is not None and nearest.latents is not None
    assert np.array_equal(nearest.latents, kept.repeat(2, axis=1).repeat(2, axis=2))
    modes = [m["name"] for m in client.get("/sdapi/v1/latent-upscale-modes").json()]
    assert modes == ["Latent", "Latent (bicubic)", "Latent (nearest)", "Latent (nearest-exact)"]

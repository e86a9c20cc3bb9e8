"""Admission charges an instruction edit's reference tokens (issue 55, item 4): FLUX.1 Kontext and
Qwen-Image-Edit join their input images' latents to every denoiser row (engines/pipelines/kontext.py,
qwen_edit.py ``extra_tokens``), so an edit costs more compute per step and more denoiser memory than a txt2img of
the same output size. The encoded sizes and token counts by hand from diffusers' resize rules; the step cost
(server/admission.py CostModel) and the memory estimate (engines/health/request_memory.py, the released FLUX.1
[dev] configs: Kontext's transformer is Flux.1's) with and without references; then through the app on a fake
engine, an edit refused on memory at a budget where the same-size generation runs, and priced over a deadline the
generation meets."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from PIL import Image

from engines.config import SCHEDULER_NAMES
from engines.errors import InvalidRequestError
from engines.health import memory_plan as mp
from engines.health import request_memory as rm
from engines.pipelines import kontext, qwen_edit
from engines.types.model import MemoryNeed, ModelInfo
from server.admission import Cost, CostModel, admit
from server.settings import Settings, load_settings
from tests.unit.fakes import FakeEngine, start

CONFIGS = json.loads((Path(__file__).resolve().parents[1] / "data" / "model_configs.json").read_text())
MIB = 1 << 20
D, TEXT = 3072, 512
"""FLUX.1 [dev]'s transformer width (24 heads x 128) and T5 tokens."""


def _kontext_info(**fields: Any) -> ModelInfo:
    return ModelInfo("kontext", 16, 1024, SCHEDULER_NAMES, 512, modes=("txt2img", "instruct"), token_patch=16,
                     text_tokens=TEXT, hidden_size=D, instruct_images=1,
                     instruct_references=partial(kontext.reference_sizes, multiple=16), **fields)


def test_the_reference_tokens_by_the_models_resize_rules() -> None:
    """Kontext: a 640x480 input goes to the preferred resolution nearest 4:3, 1184x880 (74 x 55 tokens); a 2:3
    input to 832x1248. Qwen-Image-Edit: 1024² at each input's aspect, to multiples of 32: 4:3 is 1184x896 (74 x 56),
    1:1 1024x1024 (64 x 64); two images add both."""
    info = _kontext_info()
    assert info.references(((640, 480),)) == ((1184, 880),) and info.reference_tokens(((640, 480),)) == 74 * 55
    assert info.reference_tokens(((400, 600),)) == (832 // 16) * (1248 // 16)
    assert info.reference_tokens(()) == 0
    qwen = ModelInfo("qwen-edit", 16, 1024, SCHEDULER_NAMES, 1024, token_patch=16, text_tokens=TEXT, hidden_size=D,
                     instruct_images=3, instruct_references=qwen_edit.reference_sizes)
    assert qwen.references(((640, 480), (300, 300))) == ((1184, 896), (1024, 1024))
    assert qwen.reference_tokens(((640, 480), (300, 300))) == 74 * 56 + 64 * 64
    unet = ModelInfo("sd", 64, 512, SCHEDULER_NAMES, 77, instruct_references=qwen_edit.reference_sizes)
    assert unet.reference_tokens(((640, 480),)) == 0  # a UNet has no token sequence to lengthen


def test_a_step_with_references_costs_the_longer_sequences_work() -> None:
    """A DiT's step is N(12d + 2N) per block: 1024x1024 is 4096 image + 512 text tokens; a Kontext edit adds
    4070. Measured 1 s per image-step at that size, 20 steps: 20 s for the generation; the edit's 20 steps cost
    the ratio of the two works more, so a 30 s deadline admits the generation and refuses the edit (naming the
    reference tokens in the basis). Without the tokens both would be priced at 20 s."""
    info = _kontext_info()
    tokens = info.reference_tokens(((640, 480),))
    plain, longer = 4096 + TEXT, 4096 + TEXT + tokens
    assert info.work(1024, 1024, tokens) / info.work(1024, 1024) == pytest.approx(
        longer * (12 * D + 2 * longer) / (plain * (12 * D + 2 * plain)))
    cost = CostModel(info.work, info.work_basis)
    cost.seed(1024, 1024, 1, 20, 20.0)
    generation, edit = Cost(1024, 1024, 20, 1), Cost(1024, 1024, 20, 1, tokens)
    plain_s, edit_s = cost.estimate(generation), cost.estimate(edit)
    assert plain_s is not None and edit_s is not None and plain_s.seconds == pytest.approx(20.0)
    assert edit_s.seconds == pytest.approx(20.0 * info.work(1024, 1024, tokens) / info.work(1024, 1024))
    assert edit_s.seconds > 37 and f"to {tokens} reference tokens" in edit_s.basis
    admit(cost, [generation], 0.0, 30.0, "test")
    with pytest.raises(InvalidRequestError) as refused:
        admit(cost, [edit], 0.0, 30.0, "test")
    assert refused.value.param == "steps" and "reference tokens" in refused.value.message
    scaled = CostModel(info.work, info.work_basis)  # a size not measured: scaled by work, then by the references
    scaled.seed(512, 512, 1, 1, 1.0)
    a, b = scaled.estimate(Cost(1024, 1024, 1, 1)), scaled.estimate(Cost(1024, 1024, 1, 1, tokens))
    assert a is not None and b is not None
    assert b.seconds / a.seconds == pytest.approx(info.work(1024, 1024, tokens) / info.work(1024, 1024))


def test_edits_are_learned_apart_from_generations_of_their_size() -> None:
    """A live edit's steps are measured under its own key (size and reference tokens): they price the next edit
    as measured and leave the same size's generation at its own figure (an edit's slower steps folded into the
    size's would overprice every generation there, and an edit priced from them would count its tokens twice)."""
    info = _kontext_info()
    cost = CostModel(info.work, info.work_basis)
    cost.seed(1024, 1024, 1, 1, 1.0)
    cost.observe_step(1024, 1024, 1, 2.5, tokens=4070)
    cost.observe_step(1024, 1024, 1, 2.5, tokens=4070)
    generation, edit = cost.estimate(Cost(1024, 1024, 1, 1)), cost.estimate(Cost(1024, 1024, 1, 1, 4070))
    assert generation is not None and edit is not None
    assert generation.seconds == pytest.approx(1.0) and edit.seconds == pytest.approx(2.5)
    assert edit.basis == "measured at 1024x1024 + 4070 reference tokens"
    assert cost.snapshot() == {"1024x1024": 1.0, "1024x1024 + 4070 reference tokens": 2.5}


def _flux_dev(root: Path) -> Path:
    for rel, body in CONFIGS["flux-dev"].items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(json.dumps(body), encoding="utf-8")
    return root


def test_the_denoiser_and_the_encoder_stages_count_the_references(tmp_path: Path) -> None:
    """The released FLUX.1 [dev] configs (fp32, no weights) at 1024x1024: the transformer's block over 512 text +
    4096 image tokens, and with a 1184x880 reference 4070 more (one row: guidance is embedded); the reference
    goes through the VAE encoder at its own size, once per request."""
    memory = rm.for_folder(_flux_dev(tmp_path))
    assert memory is not None
    ref = ((1184, 880),)
    plain, edit = memory.need(1024, 1024, 1, 1), memory.need(1024, 1024, 1, 1, references=ref)

    def block(tokens: int) -> int:
        return int((tokens * D * 20 * 4 + 24 * tokens * tokens * 4 * mp.SCORE_BUFFERS) * rm.ARENA_SLACK)

    assert dict(plain.stages)["denoiser"] == block(TEXT + 4096)
    assert dict(edit.stages)["denoiser"] == block(TEXT + 4096 + 74 * 55)
    assert edit.peak_bytes > plain.peak_bytes and "VAE encode" not in dict(plain.stages)
    assert dict(edit.stages)["VAE encode"] == int(memory.stage("vae_encoder", 1184, 880, 1) * rm.ARENA_SLACK)
    two = memory.need(1024, 1024, 2, 2, references=ref)  # two images of one request: one encode, two rows
    assert dict(two.stages)["VAE encode"] == dict(edit.stages)["VAE encode"]
    assert dict(two.stages)["denoiser"] == 2 * block(TEXT + 4096 + 74 * 55)
    if edit.stage == "denoiser":
        assert "plus 4070 reference tokens" in edit.why


# ---- through the app ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TokenMemory:
    """A memory model whose denoiser holds ``per_token`` bytes per token of a row (its image tokens at 16 pixels
    a side, plus its reference tokens)."""

    per_token: int
    factor: int = 8

    def need(self, width: int, height: int, denoise_images: int, images: int, encode: bool = False,
             references: tuple[tuple[int, int], ...] = (), controls: int = 0) -> MemoryNeed:
        tokens = (width // 16) * (height // 16) + sum((w // 16) * (h // 16) for w, h in references)
        stages = (("denoiser", tokens * denoise_images * self.per_token),)
        return MemoryNeed(stages[0][1], "denoiser", stages, f"{tokens} tokens")


class KontextFake(FakeEngine):
    """The fake engine as an instruction-edit model with Kontext's reference rule and a token memory model."""

    memory = TokenMemory(1 * MIB)

    @property
    def info(self) -> ModelInfo:
        return ModelInfo("fake-kontext", 16, 64, SCHEDULER_NAMES, 77, modes=("txt2img", "img2img"),
                         edit_schedulers=SCHEDULER_NAMES, instruct_images=1, token_patch=16, text_tokens=8,
                         hidden_size=64, instruct_references=partial(kontext.reference_sizes, multiple=16),
                         instruct_size=partial(kontext.kontext_size, default=64, max_area=64 * 64),
                         memory=self.memory)


def _settings(budget_mb: int) -> Settings:
    dev = load_settings("dev")
    return dev.model_copy(update={"limits": dev.limits.model_copy(update={"memory_budget_mb": budget_mb}),
                                  "queue": dev.queue.model_copy(update={"max_batch": 1})})


@pytest.fixture
def client() -> Iterator[TestClient]:
    """1 GiB: a 64x64 generation is 16 tokens (16 MiB); the same size's edit adds a 1024x1024 reference's 4096
    tokens (4.02 GiB)."""
    yield from start(KontextFake(), _settings(1024))


def _png() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (640, 640), (200, 10, 10)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_an_edit_is_refused_on_memory_where_the_same_size_generation_runs(client: TestClient) -> None:
    body = {"prompt": "put a hat on it", "size": "64x64", "steps": "1"}
    assert client.post("/v1/images/generations", json={**body, "steps": 1}).status_code == 200
    refused = client.post("/v1/images/edits", data=body, files=[("image", ("in.png", _png(), "image/png"))])
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "size" and "4112 tokens" in error["message"], error
    assert 'sdserve_requests_refused_total{reason="over_memory"} 1.0' in client.get("/metrics").text

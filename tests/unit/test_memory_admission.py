"""Admission on memory (issue 43, item 2) and admission counting every image (item 8's survivor).

The estimate (engines/health/request_memory.py) is checked against figures derived by hand from the model
configs; the refusal, its message and its field go through the real app on the fake engine; the budget's sources
(the setting, NVML, the container's limit) each once. The real arenas and the 1024x1792 reproducer: the
integration and e2e tests of the same name."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from engines.errors import InvalidRequestError
from engines.health import request_memory as rm
from engines.types.health import GpuSample
from engines.types.model import MemoryNeed, ModelInfo
from server import admission
from server.admission import MemoryAsk, MemoryBudget, admit_memory, memory_budget
from server.settings import Settings, load_settings
from tests.unit.fakes import FakeEngine, StepFakeEngine, start, wait_for

CONFIGS = json.loads((Path(__file__).resolve().parents[1] / "data" / "model_configs.json").read_text())
GEN, A1111 = "/v1/images/generations", "/sdapi/v1/txt2img"
MIB, GIB = 1 << 20, 1 << 30


def _sd15(root: Path) -> Path:
    """SD 1.5's released configs (tests/data/model_configs.json), no weights: fp32 activations."""
    for rel, body in CONFIGS["sd15"].items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(json.dumps(body), encoding="utf-8")
    return root


# ---- the estimate, by hand ------------------------------------------------------------------------------------

def test_sd15_at_1024x1792_by_hand(tmp_path: Path) -> None:
    """The issue's request: latent 128 x 224 = 28,672 tokens. The UNet's first level attends over all of them
    with 8 heads at width 320, two rows (guidance); the VAE's mid-block attention is the 3.29 GB score matrix."""
    memory = rm.for_folder(_sd15(tmp_path))
    assert memory is not None and memory.factor == 8
    need = memory.need(1024, 1792, 1, 1)
    tokens = 128 * 224
    unet = 2 * (tokens * 320 * 20 * 4 + 8 * tokens**2 * 4 * 2)  # rows x (block tensors + two fp32 score buffers)
    assert unet == 106_694_705_152
    scores = tokens**2 * 4
    assert scores == 3_288_334_336  # the VAE's one attention buffer of the issue
    vae_mid = tokens * 512 * 20 * 4 + 2 * scores
    vae_conv = (1024 * 1792) * 256 * 4 * 4  # full size, the upsampler's 256 channels, four live fp32 tensors
    assert vae_mid == 7_751_073_792 > vae_conv == 7_516_192_768
    images = 1024 * 1792 * 3 * 4 * 5
    stages = dict(need.stages)
    assert stages["denoiser"] == int(unet * 1.4) == 149_372_587_212
    assert stages["VAE decode"] == int((vae_mid + images) * 1.4) == 11_005_643_980
    assert need.stage == "denoiser" and need.peak_bytes == stages["denoiser"]
    assert "28672 latent pixels" in need.why


def test_the_vae_and_encoder_stages_by_hand(tmp_path: Path) -> None:
    """At 512x512 with four images (SD 1.5): the VAE decoder's conv stage (full size, 256 channels x 4 tensors)
    outweighs its mid attention; the encoder runs only when asked; images and call images count apart."""
    memory = rm.for_folder(_sd15(tmp_path))
    assert memory is not None
    need = memory.need(512, 512, 4, 4, encode=True)
    stages = dict(need.stages)
    latent = 64 * 64
    mid = latent * 512 * 80 + 2 * latent**2 * 4
    conv = 512 * 512 * 256 * 16
    assert conv == 1_073_741_824 > mid == 301_989_888
    assert stages["VAE decode"] == int(4 * (conv + 512 * 512 * 60) * 1.4)
    encoder = max((512 * 512 >> 2 * k) * ch for k, ch in enumerate((128, 256, 512, 512))) * 4 * 4
    assert stages["VAE encode"] == int(4 * max(encoder, mid) * 1.4)
    assert "VAE encode" not in dict(memory.need(512, 512, 4, 4).stages)
    one = dict(memory.need(512, 512, 4, 1).stages)  # four images share the call, one is decoded
    assert one["denoiser"] == stages["denoiser"] and one["VAE decode"] * 4 == pytest.approx(stages["VAE decode"], 1e-6)


def test_the_tiny_model_and_an_unknown_folder(tiny_model: Path, tmp_path: Path) -> None:
    """The tiny model's exported files (fp32): its VAE's 64-channel mid attention at 1024x1792 (the e2e
    reproducer's request); a folder that is no family gives no estimate (and refuses nothing)."""
    memory = rm.for_folder(tiny_model)
    assert memory is not None
    stages = dict(memory.need(1024, 1792, 1, 1).stages)
    tokens = 128 * 224
    assert stages["VAE decode"] == int((tokens * 64 * 80 + 2 * tokens**2 * 4 + 1024 * 1792 * 60) * 1.4)
    assert rm.for_folder(tmp_path) is None  # no configs: no family facts to estimate by
    assert rm.for_folder(tmp_path / "absent") is None


# ---- the refusal ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PerPixel:
    """A memory model whose peak is ``bytes_per_pixel`` x pixels x the images of its largest stage."""

    bytes_per_pixel: int = 1000
    factor: int = 8

    def need(self, width: int, height: int, denoise_images: int, images: int, encode: bool = False,
             references: tuple[tuple[int, int], ...] = (), controls: int = 0) -> MemoryNeed:
        stages = (("denoiser", width * height * denoise_images * self.bytes_per_pixel),
                  ("VAE decode", width * height * images * self.bytes_per_pixel))
        stage, peak = max(stages, key=lambda s: s[1])
        return MemoryNeed(peak, stage, stages, "per pixel")


def test_admit_memory_names_the_budget_the_estimate_and_the_field() -> None:
    budget = MemoryBudget(512 * MIB, "[limits] memory_budget_mb")
    model = PerPixel()
    admit_memory(model, budget, [MemoryAsk(512, 512, 2, 2, 2)])  # 500 MiB
    with pytest.raises(InvalidRequestError) as size:
        admit_memory(model, budget, [MemoryAsk(1024, 1792, 1, 1, 1)])
    assert size.value.param == "size"
    assert "estimated peak memory 1.71 GiB for 1 image(s) at 1024x1792" in size.value.message
    assert "memory budget 0.50 GiB ([limits] memory_budget_mb)" in size.value.message
    with pytest.raises(InvalidRequestError) as count:  # one image of the same size fits: lower the count
        admit_memory(model, budget, [MemoryAsk(512, 512, 3, 3, 3)])
    assert count.value.param == "n" and "n (A1111: batch_size)" in count.value.message
    with pytest.raises(InvalidRequestError) as shared:  # alone it fits; the call it may share does not
        admit_memory(model, budget, [MemoryAsk(512, 512, 1, 4, 1)])
    assert "max_batch" in shared.value.message and shared.value.param == "size"
    admit_memory(None, budget, [MemoryAsk(4096, 4096, 16, 16, 16)])  # no estimate: nothing refused
    admit_memory(model, MemoryBudget(), [MemoryAsk(4096, 4096, 16, 16, 16)])  # no budget: likewise


def test_the_budget_from_the_setting_the_device_and_the_container(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    assert memory_budget(3000, "cpu", None) == MemoryBudget(3000 * MIB, "[limits] memory_budget_mb")
    gpu = memory_budget(0, "cuda", GpuSample(0, 0, 0, 0, memory_used_bytes=30 * GIB, memory_total_bytes=141 * GIB))
    assert gpu.bytes == 111 * GIB and "30.00 GiB of 141.00 GiB in use" in gpu.source
    assert memory_budget(0, "cuda", None).bytes is None
    limit = tmp_path / "memory.max"
    limit.write_text("8589934592\n")
    monkeypatch.setattr(admission, "CGROUP_LIMITS", (limit,))
    monkeypatch.setattr(admission, "resident_bytes", lambda: 3 * GIB)
    cpu = memory_budget(0, "cpu", None)
    assert cpu.bytes == 5 * GIB and "cgroup memory limit" in cpu.source
    limit.write_text("max\n")  # no limit: the host's RAM
    assert "the host's RAM" in memory_budget(0, "cpu", None).source


# ---- through the app ------------------------------------------------------------------------------------------

class MeasuredEngine(FakeEngine):
    """The fake with a memory model (as the real engine's ModelInfo carries one)."""

    def __init__(self, memory: PerPixel) -> None:
        super().__init__()
        self.memory = memory

    @property
    def info(self) -> ModelInfo:
        return replace(super().info, memory=self.memory)


def _settings(budget_mb: int, **queue: Any) -> Settings:
    dev = load_settings("dev")
    return dev.model_copy(update={"limits": dev.limits.model_copy(update={"memory_budget_mb": budget_mb}),
                                  "queue": dev.queue.model_copy(update=queue)})


@pytest.fixture
def engine() -> MeasuredEngine:
    return MeasuredEngine(PerPixel(1000))


@pytest.fixture
def client(engine: MeasuredEngine) -> Iterator[TestClient]:
    """A 1 GiB budget; one image per denoiser call, so a request's own images are what counts."""
    yield from start(engine, _settings(1024, max_batch=1))


def test_openai_counts_n(client: TestClient, engine: MeasuredEngine) -> None:
    """512x512 x 1000 B = 250 MiB per image: n = 4 fits 1 GiB, n = 5 does not (n itself is refused, not run).
    Admission counting one image would let it run."""
    assert client.post(GEN, json={"prompt": "a", "size": "512x512", "n": 4, "steps": 1}).status_code == 200
    engine.batches.clear()
    engine.memory = PerPixel(2000)  # 500 MiB per image: 3 images are over
    refused = client.post(GEN, json={"prompt": "a", "size": "512x512", "n": 3, "steps": 1})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "n" and "estimated peak memory 1.46 GiB for 3 image(s)" in error["message"]
    assert engine.batches == [], "a refused request ran"
    assert client.post(GEN, json={"prompt": "a", "size": "512x512", "n": 2, "steps": 1}).status_code == 200
    assert 'sdserve_requests_refused_total{reason="over_memory"} 1.0' in client.get("/metrics").text


def test_a1111_counts_batch_size_and_a_size_over_the_budget(client: TestClient, engine: MeasuredEngine) -> None:
    engine.memory = PerPixel(2000)
    over = client.post(A1111, json={"prompt": "a", "width": 512, "height": 512, "batch_size": 3, "steps": 1})
    assert over.status_code == 422, over.text
    assert over.json()["detail"][0]["loc"][-1] == "batch_size" and "batch_size" in over.json()["detail"][0]["msg"]
    fits = client.post(A1111, json={"prompt": "a", "width": 512, "height": 512, "batch_size": 2, "n_iter": 3,
                                    "steps": 1})
    assert fits.status_code == 200, fits.text  # iterations run one after another: memory is one batch's
    assert len(fits.json()["images"]) == 6
    engine.memory = PerPixel(5000)  # one 512x512 image: 1.22 GiB
    huge = client.post(A1111, json={"prompt": "a", "width": 512, "height": 512, "steps": 1})
    assert huge.status_code == 422 and huge.json()["detail"][0]["loc"][-1] == "size"
    assert "memory budget 1.00 GiB ([limits] memory_budget_mb)" in huge.json()["detail"][0]["msg"]


def test_a_request_that_fits_alone_is_admitted_and_shares_only_the_calls_that_fit(engine: MeasuredEngine) -> None:
    """Issue 57 point 3: max_batch 4, 1 GiB, 2000 B per pixel: one 512x512 image (500 MiB) fits alone, so it is
    admitted; a denoiser call at that size holds at most 2 images (call_images), what admission prices; 3 images in
    one request do not fit even alone: refused naming n. (Before, one image was refused for a 4-image call it might
    share.)"""
    engine.memory = PerPixel(2000)
    for client in start(engine, _settings(1024, max_batch=4)):
        assert client.post(GEN, json={"prompt": "a", "size": "512x512", "steps": 1}).status_code == 200
        service = client.app.state.service  # type: ignore[attr-defined]
        assert service.call_images(512, 512) == 2 and service.call_images(256, 256) == 4
        refused = client.post(GEN, json={"prompt": "a", "size": "512x512", "steps": 1, "n": 3})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "n"
        assert client.post(GEN, json={"prompt": "a", "size": "512x512", "steps": 1, "n": 2}).status_code == 200


@dataclass(frozen=True)
class HeavyDecode(PerPixel):
    """The VAE decode takes three times the denoiser's bytes per pixel (as at large sizes on a real model)."""

    def need(self, width: int, height: int, denoise_images: int, images: int, encode: bool = False,
             references: tuple[tuple[int, int], ...] = (), controls: int = 0) -> MemoryNeed:
        stages = (("denoiser", width * height * denoise_images * self.bytes_per_pixel),
                  ("VAE decode", width * height * images * 3 * self.bytes_per_pixel))
        stage, peak = max(stages, key=lambda s: s[1])
        return MemoryNeed(peak, stage, stages, "per pixel")


def test_step_level_decodes_are_priced_as_they_run_one_part_at_a_time(engine: MeasuredEngine) -> None:
    """Issue 57: under step-level batching a request's decode runs ``[queue] decode_images`` images at a time (1 on
    the dev profile): 2 images of 512x512 (denoiser 500 MiB, one decode 750 MiB) fit 1 GiB; micro-batching
    decodes the batch at once (1.46 GiB) and refuses them naming n."""
    engine.memory = HeavyDecode(1000)
    for client in start(engine, _settings(1024, max_batch=1)):
        assert client.post(GEN, json={"prompt": "a", "size": "512x512", "steps": 1, "n": 2}).status_code == 200
    for client in start(engine, _settings(1024, max_batch=1, batching="micro")):
        refused = client.post(GEN, json={"prompt": "a", "size": "512x512", "steps": 1, "n": 2})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "n", refused.text


# ---- item 8: admission by cost counts batch_size x n_iter -----------------------------------------------------

def test_cost_admission_counts_batch_size_times_n_iter() -> None:
    """10 ms per image-step, 50 steps, a 2.5 s deadline: 2 x 3 = 6 images are 3 s, refused at once; 3 x 1 and
    1 x 3 (3 images, 1.5 s) are admitted. Admission counting only batch_size or only n_iter (3 images either way)
    would let 2 x 3 run; on OpenAI, n = 4 (2 s) is refused under a 1.9 s deadline, as counting one image (0.5 s)
    would not."""
    engine = FakeEngine()
    for client in start(engine, load_settings("dev")):
        client.app.state.service.cost.per_image_step[(64, 64)] = 0.01  # type: ignore[attr-defined]
        body = {"prompt": "a", "width": 64, "height": 64, "steps": 50}
        deadline = {"x-sdserve-timeout-s": "2.5"}
        refused = client.post(A1111, json={**body, "batch_size": 2, "n_iter": 3}, headers=deadline)
        assert refused.status_code == 422, refused.text
        assert "estimated compute 3.0s (6 image(s)" in refused.json()["detail"][0]["msg"]
        openai = client.post(GEN, json={"prompt": "a", "size": "64x64", "steps": 50, "n": 4},
                             headers={"x-sdserve-timeout-s": "1.9"})
        assert openai.status_code == 400 and "estimated compute 2.0s (4 image(s)" in openai.json()["error"]["message"]
        assert engine.batches == []
        for size, iters in ((3, 1), (1, 3)):  # (live batches then refine the cost: checked last)
            answer = client.post(A1111, json={**body, "batch_size": size, "n_iter": iters}, headers=deadline)
            assert answer.status_code == 200, answer.text


class SteppedMeasured(StepFakeEngine):
    """The step-level fake with a memory model: 2000 B per pixel, so a 512x512 call holds two images in 1 GiB."""

    @property
    def info(self) -> ModelInfo:
        return replace(super().info, memory=PerPixel(2000))


def test_the_step_scheduler_shares_a_call_only_up_to_what_fits_the_budget() -> None:
    """Three 1-image 512x512 requests with max_batch 4 and a 1 GiB budget: every tick holds at most the 2 images a
    call fits (ImageService.call_images through step_policy.choose's rooms), and some tick holds 2 (calls are
    still shared). Decided on events: the first tick is held until the other two are queued."""
    engine = SteppedMeasured()
    try:
        for client in start(engine, _settings(1024, max_batch=4)):
            engine.hold.clear()
            answers: list[Any] = []

            def post(prompt: str, into: list[Any] = answers, to: TestClient = client) -> threading.Thread:
                worker = threading.Thread(target=lambda: into.append(to.post(
                    "/sdapi/v1/txt2img", json={"prompt": prompt, "width": 512, "height": 512, "steps": 4})))
                worker.start()
                return worker

            workers = [post("a")]
            wait_for(client, "/sdapi/v1/progress", lambda r: r.json()["state"]["job_count"] == 1)
            assert engine.in_tick.wait(20)
            workers += [post("b"), post("c")]
            wait_for(client, "/sdapi/v1/progress", lambda r: r.json()["state"]["job_count"] == 3)
            engine.hold.set()
            for worker in workers:
                worker.join(30)
            assert [a.status_code for a in answers] == [200] * 3
            sizes = [len(t) for t in engine.tick_log]
            assert max(sizes) == 2 and sum(sizes) == 12, engine.tick_log
    finally:
        engine.hold.set()

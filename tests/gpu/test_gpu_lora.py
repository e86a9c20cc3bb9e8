"""LoRA on a real GPU (skipped without one): the LoRA variant sessions pass the strict CUDA policy (placement audit,
no CPU fallback), the merged weights live in device memory, A -> B -> A returns to A bit-exactly, and the adapted
image matches the CPU's within 1/255 (the TensorRT policy's variant providers: tests/integration/test_lora.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engines.config import LoraSettings, RuntimeSettings
from engines.engine import OrtEngine
from engines.types.request import Batch, ImageSpec, LoraUse
from tests import lora_files as lf

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not Path("/dev/nvidia0").exists(), reason="needs an NVIDIA GPU")]


def _images(engine: OrtEngine, uses: tuple[LoraUse, ...]) -> np.ndarray:
    batch = Batch((ImageSpec("a lighthouse", seed=3),), 64, 64, 6, "euler", loras=uses)
    return np.asarray(engine.generate(batch).images[0].image).astype(np.int16)


def test_lora_variants_pass_the_cuda_policy_and_return_to_a_exactly(tiny_build: tuple[Path, Path],
                                                                    tmp_path: Path) -> None:
    import diffusers

    onnx_dir, diffusers_dir = tiny_build
    pipe = diffusers.StableDiffusionPipeline.from_pretrained(diffusers_dir, safety_checker=None)
    for name, seed in (("a", 1), ("b", 2)):
        lf.peft_file(tmp_path / f"{name}.safetensors",
                     {"unet": lf.lora_factors(pipe.unet, lf.UNET_TARGETS, 4, seed=seed, scale=0.5)})
    lora = LoraSettings(dir=str(tmp_path))
    gpu = OrtEngine(onnx_dir, RuntimeSettings(providers=("CUDAExecutionProvider",), lora=lora))
    cpu = OrtEngine(onnx_dir, RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True, lora=lora))
    gpu.preflight()
    gpu.load()
    cpu.load()
    try:
        files = {f.name: f.sha256 for f in gpu.loras()}
        a, b = (LoraUse("a", files["a"]),), (LoraUse("b", files["b"]),)
        first, _, again = _images(gpu, a), _images(gpu, b), _images(gpu, a)
        assert np.array_equal(first, again)
        assert (np.abs(first - _images(cpu, a)) <= 1).mean() >= 0.999
        snapshot = gpu.capabilities()
        assert snapshot.accelerated, snapshot.verdict
        for name in ("unet:lora", "text_encoder:lora"):
            session = snapshot.sessions[name]
            assert session.providers_used[0] == "CUDAExecutionProvider"
            assert session.placement is not None and session.placement.ok, session.placement
        merged = gpu._lora.weights(a)["unet"]  # type: ignore[union-attr]
        assert all(v.device_name().lower() == "cuda" for v in merged.values())
    finally:
        gpu.close()
        cpu.close()


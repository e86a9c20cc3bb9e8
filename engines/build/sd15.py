"""An SD 1.5-architecture model with random weights, built on the node (no model hub), and diffusers' torch fp16
pipeline timed on the same weights: the two halves of `sdserve accept`'s latency section.

The configs are SD 1.5's published architecture written out (UNet2DConditionModel 320/640/1280/1280, CLIP ViT-L/14
text encoder: 768 wide, 12 layers; AutoencoderKL 128/256/512/512), so the FLOPs and memory traffic are those of the
real model; the weights are torch's default init under seed 0, so the images are noise. Build-time only (torch).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from engines.build.clip_vocab import find_bpe_source, write_tokenizer
from engines.build.export import export_components
from engines.build.tiny import SCHEDULER, save_diffusers

SEED = 0
SIZE = 512
TEXT_ENCODER = dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12, num_hidden_layers=12,
                    vocab_size=49408, max_position_embeddings=77, hidden_act="quick_gelu",
                    bos_token_id=49406, eos_token_id=49407, pad_token_id=49407, projection_dim=768)
UNET = dict(sample_size=64, in_channels=4, out_channels=4, layers_per_block=2,
            block_out_channels=(320, 640, 1280, 1280),
            down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=768, attention_head_dim=8, norm_num_groups=32)
VAE = dict(block_out_channels=(128, 256, 512, 512), in_channels=3, out_channels=3, latent_channels=4,
           layers_per_block=2, down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
           sample_size=SIZE, norm_num_groups=32, scaling_factor=0.18215)


def make_components(seed: int = SEED, configs: tuple[dict[str, Any], dict[str, Any], dict[str, Any]] | None = None,
                    ) -> dict[str, Any]:
    """text_encoder, unet, vae (fp32, CPU) and the PNDM scheduler, each module seeded alike. ``configs`` replaces
    (text encoder, UNet, VAE) configs: the same code builds the tiny model in tests."""
    from diffusers import AutoencoderKL, PNDMScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    text_cfg, unet_cfg, vae_cfg = configs or (TEXT_ENCODER, UNET, VAE)
    torch.manual_seed(seed)
    text_encoder = CLIPTextModel(CLIPTextConfig(**text_cfg)).eval()
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(**unet_cfg).eval()
    torch.manual_seed(seed)
    vae = AutoencoderKL(**vae_cfg).eval()
    return {"text_encoder": text_encoder, "unet": unet, "vae": vae, "scheduler": PNDMScheduler(**SCHEDULER)}


def build_sd15(out: Path, diffusers_out: Path, bpe: Path | None = None,
               configs: tuple[dict[str, Any], dict[str, Any], dict[str, Any]] | None = None) -> Path:
    """Export the random-weight SD 1.5-architecture model to ``out`` (ONNX layout + manifest; the fp32 UNet is
    over 2 GB, so the exporter writes its weights as external data next to it) and save the same weights as a
    diffusers folder at ``diffusers_out`` for the torch reference."""
    components = make_components(configs=configs)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_dir = Path(tmp) / "tokenizer"
        write_tokenizer(find_bpe_source(bpe), tokenizer_dir)
        scheduler_config = {"_class_name": "PNDMScheduler", **components["scheduler"].config, "clip_sample": False}
        export_components(components["text_encoder"], components["unet"], components["vae"], scheduler_config,
                          tokenizer_dir, out, {"kind": "sd15-architecture-random", "seed": SEED})
        save_diffusers(components, tokenizer_dir, diffusers_out)  # after the export, as in tiny.py
    return out


def torch_reference(diffusers_dir: Path, scheduler_config: Path, steps: int = 50, size: int = SIZE,
                    device_id: int = 0, repeats: int = 3) -> tuple[float, float]:
    """diffusers' StableDiffusionPipeline in fp16 on ``cuda:device_id``, Euler, CFG 7.5, batch 1, after one warm-up
    run: (median ms per denoising step, median s per image). Steps are timed between ``callback_on_step_end`` calls
    with the device synchronized, so the text encoder and VAE are out of the per-step number and in the per-image."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionPipeline

    device = torch.device("cuda", device_id)
    pipe = StableDiffusionPipeline.from_pretrained(diffusers_dir, torch_dtype=torch.float16, safety_checker=None)
    pipe.scheduler = EulerDiscreteScheduler.from_config(json.loads(scheduler_config.read_text(encoding="utf-8")))
    pipe = pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    stamps: list[float] = []

    def on_step(_pipe: Any, _step: int, _timestep: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        torch.cuda.synchronize(device)
        stamps.append(time.perf_counter())
        return kwargs

    per_step, per_image = [], []
    for run in range(repeats + 1):
        stamps.clear()
        generator = torch.Generator(device).manual_seed(run)
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        with torch.inference_mode():
            pipe("an astronaut riding a horse", height=size, width=size, num_inference_steps=steps,
                 guidance_scale=7.5, generator=generator, output_type="np", callback_on_step_end=on_step)
        torch.cuda.synchronize(device)
        if run:  # run 0 warms up: cuDNN autotuning, allocator growth
            per_image.append(time.perf_counter() - start)
            per_step.append((stamps[-1] - stamps[0]) / max(1, len(stamps) - 1))
    del pipe
    torch.cuda.empty_cache()
    return statistics.median(per_step) * 1000.0, statistics.median(per_image)

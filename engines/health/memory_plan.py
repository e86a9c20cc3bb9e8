"""The memory a model folder needs on the device and on the host, with and without LoRA, before anything loads.

Weights come from the files when the component is exported (``model.onnx``: the initializers' element counts and
types read from the protobuf's headers, never their bytes, plus the external data files' sizes by ``stat``), and
otherwise from the component's diffusers ``config.json`` (parameter counts of FluxTransformer2DModel,
SD3Transformer2DModel, QwenImageTransformer2DModel, UNet2DConditionModel, T5EncoderModel,
CLIPTextModel(WithProjection), Qwen2.5-VL's language model and the halves of AutoencoderKL and
AutoencoderKLQwenImage, counted the way those modules hold them; tests/unit/test_memory_plan.py and
tests/unit/test_qwen_memory.py check every formula against torch). So a config-only folder (a few kB) is enough to
size a Flux or Qwen-Image deployment.

What the plan charges, and why (each line is what this codebase does today, not a general rule):

- **Base weights** at the serving dtype: under a TensorRT policy the engine precision `sdserve engines build` uses
  (engines/build/trtplan_dit.py ``precision``: a half-precision DiT export's own dtype; an fp32 or config-only one
  the registry's, bf16 transformer, T5, Qwen2.5-VL and VAE, fp16 CLIP; the UNet families fp16 unless ``tensorrt.fp16``
  is off), else the files' own dtype. One engine per served size
  (engines/artifacts.py ``context_models``), each holding its own weights: × the served sizes under TensorRT.
- **Activations** (``ACTIVATIONS``): conservative; no fused attention assumed, so every attention's score matrix
  is counted in fp32. TensorRT keeps one execution context per engine: summed; the CUDA arena is shared and one
  component runs at a time: the largest.
- **LoRA** (engines/lora/manager.py): a component a library file adapts gets a *variant session* built from its
  plain ONNX file (on CUDA under a TensorRT policy), a second full copy of its weights at the file's dtype; merged
  sets are cached up to ``[runtime.lora] cache_mb``; each merge uploads W through a device buffer kept per weight
  shape. A set is refused when its merged tensors exceed ``cache_mb`` (``require_fits``).
- **First-block parts** (``sdserve engines export --first-block``; engines/pipelines/first_block.py
  ``decide_parts``): where the pipeline loads them, beside the full transformer, they are the transformer's weights
  a second time (plus the head a third), at the files' dtype, counted as components of their own; their
  activations are within the transformer's (they run in its place). Under a TensorRT policy they are not loaded
  (the TensorRT plan builds no engine for them) and the plan says so instead of counting them.
- **ControlNet** (``[runtime.controlnet] dir``; engines/health/controlnet_memory.py): the UNet's residual variant
  ``unet_controlnet/`` as a second UNet, each ControlNet's weights from its file, and two residual sets at the
  served shape.
- **Host**: sessions load one at a time. A TensorRT engine file is read whole into host memory before it is
  deserialized; ORT reads an inline ONNX file whole and memory-maps external data (page cache: reclaimable). The
  LoRA manager keeps a host copy of every adaptable weight of an inline component (``targets.base_weights``;
  external ones are memory maps), and builds an inline variant from a protobuf it loads, copies and serializes
  (four copies of the graph at once).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engines import architectures
from engines.config import RuntimeSettings
from engines.errors import ModelLoadError
from engines.health.fit_advice import advice
from engines.health.onnx_scan import scan_onnx
from engines.health.param_counts import (
    Tally,
    clip_text,
    decoder_channels,
    flux2_transformer,
    flux_transformer,
    ival,
    mistral3_text,
    qwen3_text,
    qwen_text,
    qwen_text_config,
    qwen_transformer,
    qwen_vae_decoder,
    qwen_vae_dims,
    qwen_vae_encoder,
    sd3_transformer,
    t5_encoder,
    unet,
    vae_decoder,
    vae_encoder,
    zimage_transformer,
)
from engines.numerics.qwen_tokenizer import TEMPLATE_DROP

GIB = 1 << 30
ITEMSIZE = {"fp32": 4, "fp16": 2, "bf16": 2}
ONNX_FLOATS = {1: "fp32", 10: "fp16", 16: "bf16", 11: "fp64"}
ONNX_ITEMSIZE = {1: 4, 2: 1, 3: 1, 4: 2, 5: 2, 6: 4, 7: 8, 9: 1, 10: 2, 11: 8, 12: 4, 13: 8, 16: 2}
"""Bytes per element of ONNX's TensorProto.DataType values (FLOAT=1 ... BFLOAT16=16)."""
PROTOBUF_LIMIT = 2 << 30
"""torch.onnx.export writes a graph whose weights pass protobuf's 2 GiB as external data."""
OVERHEAD = 2 * GIB
"""Device: CUDA context, cuBLAS/cuDNN handles and workspaces, IO buffers. Host: Python, ONNX Runtime, the CUDA
libraries and pinned staging. An allowance each, not a measurement."""
ACTIVATIONS = ("per row: tokens x width x 20 x dtype bytes (the widest point of a block: input, norm, q/k/v, "
               "attention out, the 4x MLP before and after its activation, concatenations) + heads x tokens^2 x 4 "
               "(one attention's fp32 scores, no fused kernel assumed); VAE: the largest level's pixels x channels "
               "x 6 x dtype bytes (x 8 for Qwen-Image's causal 3D VAE) + its mid attention's (latent pixels)^2 x 4; "
               "Qwen2.5-VL: its gated MLP's four intermediate-wide tensors in place of the 4x MLP's; rows: images, "
               "x2 under CFG")


SCORE_BUFFERS = 2
"""MEASURED: an unfused attention holds two fp32 score matrices at once (its MatMul's output and its Softmax's)."""
CONV_TENSORS = 4
"""MEASURED: a VAE's widest convolution stage holds about four tensors of its largest level at once."""
MEASURED = ("as ONNX Runtime was measured to hold them (tests/integration/test_arena_trim.py, on the tiny model): "
            "a block's heads x tokens^2 x 4 scores twice (MatMul and Softmax outputs); a VAE's widest level x "
            "4 tensors or its mid-block attention, whichever is larger (they run at different times)")

TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")
DENOISERS = ("unet", "transformer")
"""The components engines/lora/manager.py adapts (a variant session each, once a library file adapts it)."""


@dataclass(frozen=True)
class Layout:
    """What the folder is: its family, its components (name -> kind) and the facts activations depend on."""

    family: str
    parts: dict[str, str]
    cfg: bool
    """Classifier-free guidance: the denoiser and the text encoders run two rows per image."""
    text_tokens: int
    """The transformer's text tokens from the T5 (Flux, SD 3) or Qwen2.5-VL (Qwen-Image, padded to its
    ``max_sequence_length``) encoder; 0 for the UNet families."""
    trt_precision: dict[str, str]
    """The engine precision per component `sdserve engines build` uses (empty: ``tensorrt.fp16`` decides)."""
    factor: int = 8
    """The VAE's downsampling factor (2 ** (levels - 1))."""
    fp32_components: tuple[str, ...] = ()
    """Components whose engine stays fp32 (SDXL's force-upcast VAE)."""


def _vae_parts(folder: Path, prefix: str = "") -> dict[str, str]:
    encoder = (folder / "vae_encoder").is_dir() or (folder / "vae").is_dir()
    return {"vae_decoder": f"{prefix}vae_decoder", **({"vae_encoder": f"{prefix}vae_encoder"} if encoder else {})}


QWEN_TEMPLATE_TOKENS = TEMPLATE_DROP + 5
"""Tokens the Qwen2.5-VL encoder reads around the kept ones: the chat template's 34-token system prefix
(engines/numerics/qwen_tokenizer.py TEMPLATE_DROP) and its 5-token suffix (``<|im_end|>``, a newline,
``<|im_start|>assistant``, a newline, in the released vocabulary)."""


def layout(folder: Path) -> Layout:
    """The folder's family and components, from its JSON files (engines/pipelines/flow_family.py and family.py);
    ModelLoadError when it is no family sdserve serves."""
    from engines.pipelines.flow_family import detect_dit, is_dit_folder

    if not folder.is_dir():
        raise ModelLoadError(f"{folder} is not a folder")
    if is_dit_folder(folder):
        dit = detect_dit(folder)
        row = architectures.get(dit.base)
        parts = {**row.memory_parts, **_vae_parts(folder, row.vae_formulas)}
        from engines.health.dit_precision import precision  # the export's, as the TensorRT plan builds it

        return Layout(dit.name, parts, dit.cfg, dit.max_sequence_length, {p: precision(dit, p, folder) for p in parts},
                      _factor(folder))
    from engines.pipelines.unet_family import detect

    fam = detect(folder)
    parts = {"text_encoder": "clip", **({"text_encoder_2": "clip_projection"} if fam.xl else {}), "unet": "unet"}
    # any UNet request may ask for guidance > 1 (a Turbo model's default is 0): two rows per image, conservatively
    return Layout(fam.name, parts | _vae_parts(folder), True, 0, {}, _factor(folder),
                  ("vae_decoder", "vae_encoder") if fam.vae_force_upcast else ())


def _factor(folder: Path) -> int:
    vae = _config(folder, "vae_decoder")
    blocks, temporal = vae.get("block_out_channels"), vae.get("temperal_downsample")
    if isinstance(temporal, list) and not blocks:  # AutoencoderKLQwenImage: one 2x downsample per entry
        return 1 << len(temporal)
    return 1 << (len(blocks) - 1) if isinstance(blocks, list) and blocks else 8


def config(folder: Path, name: str) -> dict[str, Any]:
    """A component's config.json (a VAE half's from the diffusers ``vae`` folder when it has none); {} without."""
    return _config(folder, name)


def _config(folder: Path, name: str) -> dict[str, Any]:
    from engines.pipelines.unet_family import read_json

    found = read_json(folder / name / "config.json")
    return found or (read_json(folder / "vae" / "config.json") if name.startswith("vae_") else {})


def count(kind: str, config: Mapping[str, Any]) -> Tally:
    """Parameters of a component of ``kind`` from its config."""
    if kind in ("clip", "clip_projection"):
        architectures = config.get("architectures") or []
        return clip_text(config, kind == "clip_projection" or "CLIPTextModelWithProjection" in architectures)
    formulas = {"t5": t5_encoder, "flux_transformer": flux_transformer, "sd3_transformer": sd3_transformer,
                "unet": unet, "vae_decoder": vae_decoder, "vae_encoder": vae_encoder, "qwen_text": qwen_text,
                "qwen_image": qwen_transformer, "qwen_vae_decoder": qwen_vae_decoder,
                "qwen_vae_encoder": qwen_vae_encoder, "qwen3_text": qwen3_text,
                "zimage_transformer": zimage_transformer, "flux2_transformer": flux2_transformer,
                "mistral3_text": mistral3_text}
    return formulas[kind](config)


# ---- activations ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Served:
    """The largest shape one batch may have, and how the deployment runs it."""

    width: int
    height: int
    images: int
    """Images in one batch (``[queue] max_batch``, at least the largest warmed batch size)."""
    sizes: int = 1
    """Served sizes: under TensorRT one engine per size and component, each with its own weights."""
    tensorrt: bool = True
    """TensorRT first in the policy: the engines' precisions, and the LoRA variants on CUDA beside them."""
    trt_fp16: bool = True
    cache_bytes: int = 2048 << 20
    """``[runtime.lora] cache_mb`` in bytes."""
    extra_tokens: int = 0
    """An instruction edit's reference tokens joined to every denoiser row (request_memory.py ``need``)."""


def _block(rows: int, tokens: int, width: int, heads: int, item: int, scores: int = 1) -> int:
    """One transformer block's live tensors (``ACTIVATIONS``); ``scores``: fp32 score matrices alive at once."""
    return rows * (tokens * width * 20 * item + heads * tokens * tokens * 4 * scores)


def _heads(config: Mapping[str, Any], level: int) -> int:
    value = config.get("num_attention_heads") or config.get("attention_head_dim") or 8
    return int(value[min(level, len(value) - 1)] if isinstance(value, list | tuple) else value)


CAUSAL_PAD_FRAMES = 2
"""AutoencoderKLQwenImage's 3x3x3 causal convolutions on one frame: the padded input holds the frame and two zero
frames before it, two more tensors of the level than AutoencoderKL's 2D convolutions hold (from the module's
structure, not measured)."""


def _vae(config: Mapping[str, Any], rows: int, height: int, width: int, item: int, decoder: bool,
         measured: bool = False, pad_frames: int = 0) -> int:
    blocks = decoder_channels(config) if decoder else [int(b) for b in config.get("block_out_channels") or
                                                       (128, 256, 512, 512)]
    factor = 1 << (len(blocks) - 1)
    latent = (height // factor) * (width // factor)
    levels = list(reversed(blocks))
    widest = max((latent << 2 * k) * ch for k, ch in enumerate(levels)) if decoder else \
        max((height * width >> 2 * k) * ch for k, ch in enumerate(blocks))
    attention = config.get("mid_block_add_attention", True)
    if not measured:
        return rows * (widest * (6 + pad_frames) * item + (latent * latent * 4 if attention else 0))
    if decoder:  # MEASURED: an upsampler's conv runs at the next level's size with its own level's width
        widest = max((latent << 2 * k) * max(ch, levels[k - 1] if k else ch) for k, ch in enumerate(levels))
    # MEASURED: the convolutions at full size and the mid-block attention at latent size run at different times
    mid = _block(1, latent, blocks[-1], 1, item, SCORE_BUFFERS) if attention else 0
    return rows * max(widest * (CONV_TENSORS + pad_frames) * item, mid)


def _unet(config: Mapping[str, Any], rows: int, tokens: int, item: int, scores: int = 1) -> int:
    blocks = [int(b) for b in config.get("block_out_channels") or (320, 640, 1280, 1280)]
    down = list(config.get("down_block_types") or ["CrossAttnDownBlock2D"] * (len(blocks) - 1) + ["DownBlock2D"])
    return max(_block(rows, tokens >> 2 * k, ch, _heads(config, k) if "CrossAttn" in down[k] else 0, item, scores)
               for k, ch in enumerate(blocks))


def activations(kind: str, config: Mapping[str, Any], served: Served, lay: Layout, item: int,
                measured: bool = False) -> int:
    """Bytes of one component's live activations at the served shape (``ACTIVATIONS``), at ``item`` bytes per
    element; 0 without a config. ``measured``: as ONNX Runtime's CPU and CUDA providers were measured to hold them
    (``MEASURED``; what admission estimates a request by, engines/health/request_memory.py), else the plan's
    conservative rule."""
    if not config:
        return 0
    rows, w, h = served.images * (2 if lay.cfg else 1), served.width, served.height
    scores = SCORE_BUFFERS if measured else 1
    if kind in ("clip", "clip_projection"):
        return _block(rows, 77, ival(config, "hidden_size", 768), ival(config, "num_attention_heads", 12), item,
                      scores)
    if kind == "t5":
        return _block(rows, lay.text_tokens or 512, ival(config, "d_model", 4096), ival(config, "num_heads", 64), item,
                      scores)
    if kind == "qwen_text":  # the template's prefix and suffix around at most max_sequence_length kept tokens
        lm, tokens = qwen_text_config(config), QWEN_TEMPLATE_TOKENS + (lay.text_tokens or 512)
        d, ff = ival(lm, "hidden_size", 3584), ival(lm, "intermediate_size", 18944)
        gated = rows * tokens * max(0, 4 * ff - 8 * d) * item  # gate, up, SiLU(gate), their product
        return _block(rows, tokens, d, ival(lm, "num_attention_heads", 28), item, scores) + gated
    if kind == "qwen3_text":  # the templated prompt, at most max_sequence_length tokens in all (Z-Image)
        tokens, d = lay.text_tokens or 512, ival(config, "hidden_size", 2560)
        ff = ival(config, "intermediate_size", 9728)
        gated = rows * tokens * max(0, 4 * ff - 8 * d) * item
        return _block(rows, tokens, d, ival(config, "num_attention_heads", 32), item, scores) + gated
    if kind == "mistral3_text":  # FLUX.2 [dev]: the templated prompt padded to max_sequence_length (512)
        lm, tokens = qwen_text_config(config), lay.text_tokens or 512
        d, ff = ival(lm, "hidden_size", 5120), ival(lm, "intermediate_size", 32768)
        gated = rows * tokens * max(0, 4 * ff - 8 * d) * item  # gate, up, SiLU(gate), their product
        return _block(rows, tokens, d, ival(lm, "num_attention_heads", 32), item, scores) + gated
    if kind == "zimage_transformer":  # one stream: the caption (padded to max_sequence_length) and the 2x2 patches
        patch, heads = lay.factor * 2, ival(config, "n_heads", 30)
        return _block(rows, (lay.text_tokens or 512) + (h // patch) * (w // patch) + served.extra_tokens,
                      ival(config, "dim", 3840), heads, item, scores)
    if kind == "flux2_transformer":  # the caption (max_sequence_length) joined to the 2x2-patchified latents' tokens
        heads = ival(config, "num_attention_heads", 48)
        tokens = (lay.text_tokens or 512) + (h // (lay.factor * 2)) * (w // (lay.factor * 2)) + served.extra_tokens
        return _block(rows, tokens, heads * ival(config, "attention_head_dim", 128), heads, item, scores)
    if kind.startswith("qwen_vae"):  # the causal 3D VAE on one frame: AutoencoderKL's levels, padded in time
        view = {"block_out_channels": qwen_vae_dims(config)}
        return _vae(view, served.images, h, w, item, kind == "qwen_vae_decoder", measured, CAUSAL_PAD_FRAMES)
    if kind in ("flux_transformer", "sd3_transformer", "qwen_image"):  # Flux, Qwen-Image: 2x2 packs; SD 3 patches
        patch = lay.factor * (2 if kind == "flux_transformer" else ival(config, "patch_size", 2))
        text = lay.text_tokens + (77 if kind == "sd3_transformer" else 0) + served.extra_tokens
        heads = ival(config, "num_attention_heads", 24)
        return _block(rows, text + (h // patch) * (w // patch), heads * ival(config, "attention_head_dim", 128),
                      heads, item, scores)
    if kind == "unet":
        return _unet(config, rows, (h // lay.factor) * (w // lay.factor), item, scores)
    return _vae(config, served.images, h, w, item, kind == "vae_decoder", measured)


# ---- per component --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Component:
    """One component's weights and activations, from its files or its config."""

    name: str
    kind: str
    source: str
    """``onnx`` (model.onnx and its external data), ``config`` (config.json only) or ``missing``."""
    params: int
    stored_dtype: str
    """The files' float type (``fp32`` for a config-only folder: what `sdserve engines export` writes)."""
    dtype: str
    """The serving dtype on the device."""
    weights: int
    """Device bytes of the weights at ``dtype``."""
    file_bytes: int
    """The files' bytes (graph + external data), or the export's at ``stored_dtype`` for a config-only folder."""
    external: bool
    """Weights beside the graph (memory-mapped at load, never read into anonymous host memory)."""
    adaptable: bool
    variant_bytes: int
    """The LoRA variant session's weights: the plain ONNX file's, at ``stored_dtype`` (0: not adaptable)."""
    adaptable_bytes: int
    """Bytes of the Linear/Conv weights a LoRA may change, at ``stored_dtype``: one set touching all of them."""
    merge_buffers: int
    """One device buffer (and one pinned host buffer) per distinct adaptable weight shape, at ``stored_dtype``."""
    activations: int
    variant_activations: int
    """The LoRA variant's activations, at ``stored_dtype``."""


def _from_onnx(path: Path) -> tuple[int, str, int, int, int, bool, int]:
    """(float params, stored dtype, other bytes, adaptable bytes, merge buffers, external, file bytes) of an
    exported file: the graph's headers, and the sizes of it and of the external data files it names."""
    scan = scan_onnx(path)
    floats = {t: n for t, n in scan.elements.items() if t in ONNX_FLOATS}
    stored = max(floats, key=lambda t: floats[t]) if floats else 1
    other = sum(n * ONNX_ITEMSIZE.get(t, 4) for t, n in scan.elements.items() if t not in ONNX_FLOATS)
    # engines/lora/targets.py merges fp32 and fp16 weights only: a bf16 weight is no LoRA target
    weights = [scan.shapes[n] for n in scan.weight_names if scan.shapes[n][0] in (1, 10)]
    adaptable = sum(math.prod(dims) * ONNX_ITEMSIZE.get(t, 4) for t, dims in weights)
    buffers = sum(math.prod(dims) * ONNX_ITEMSIZE.get(t, 4) for t, dims in set(weights))
    try:
        size = path.stat().st_size + sum((path.parent / f).stat().st_size for f in sorted(scan.external))
    except OSError as exc:
        raise ModelLoadError(f"{path}: an external data file it names cannot be read ({exc})") from exc
    return sum(floats.values()), ONNX_FLOATS[stored], other, adaptable, buffers, bool(scan.external), size


def _dtype(name: str, stored: str, lay: Layout, served: Served, dtype: str | None) -> str:
    if dtype is not None:
        return dtype
    if not served.tensorrt:
        return stored if stored in ITEMSIZE else "fp32"
    if name in lay.trt_precision:
        return lay.trt_precision[name]
    return "fp16" if served.trt_fp16 and name not in lay.fp32_components else "fp32"


def component(folder: Path, name: str, kind: str, lay: Layout, served: Served, dtype: str | None) -> Component:
    """The component's record: from ``<name>/model.onnx`` when exported, else from its config.json."""
    config, path = _config(folder, name), folder / name / "model.onnx"
    adaptable = name in TEXT_ENCODERS + DENOISERS
    if path.is_file():
        params, stored, other, adapt, buffers, external, file_bytes = _from_onnx(path)
        source = "onnx"
    elif config:
        tally, stored, other, source = count(kind, config), "fp32", 0, "config"
        params, item = tally.params, ITEMSIZE["fp32"]
        adapt, buffers = tally.adaptable * item, sum(math.prod(s) for s in tally.shapes) * item
        file_bytes, external = params * item, params * item > PROTOBUF_LIMIT
    else:
        params, stored, other, adapt, buffers, external, source, file_bytes = 0, "fp32", 0, 0, 0, False, "missing", 0
    serving = _dtype(name, stored, lay, served, dtype)
    item, stored_item = ITEMSIZE[serving], ITEMSIZE.get(stored, 4)
    return Component(name, kind, source, params, stored, serving, params * item + other, file_bytes, external,
                     adaptable, params * stored_item + other if adaptable else 0, adapt if adaptable else 0,
                     buffers if adaptable else 0,
                     activations(kind, config, served, lay, item),
                     activations(kind, config, served, lay, stored_item) if adaptable else 0)


# ---- the plan -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Budgets:
    """What the plan is compared with: the device's memory and the pod's memory limit (None: unknown)."""

    device_bytes: int | None = None
    device_source: str = ""
    pod_limit: int | None = None
    pod_source: str = ""


def _verdict(need: int, have: int | None) -> dict[str, Any] | None:
    return None if have is None else {"need": need, "have": have, "fits": need <= have, "margin": have - need}


def _device(parts: list[Component], served: Served, engines: int, residuals: int = 0) -> dict[str, int]:
    """Device bytes: base (weights x engines, activations, overhead) and with LoRA variants on the denoiser, or on
    every adaptable component (text encoders too), each with the merged-set cache and the merge buffers."""
    weights = sum(c.weights for c in parts) * engines
    act = sum(c.activations for c in parts) * engines if served.tensorrt else \
        max((c.activations for c in parts), default=0)
    base = weights + act + OVERHEAD + residuals  # residuals: ControlNet's (engines/health/controlnet_memory.py)

    def lora(chosen: list[Component]) -> int:
        # the variants run on CUDA: beside TensorRT's contexts, or in the one CUDA arena the base sessions share
        largest = max((c.variant_activations for c in chosen), default=0)
        extra = largest if served.tensorrt else max(0, largest - act)
        return base + sum(c.variant_bytes + c.merge_buffers for c in chosen) + served.cache_bytes + extra

    adaptable = [c for c in parts if c.adaptable]
    denoiser = [c for c in adaptable if c.name in DENOISERS]
    largest = sum(c.adaptable_bytes for c in denoiser)
    with_denoiser = lora(denoiser)
    return {"weights": weights, "activations": act, "overhead": OVERHEAD, "base": base,
            "lora_denoiser": with_denoiser, "lora_all": lora(adaptable), "lora_cache": served.cache_bytes,
            "largest_set": largest, "largest_set_fits_cache": largest <= served.cache_bytes,
            "lora_denoiser_set_cached": with_denoiser - served.cache_bytes + max(served.cache_bytes, largest)}


def _host(parts: list[Component], served: Served) -> dict[str, int]:
    """Host bytes (anonymous memory: what a pod's limit counts and cannot reclaim), at load and steady, with and
    without LoRA; memory-mapped external weights apart (page cache, reclaimable)."""
    def load(c: Component) -> int:  # a TensorRT engine is read whole; ORT reads an inline graph whole
        return c.weights if served.tensorrt else (0 if c.external else c.file_bytes)

    adaptable = [c for c in parts if c.adaptable]
    resident = sum((0 if c.external else c.adaptable_bytes) + c.merge_buffers for c in adaptable)
    variant = max((0 if c.external else 4 * c.file_bytes for c in adaptable), default=0)
    peak = OVERHEAD + max((load(c) for c in parts), default=0)
    mapped = [c for c in parts if c.external and not served.tensorrt]  # TensorRT loads engines, not the files
    return {"baseline": OVERHEAD, "peak_load": peak, "steady": OVERHEAD,
            "peak_load_lora": max(peak, OVERHEAD + resident + variant), "steady_lora": OVERHEAD + resident,
            "page_cache": sum(c.file_bytes for c in mapped),
            "page_cache_lora": sum(c.file_bytes for c in parts if c in mapped or (c.external and c.adaptable))}


def _engines(folder: Path, served: Served) -> int:
    """Engines per component: the served sizes of the TensorRT manifest when built, else of the profile."""
    if not served.tensorrt:
        return 1
    from engines.artifacts import TRT_DIR, context_models

    return max(1, len(context_models(folder, TRT_DIR)) or served.sizes)


def _first_block(folder: Path, lay: Layout, served: Served) -> dict[str, Any]:
    """The first-block parts as the pipeline decides them (``decide_parts``): present, loaded, and why not."""
    from engines.pipelines.flow_family import is_dit_folder

    if not is_dit_folder(folder):
        return {"present": False, "loaded": False, "parts": [], "weights": 0, "note": ""}
    from engines.pipelines.first_block import PARTS, decide_parts

    served_parts = bool(getattr(architectures.of(folder).pipeline_class(), "FIRST_BLOCK", False))
    decision = decide_parts(folder, lay.family, served_parts,
                            "TensorRT engines, `sdserve engines build`" if served.tensorrt else "")
    note = "" if decision.load or not decision.present else decision.refusal
    return {"present": decision.present, "loaded": decision.load, "parts": list(PARTS) if decision.load else [],
            "weights": 0, "note": note}


def plan(folder: Path, served: Served, dtype: str | None = None, budgets: Budgets | None = None,
         controlnet_dir: str | Path | None = None) -> dict[str, Any]:
    """The memory plan of ``folder`` served as ``served`` (``dtype``: every component's device dtype instead of
    the policy's), compared with ``budgets``: JSON-ready. ModelLoadError when the folder is no served family."""
    if dtype is not None and dtype not in ITEMSIZE:
        raise ModelLoadError(f"dtype {dtype!r}: expected one of {', '.join(ITEMSIZE)}")
    budgets = budgets or Budgets()
    lay = layout(folder)
    try:
        parts = [component(folder, name, kind, lay, served, dtype) for name, kind in lay.parts.items()]
    except (TypeError, ValueError, KeyError, IndexError) as exc:  # a config value of the wrong type or shape
        raise ModelLoadError(f"{folder}: a component's config.json holds values the memory plan cannot read: "
                             f"{exc!r}") from exc
    first_block = _first_block(folder, lay, served)
    # loaded only without TensorRT (decide_parts): one engine per component, one copy each; never LoRA-adapted
    extra = [component(folder, name, "first_block_part", lay, served, dtype) for name in first_block["parts"]]
    first_block["weights"] = sum(c.weights for c in extra)
    parts += extra
    from engines.health.controlnet_memory import plan_parts  # ``controlnet_dir``: [runtime.controlnet] dir

    control, controlnet = plan_parts(folder, lay, served, dtype, controlnet_dir, component, ITEMSIZE)
    parts += control
    engines = _engines(folder, served)
    device, host = _device(parts, served, engines, controlnet["residual_bytes"]), _host(parts, served)
    return {
        "model": folder.name, "family": lay.family,
        "served": {"width": served.width, "height": served.height, "images": served.images,
                   "rows": served.images * (2 if lay.cfg else 1), "engines_per_component": engines,
                   "policy": "tensorrt" if served.tensorrt else "onnx"},
        "components": [c.__dict__ for c in parts],
        "missing": [c.name for c in parts if c.source == "missing"], "first_block": first_block,
        "controlnet": controlnet,
        "device": {**device, "budget": {"bytes": budgets.device_bytes, "source": budgets.device_source},
                   "verdicts": {k: _verdict(device[k], budgets.device_bytes)
                                for k in ("base", "lora_denoiser", "lora_all", "lora_denoiser_set_cached")}},
        "host": {**host, "limit": {"bytes": budgets.pod_limit, "source": budgets.pod_source},
                 "verdicts": {k: _verdict(host[k], budgets.pod_limit) for k in ("peak_load", "peak_load_lora")}},
        "formulas": {"activations": ACTIVATIONS, "overhead": f"{OVERHEAD // GIB} GiB on the device and on the host"},
        "advice": advice([c.__dict__ for c in parts], device, budgets.device_bytes, engines, served.tensorrt),
    }


def for_runtime(model: Path, runtime: RuntimeSettings, width: int, height: int, images: int, sizes: int,
                dtype: str | None, budgets: Budgets) -> dict[str, Any]:
    """``plan`` for a deployment under ``runtime``'s policy (TensorRT in it: the engine precisions and one engine
    per served size, as engines/engine.py loads them; a plugin EP or CUDA alone: the files' dtype) and its LoRA
    cache budget."""
    tensorrt = runtime.plugin is None and "TensorrtExecutionProvider" in runtime.providers
    served = Served(width, height, images, sizes, tensorrt, runtime.tensorrt.fp16, runtime.lora.cache_mb << 20)
    return plan(model, served, dtype, budgets, runtime.controlnet.dir)

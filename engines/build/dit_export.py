"""ONNX export of the flow-matching DiT families (Flux.1, SD 3 / 3.5): the tiny builds of engines/build/dit.py and
local diffusers folders (`sdserve engines export --from`). Build-time only: imports torch, diffusers, transformers.

Output layout (ONNX, legacy exporter; fp32, or half precision per ``PRECISION``)::

    text_encoder/ text_encoder_2/ [text_encoder_3/] transformer/ vae_decoder/ [vae_encoder/]  model.onnx + config.json
    tokenizer/ tokenizer_2/ [tokenizer_3/]  scheduler/scheduler_config.json  model_index.json  manifest.json

(text_encoder_3/ and tokenizer_3/: SD 3's T5; Flux's T5 is text_encoder_2/ and tokenizer_2/. vae_encoder/: img2img.)
The transformer takes ``hidden_states`` (Flux: packed [B, tokens, 64]; SD 3: [B, 16, h, w]),
``encoder_hidden_states``, ``pooled_projections``, ``timestep`` (Flux: t / 1000; SD 3: t), Flux also
``rope_cos``/``rope_sin`` and dev ``guidance``; it outputs ``out_hidden_states``. The q/k RMSNorms of Flux and SD 3.5
(``torch.nn.RMSNorm``, which the legacy exporter cannot export) are written out as opset-17 ops.

Flux's rotary position tables are transformer *inputs* (``rope_cos``, ``rope_sin``: [text + image tokens,
head_dim], fp32): diffusers' ``FluxPosEmbed`` computes them in float64, which would put double ops in the graph
(TensorRT has none); the serving pipeline computes them on the host in float64 from ``txt_ids``/``img_ids`` exactly
as diffusers does and casts them to fp32 (engines/pipelines/flow.py ``flux_rope``).

Half precision (``--dtype fp16`` / ``bf16``, ``PRECISION``): the networks are cast in torch and traced in that
dtype, so the graph holds exactly what diffusers and transformers run in it: T5 keeps the modules its model class
lists in ``_keep_in_fp32_modules`` (``wo``, fp16 only, as ``from_pretrained(dtype=torch.float16)`` does), and
Flux's transformer carries the ``clip(-65504, 65504)`` diffusers applies to fp16 activations in its joint and
single blocks. torch on the CPU runs every op of these networks in fp16 and bf16, so no ONNX-level float
conversion (and no hand-made keep-list) is needed; two legacy-exporter faults at half precision are mended in the
symbolics (``_sdpa_symbolic``, ``_rms_norm_symbolic``). The graph's inputs and outputs stay fp32 (``_Fp32Io``:
casts at the graph's edges, inside it), so the serving pipeline feeds and reads the same element types for every
dtype, and a bf16 graph never needs numpy (which has no bfloat16) at its boundary. fp16 graphs run on every ONNX
Runtime provider; bf16 ones on CUDA and TensorRT only (the CPU provider has no bf16 kernels). fp32 exports are
byte-identical to what this module wrote before ``--dtype`` existed.
"""

from __future__ import annotations

import inspect
import logging
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from engines import architectures
from engines.build.dit_folder import config_of, export_onnx, half_plan, write_json
from engines.build.export import OPSET, VaeDecoderExport, VaeEncoderExport, write_manifest

log = logging.getLogger(__name__)
DTYPES = ("fp32", "fp16", "bf16")
"""What `sdserve engines export --dtype` takes."""
PRECISION: dict[str, dict[str, str]] = {
    "fp16": {"clip": "fp16", "t5": "fp16", "transformer": "fp16", "vae": "fp16"},
    "bf16": {"clip": "fp16", "t5": "bf16", "transformer": "bf16", "vae": "fp16"},
}
"""Per ``--dtype``, the dtype of each network, by role (``precisions`` maps it to components). Why:

- CLIP in fp16 in both: CLIP-L/G run in fp16 everywhere (SD 1.x/XL, diffusers' fp16 pipelines), and fp16 keeps
  three more mantissa bits than bf16; as the TensorRT plan builds them (engines/build/trtplan_dit.py).
- T5 in fp16 overflows (T5 v1.1/XXL feed-forward outputs pass 65504): transformers keeps ``wo`` in fp32 for fp16
  (``_keep_in_fp32_modules``), and since its fp32 output is added to the residual stream, that stream is fp32 from
  the first block on; applied here by the model's own dtype plan. In bf16 (fp32's range) nothing is kept, as in
  transformers and the TensorRT plan.
- The transformer in either: Flux's fp16 overflow is clamped by diffusers' own ``clip(-65504, 65504)`` in the
  blocks (traced into the graph); bf16 needs none (the TensorRT plan's choice).
- The VAE: fp16 only when its config says ``force_upcast: false`` (the real Flux and SD 3 VAEs say true: they
  overflow in fp16 at large sizes), else fp32 (a few percent of the bytes); never bf16 in the ONNX file, whose
  consumers are ONNX Runtime's CUDA route and the LoRA variants: its 1.31 CUDA provider has no bf16 kernel for
  InstanceNormalization (the VAE's GroupNorm as exported), Resize or Pad (libonnxruntime_providers_cuda.so holds
  those templates for float, double and MLFloat16 only), so a bf16 VAE would not load there. TensorRT still builds
  the VAE in bf16 from this file (trtplan_dit.PRECISION: it picks the precision itself). Every op of the bf16 T5
  and transformer has a bf16 CUDA kernel in that binary (MatMul, Gemm, LayerNorm, Softmax, Pow, Tanh, ...).
"""
TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def precisions(dtype: str, flux: bool, vae_config: dict[str, Any]) -> dict[str, str]:
    """Each exported network's dtype (keys as in ``export_dit``'s components: text encoders, ``transformer``,
    ``vae``) for ``--dtype`` (``PRECISION``); all fp32 for fp32."""
    t5 = "text_encoder_2" if flux else "text_encoder_3"
    names = ["text_encoder", "text_encoder_2", "text_encoder_3", "transformer", "vae"]
    if dtype == "fp32":
        return dict.fromkeys(names, "fp32")
    if dtype not in PRECISION:
        raise ValueError(f"dtype {dtype!r}: expected one of {DTYPES}")
    roles = PRECISION[dtype]
    found = {n: roles["t5"] if n == t5 else roles["clip"] for n in names if n.startswith("text_encoder")}
    vae = roles["vae"]
    if vae == "fp16" and vae_config.get("force_upcast", True):
        vae = "fp32"
    return {**found, "transformer": roles["transformer"], "vae": vae}


def fp32_keeps(model: torch.nn.Module, dtype: torch.dtype) -> list[str]:
    """Parameter and buffer names the model's class keeps in fp32 at ``dtype``: transformers' dtype plan
    (``_keep_in_fp32_modules`` for fp16, ``_keep_in_fp32_modules_strict`` for fp16 and bf16), whose globs
    transformers matches by ``re.search`` with ``*`` as ``.*`` (core_model_loading.build_glob_alternation)."""
    plan: dict[str, torch.dtype] = model._get_dtype_plan(dtype) if hasattr(model, "_get_dtype_plan") else {}
    patterns = [re.compile(glob.replace("*", ".*")) for glob, kept in plan.items() if kept == torch.float32]
    names = [n for n, _ in [*model.named_parameters(), *model.named_buffers()]]
    return [n for n in names if any(p.search(n) for p in patterns)]


def cast_model(model: torch.nn.Module, dtype: str) -> list[str]:
    """Cast ``model``'s floating parameters and buffers to ``dtype`` in place, except its fp32 keeps (returned):
    what ``from_pretrained`` with that dtype gives, for models built in memory too. Already-cast tensors are left
    as they are (a kept fp32 weight is never rounded through half)."""
    target = TORCH_DTYPES[dtype]
    kept = set(fp32_keeps(model, target)) if target != torch.float32 else set()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_floating_point():
            tensor.data = tensor.data.to(torch.float32 if name in kept else target)
    return sorted(kept)


class _Fp32Io(torch.nn.Module):
    """A half-precision network with fp32 graph inputs and outputs: floating inputs are cast to ``dtype`` (as the
    reference pipelines feed it), except the positions in ``fp32_inputs`` (Flux's rope tables, which diffusers
    keeps in fp32 at every dtype), and outputs are cast to fp32. The casts are nodes at the graph's edges. The
    wrapped export module's network is registered as ``model``, as in the fp32 export, so every node keeps its
    ``/model/...`` scope name (LoRA targets are found by it: engines/lora/targets.py ``module_of``)."""

    def __init__(self, inner: torch.nn.Module, dtype: torch.dtype, fp32_inputs: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.model = inner.model
        self.run_inner = inner.forward  # a bound method, not a submodule: it adds no scope to the node names
        self.dtype = dtype
        self.fp32_inputs = fp32_inputs

    def forward(self, *args: torch.Tensor) -> Any:
        cast = [a.to(self.dtype) if a.is_floating_point() and i not in self.fp32_inputs else a
                for i, a in enumerate(args)]
        out = self.run_inner(*cast)
        return tuple(o.float() for o in out) if isinstance(out, tuple) else out.float()


def _io(module: torch.nn.Module, dtype: str, fp32_inputs: tuple[int, ...] = ()) -> torch.nn.Module:
    return module if dtype == "fp32" else _Fp32Io(module, TORCH_DTYPES[dtype], fp32_inputs)


class _ClipPooled(torch.nn.Module):
    """Flux's CLIP-L: (last_hidden_state, pooler_output); the pipeline reads the pooled output only."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.model(input_ids, return_dict=True)
        return out.last_hidden_state, out.pooler_output


class _ClipProjected(torch.nn.Module):
    """SD 3's CLIP encoders: (text_embeds, last_hidden_state, penultimate hidden state), named as optimum does."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out = self.model(input_ids, output_hidden_states=True)
        return out.text_embeds, out.last_hidden_state, out.hidden_states[-2]


class _T5(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, return_dict=False)[0]


class _GivenRope(torch.nn.Module):
    """Stands in for FluxPosEmbed during export: returns the tables the graph takes as inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.tables is not None
        return self.tables


def _rotary_for_export(x: torch.Tensor, freqs_cis: tuple[torch.Tensor, torch.Tensor], use_real: bool = True,
                       use_real_unbind_dim: int = -1, sequence_dim: int = 2) -> torch.Tensor:
    """diffusers' ``apply_rotary_emb`` for Flux (real tables, interleaved pairs, tokens on axis 1), written so the
    tracer keeps the batch and token counts dynamic: its ``x.reshape(*x.shape[:-1], -1, 2)`` freezes them."""
    cos, sin = (t[None, :, None, :] for t in freqs_cis)
    pairs = x.unflatten(-1, (-1, 2))
    rotated = torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(3)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class _Flux(torch.nn.Module):
    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model
        self.rope = _GivenRope()
        model.pos_embed = self.rope

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, pooled: torch.Tensor,
                timestep: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor,
                guidance: torch.Tensor | None = None) -> torch.Tensor:
        self.rope.tables = (rope_cos, rope_sin)
        ids = torch.zeros(1, 3)  # unused: positions arrive as the rope tables
        return self.model(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                          pooled_projections=pooled, timestep=timestep, img_ids=ids, txt_ids=ids,
                          guidance=guidance, return_dict=False)[0]


class _SD3(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, pooled: torch.Tensor,
                timestep: torch.Tensor) -> torch.Tensor:
        return self.model(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                          pooled_projections=pooled, timestep=timestep, return_dict=False)[0]


HALF_SCALARS = {"Half": 10, "BFloat16": 16}
"""TorchScript scalar type names of the half types -> their ONNX element types (TensorProto.FLOAT16, BFLOAT16)."""
HALF_TORCH = {10: torch.float16, 16: torch.bfloat16}


def _rms_norm_symbolic(g: Any, x: Any, normalized_shape: Any, weight: Any, eps: Any) -> Any:
    """``aten::rms_norm`` (torch.nn.RMSNorm: Flux's and SD 3.5's q/k norms) as opset-17 ops: the legacy exporter
    has no symbolic for it. x * 1/sqrt(mean(x², last dims) + eps) * weight, in torch's order; a half input is
    computed in fp32 and the result cast back, as torch does (its rms_norm upcasts fp16/bf16, weight included)."""
    from torch.onnx import symbolic_helper as helper

    dims = helper._get_const(normalized_shape, "is", "normalized_shape")
    value = helper._get_const(eps, "f", "eps") if not helper._is_none(eps) else torch.finfo(torch.float32).eps
    half = HALF_SCALARS.get(str(x.type().scalarType()))
    if half is not None:
        x = g.op("Cast", x, to_i=1)  # TensorProto.FLOAT
    mean = g.op("ReduceMean", g.op("Mul", x, x), axes_i=list(range(-len(dims), 0)), keepdims_i=1)
    eps_t = g.op("Constant", value_t=torch.tensor(float(value), dtype=torch.float32))
    out = g.op("Mul", x, g.op("Reciprocal", g.op("Sqrt", g.op("Add", mean, eps_t))))
    if not helper._is_none(weight):
        out = g.op("Mul", out, weight if half is None else g.op("Cast", weight, to_i=1))
    return out if half is None else g.op("Cast", out, to_i=half)


def _sdpa_symbolic(g: Any, query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: Any = 0.0,
                   is_causal: Any = False, scale: Any = None, enable_gqa: Any = False) -> Any:
    """torch's own ``scaled_dot_product_attention`` symbolic (opset 14); for a half query, its extra tensors made
    the query's type first: torch's symbolic builds an explicit ``scale`` (transformers' CLIP and T5 pass one)
    and a causal mask (CLIP's ``is_causal``) as fp32 constants, which the legacy exporter promotes: an fp16
    attention is cast to fp32 there and every op after it runs in fp32 (fp32 copies of the later weights in the
    file), a bf16 one fails ("ScalarType ComplexDouble is an unexpected tensor scalar type"). fp32 calls are
    torch's, unchanged."""
    from torch.onnx import symbolic_helper as helper
    from torch.onnx._internal.torchscript_exporter import symbolic_opset14

    half = HALF_SCALARS.get(str(query.type().scalarType()))
    if half is not None:
        if not helper._is_none(scale):
            factor = torch.tensor(float(helper._get_const(scale, "f", "scale")), dtype=HALF_TORCH[half])
            scale = g.op("Constant", value_t=factor)
        if helper._maybe_get_const(is_causal, "b"):
            attn_mask = g.op("Cast", symbolic_opset14._causal_attention_mask(g, query, key), to_i=half)
            is_causal = False
        elif not helper._is_none(attn_mask) and str(attn_mask.type().scalarType()) == "Float":
            attn_mask = g.op("Cast", attn_mask, to_i=half)
    return symbolic_opset14.scaled_dot_product_attention(g, query, key, value, attn_mask, dropout_p, is_causal,
                                                         scale, enable_gqa)


def _export(module: torch.nn.Module, args: tuple[torch.Tensor, ...], path: Path, inputs: list[str],
            outputs: list[str], dynamic: dict[str, dict[int, str]]) -> None:
    register_half_symbolics()
    export_onnx(module, args, path, inputs, outputs, dynamic)


def register_half_symbolics() -> None:
    """The legacy exporter's ``aten::rms_norm`` and half-precision-safe SDPA symbolics (fp32 SDPA: torch's own)."""
    torch.onnx.register_custom_op_symbolic("aten::rms_norm", _rms_norm_symbolic, OPSET)
    torch.onnx.register_custom_op_symbolic("aten::scaled_dot_product_attention", _sdpa_symbolic, OPSET)


def apply_dtype(components: dict[str, Any], dtype: str, source: dict[str, Any]) -> tuple[dict[str, str],
                                                                                        dict[str, Any]]:
    """Cast a one-encoder family's networks in place per ``half_plan`` (each class's fp32 keeps kept: dit_export
    ``cast_model``) and register the half-precision symbolics; the plan, and the manifest's source with the dtype,
    each network's precision and its keeps recorded (the source as it is for fp32)."""
    plan = half_plan(dtype, config_of(components["vae"]))
    if dtype == "fp32":
        return plan, source
    keeps = {name: cast_model(components[name], plan[name]) for name in plan}
    register_half_symbolics()
    return plan, {**source, "dtype": dtype, "precision": plan,
                  "fp32_keeps": {n: k for n, k in keeps.items() if k}}



def _batch(*names: str) -> dict[str, dict[int, str]]:
    return {n: {0: "batch"} for n in names}


def _export_text(components: dict[str, Any], flux: bool, out: Path, dtypes: dict[str, str]) -> None:
    ids = (torch.zeros(1, 77, dtype=torch.int64),)
    if flux:
        names = ["last_hidden_state", "pooler_output"]
        _export(_io(_ClipPooled(components["text_encoder"]), dtypes["text_encoder"]), ids,
                out / "text_encoder" / "model.onnx", ["input_ids"], names, _batch("input_ids", *names))
    else:
        for name in ("text_encoder", "text_encoder_2"):
            model = components[name]
            names = ["text_embeds", "last_hidden_state", f"hidden_states.{int(model.config.num_hidden_layers) - 1}"]
            _export(_io(_ClipProjected(model), dtypes[name]), ids, out / name / "model.onnx", ["input_ids"], names,
                    _batch("input_ids", *names))
    t5 = "text_encoder_2" if flux else "text_encoder_3"
    _export(_io(_T5(components[t5]), dtypes[t5]), (torch.zeros(1, 16, dtype=torch.int64),), out / t5 / "model.onnx",
            ["input_ids"], ["last_hidden_state"],
            {"input_ids": {0: "batch", 1: "sequence"}, "last_hidden_state": {0: "batch", 1: "sequence"}})


def _export_transformer(transformer: Any, flux: bool, out: Path, dtype: str = "fp32") -> None:
    config = transformer.config
    seq = {0: "batch", 1: "text_tokens"}
    if flux:
        head = int(config.attention_head_dim)
        args = [torch.randn(1, 16, int(config.in_channels)), torch.randn(1, 8, int(config.joint_attention_dim)),
                torch.randn(1, int(config.pooled_projection_dim)), torch.tensor([0.5]),
                torch.randn(24, head), torch.randn(24, head)]
        names = ["hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "rope_cos", "rope_sin"]
        dynamic = {"hidden_states": {0: "batch", 1: "image_tokens"}, "encoder_hidden_states": seq,
                   "rope_cos": {0: "tokens"}, "rope_sin": {0: "tokens"},
                   "out_hidden_states": {0: "batch", 1: "image_tokens"}, **_batch("pooled_projections", "timestep")}
        if config.guidance_embeds:
            args.append(torch.tensor([3.5]))
            names.append("guidance")
            dynamic |= _batch("guidance")
        module: torch.nn.Module = _io(_Flux(transformer), dtype, fp32_inputs=(4, 5))  # the rope tables
    else:
        args = [torch.randn(1, int(config.in_channels), 8, 8), torch.randn(1, 8, int(config.joint_attention_dim)),
                torch.randn(1, int(config.pooled_projection_dim)), torch.tensor([500.0])]
        names = ["hidden_states", "encoder_hidden_states", "pooled_projections", "timestep"]
        spatial = {0: "batch", 2: "height", 3: "width"}
        dynamic = {"hidden_states": spatial, "encoder_hidden_states": seq, "out_hidden_states": spatial,
                   **_batch("pooled_projections", "timestep")}
        module = _io(_SD3(transformer), dtype)
    from diffusers.models.transformers import transformer_flux

    original, rotary = transformer.pos_embed, transformer_flux.apply_rotary_emb
    transformer_flux.apply_rotary_emb = _rotary_for_export
    try:  # _Flux swaps in the given-tables stand-in; the components stay usable after the export
        _export(module, tuple(args), out / "transformer" / "model.onnx", names, ["out_hidden_states"], dynamic)
    finally:
        transformer.pos_embed, transformer_flux.apply_rotary_emb = original, rotary


def _export_first_block(transformer: Any, flux: bool, out: Path, dtype: str = "fp32") -> None:
    """The transformer's parts for the first-block cache (engines/build/dit_split.py), traced as the full one is."""
    from diffusers.models.transformers import transformer_flux

    from engines.build.dit_split import first_block_parts, splittable

    if not splittable(transformer):
        log.warning("first-block cache: the transformer has under two blocks; no parts written")
        return
    rotary, transformer_flux.apply_rotary_emb = transformer_flux.apply_rotary_emb, _rotary_for_export
    try:
        for part in first_block_parts(transformer, flux):
            _export(_io(part.module, dtype, part.fp32_inputs), part.args, out / part.folder / "model.onnx",
                    part.inputs, part.outputs, part.dynamic)
    finally:
        transformer_flux.apply_rotary_emb = rotary


def _export_vae(vae: Any, out: Path, encoder: bool, dtype: str = "fp32") -> None:
    spatial = {0: "batch", 2: "height", 3: "width"}
    latent = torch.randn(1, int(vae.config.latent_channels), 4, 4)  # small: a fast trace
    _export(_io(VaeDecoderExport(vae), dtype), (latent,),
            out / "vae_decoder" / "model.onnx", ["latent_sample"], ["sample"],
            {"latent_sample": spatial, "sample": spatial})
    if not encoder:
        return
    _export(_io(VaeEncoderExport(vae), dtype), (torch.randn(1, int(vae.config.in_channels), 32, 32),),
            out / "vae_encoder" / "model.onnx", ["sample"], ["latent_parameters"],
            {"sample": spatial, "latent_parameters": spatial})


def _config(model: Any) -> dict[str, Any]:
    return dict(model.config.to_dict() if hasattr(model.config, "to_dict") else model.config)


def export_dit(components: dict[str, Any], tokenizer_dirs: dict[str, Path], out: Path,
               source: dict[str, Any], vae_encoder: bool = True, native_size: int | None = None,
               dtype: str = "fp32", first_block: bool = False) -> Path:
    """Export a Flux or SD 3 model's networks, copy tokenizers and scheduler config, write model_index.json
    (``OnnxFluxPipeline`` / ``OnnxStableDiffusion3Pipeline``) and the manifest. ``vae_encoder``: also the VAE
    encoder (for edits; txt2img does not need it). ``dtype``: fp32, or fp16/bf16 per ``PRECISION`` (the
    networks are cast in place; the manifest's source records each network's dtype and its fp32 keeps).
    ``first_block``: also the transformer's parts for the first-block cache (engines/build/dit_split.py; opt-in:
    they hold the transformer's weights a second time)."""
    from diffusers import FluxTransformer2DModel

    flux = isinstance(components["transformer"], FluxTransformer2DModel)
    dtypes = precisions(dtype, flux, _config(components["vae"]))
    keeps = {name: cast_model(components[name], dtypes[name]) for name in dtypes if name in components}
    out.mkdir(parents=True, exist_ok=True)
    _export_text(components, flux, out, dtypes)
    _export_transformer(components["transformer"], flux, out, dtypes["transformer"])
    if first_block:
        _export_first_block(components["transformer"], flux, out, dtypes["transformer"])
    _export_vae(components["vae"], out, vae_encoder, dtypes["vae"])
    if dtype != "fp32":
        source = {**source, "dtype": dtype, "precision": {n: dtypes[n] for n in keeps},
                  "fp32_keeps": {n: k for n, k in keeps.items() if k}}
        log.info("%s export: %s", dtype, ", ".join(f"{n} {dtypes[n]}" for n in keeps))
    vaes = ["vae_decoder", "vae_encoder"] if vae_encoder else ["vae_decoder"]
    names = [n for n in ("text_encoder", "text_encoder_2", "text_encoder_3", "transformer") if n in components]
    for name in names:
        write_json(out / name / "config.json", _config(components[name]))
    for name in vaes:
        write_json(out / name / "config.json", _config(components["vae"]))
    for name, folder in tokenizer_dirs.items():
        if (out / name).exists():
            shutil.rmtree(out / name)
        shutil.copytree(folder, out / name)
    scheduler = components["scheduler"]
    write_json(out / "scheduler" / "scheduler_config.json", {"_class_name": type(scheduler).__name__,
                                                             **dict(scheduler.config)})
    onnx = ["diffusers", "OnnxRuntimeModel"]
    index: dict[str, Any] = {"_class_name": "OnnxFluxPipeline" if flux else "OnnxStableDiffusion3Pipeline",
                             "scheduler": ["diffusers", type(scheduler).__name__],
                             **{n: onnx for n in [*names, *vaes]},
                             **{n: ["tokenizers", "Tokenizer"] for n in tokenizer_dirs}}
    if native_size is not None:  # engines/pipelines/flow.py NATIVE_SIZE_KEY
        index["_sdserve_native_size"] = native_size
    write_json(out / "model_index.json", index)
    write_manifest(out, source)
    return out


EXPORT = "engines.build.dit_export:export_dit_folder"
"""This module's export, as the Flux.1 and SD 3 registry rows name it (engines/architectures.py)."""


def is_dit_source(src: Path) -> bool:
    """Whether a folder's model_index.json names a DiT pipeline, served or refused (`sdserve engines export`)."""
    from engines.pipelines.flow_family import is_dit_folder

    return is_dit_folder(src)


def export_dit_folder(src: Path, out: Path, dtype: str = "fp32", first_block: bool = False) -> Path:
    """Export a local diffusers FluxPipeline or StableDiffusion3Pipeline folder (``dtype``, ``first_block``:
    ``export_dit``); ModelLoadError for an unsupported DiT (Flux.1 Kontext, Flux.2, ...) or an sdserve ONNX
    folder. The networks load in their export dtype (half the memory of an fp32 load for a half export;
    transformers applies T5's fp32 keeps while loading), the VAE in fp32 (cast after, by its config)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel, SD3Transformer2DModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, T5EncoderModel

    from engines.errors import ModelLoadError
    from engines.pipelines.flow_family import detect_dit

    family = detect_dit(src)
    row = architectures.get(family.base)
    if row.export != EXPORT:  # another architecture's export module (Qwen-Image's: engines/build/qwen_export.py)
        export = row.load(row.export)
        if first_block or (dtype != "fp32" and "dtype" not in inspect.signature(export).parameters):
            raise ModelLoadError(f"--from {src}: {family.name} exports in fp32 only, without --first-block")
        return export(src, out, dtype) if dtype != "fp32" else export(src, out)  # type: ignore[no-any-return]
    if (src / "manifest.json").exists() or (src / "transformer" / "model.onnx").exists():
        raise ModelLoadError(f"--from {src}: this is an sdserve ONNX model folder already; export reads a diffusers "
                             "folder (transformer/, vae/, text encoders with their config.json and weights)")
    flux = row.packed  # Flux.1's transformer: packed tokens and rope tables; else SD 3's
    vae = AutoencoderKL.from_pretrained(src / "vae")
    torch_dtype = {n: TORCH_DTYPES[d] for n, d in precisions(dtype, flux, _config(vae)).items()}
    transformer = FluxTransformer2DModel if flux else SD3Transformer2DModel
    parts: dict[str, Any] = {
        "vae": vae,
        "scheduler": FlowMatchEulerDiscreteScheduler.from_pretrained(src / "scheduler"),
        "transformer": transformer.from_pretrained(src / "transformer", torch_dtype=torch_dtype["transformer"]),
    }
    if flux:
        parts["text_encoder"] = CLIPTextModel.from_pretrained(src / "text_encoder", dtype=torch_dtype["text_encoder"])
        parts["text_encoder_2"] = T5EncoderModel.from_pretrained(src / "text_encoder_2",
                                                                 dtype=torch_dtype["text_encoder_2"])
    else:
        for name in ("text_encoder", "text_encoder_2"):
            parts[name] = CLIPTextModelWithProjection.from_pretrained(src / name, dtype=torch_dtype[name])
        parts["text_encoder_3"] = T5EncoderModel.from_pretrained(src / "text_encoder_3",
                                                                 dtype=torch_dtype["text_encoder_3"])
    tokenizers = {n: src / n for n in ("tokenizer", "tokenizer_2", "tokenizer_3") if (src / n).is_dir()}
    log.info("exporting %s (%s, %s) to %s", src, family.name, dtype, out)
    return export_dit(parts, tokenizers, out, {"kind": "diffusers-folder", "family": family.name,
                                               "path_name": src.name}, dtype=dtype, first_block=first_block)

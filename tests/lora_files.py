"""LoRA files for the tests, made from the tiny models' own modules with peft (random factors, fixed seed).

``peft_lora`` adds a LoRA adapter with random A and B (``init_lora_weights=False``, so B is not zero) to the
diffusers components, and writes it as diffusers' ``save_lora_weights`` does (PEFT names with component prefixes,
``unet.<module>.lora_A.weight``); ``kohya_lora`` writes the same factors under kohya/A1111 names
(``lora_unet_<module with _>.lora_down.weight``, ``.lora_up.weight``, ``.alpha``). Hostile files are written byte by
byte. Torch and peft are test-only; the server reads these files with numpy alone.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch

UNET_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2"]
TE_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]
DIT_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
               "ff.net.0.proj", "ff.net.2", "proj_mlp", "proj_out"]
QWEN_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                "net.0.proj", "net.2", "img_mod.1", "txt_mod.1"]
"""Every Linear of a Qwen-Image joint block (``net.*`` matches both ``img_mlp`` and ``txt_mlp``)."""
FLUX2_TARGETS = (r".*(attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out|"
                 r"to_qkv_mlp_proj)|single_transformer_blocks\.\d+\.attn\.to_out|ff(_context)?\.linear_(in|out)|"
                 r"x_embedder|context_embedder|proj_out|norm_out\.linear|"
                 r"(single_stream_modulation|double_stream_modulation_img|double_stream_modulation_txt)\.linear|"
                 r"timestep_embedder\.linear_[12])")
"""Every Linear of the FLUX.2 transformer (a peft regex, matched whole: ``to_out`` is a Linear only in the single
blocks)."""
ZIMAGE_TARGETS = (r".*(attention\.(to_q|to_k|to_v|to_out\.0)|feed_forward\.w[123]|"
                  r"(layers|refiner)\.\d+\.adaLN_modulation\.0|all_x_embedder\.2-1|"
                  r"all_final_layer\.2-1\.(linear|adaLN_modulation\.1)|cap_embedder\.1|t_embedder\.mlp\.[02])")
"""Every Linear of the Z-Image transformer (refiners, main layers, embedders, final layer)."""


def lora_factors(module: torch.nn.Module, targets: list[str] | str, rank: int, seed: int,
                 scale: float = 0.2) -> dict[str, torch.Tensor]:
    """Random LoRA factors for ``module`` in PEFT names (no component prefix), made by peft itself."""
    from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model

    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=rank, target_modules=targets, init_lora_weights=False)
    copy = _clone(module)
    inject_adapter_in_model(config, copy)
    state = get_peft_model_state_dict(copy)
    return {k: (v * scale).contiguous() for k, v in state.items()}


def _clone(module: torch.nn.Module) -> torch.nn.Module:
    import copy

    return copy.deepcopy(module)


def save_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> Path:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    return path


def peft_file(path: Path, parts: dict[str, dict[str, torch.Tensor]]) -> Path:
    """``{component: factors}`` (unet/transformer/text_encoder/text_encoder_2) in diffusers' saved layout."""
    return save_safetensors(path, {f"{component}.{k}": v for component, factors in parts.items()
                                   for k, v in factors.items()})


KOHYA = {"unet": "lora_unet_", "text_encoder": "lora_te_", "text_encoder_2": "lora_te2_"}


def kohya_file(path: Path, parts: dict[str, dict[str, torch.Tensor]], alpha: float, xl: bool = False) -> Path:
    """The same factors under kohya names, with an ``alpha`` per module (A1111 scales by alpha / rank)."""
    out: dict[str, torch.Tensor] = {}
    prefixes = {**KOHYA, "text_encoder": "lora_te1_"} if xl else KOHYA
    for component, factors in parts.items():
        for key, value in factors.items():
            module, _, kind = key.rpartition(".lora_")
            name = prefixes[component] + module.replace(".", "_")
            role = {"A.weight": "lora_down.weight", "B.weight": "lora_up.weight"}[kind]
            out[f"{name}.{role}"] = value
            out[f"{name}.alpha"] = torch.tensor(float(alpha))
    return save_safetensors(path, out, {"ss_output_name": path.stem, "ss_network_dim": "4"})


def sgm_name(module: str, layers_per_block: int = 2) -> str:
    """A diffusers UNet attention module path in kohya's SDXL naming, the original (SGM) block layout:
    ``down_blocks.1.attentions.0.x`` -> ``input_blocks_4_1_x`` (the inverse of engines/lora/keys.py
    sgm_to_diffusers, written out separately so the test does not check the code against itself)."""
    parts = module.split(".")
    rest = "_".join(parts[4:]) if parts[0] != "mid_block" else "_".join(parts[3:])
    if parts[0] == "down_blocks" and parts[2] == "attentions":
        return f"input_blocks_{1 + int(parts[1]) * (layers_per_block + 1) + int(parts[3])}_1_{rest}"
    if parts[0] == "up_blocks" and parts[2] == "attentions":
        return f"output_blocks_{int(parts[1]) * (layers_per_block + 1) + int(parts[3])}_1_{rest}"
    if parts[0] == "mid_block" and parts[1] == "attentions":
        return f"middle_block_1_{rest}"
    raise ValueError(f"{module}: not an attention module of a UNet block")


def kohya_sgm_file(path: Path, unet: dict[str, torch.Tensor], alpha: float) -> Path:
    """An SDXL UNet LoRA under kohya's SGM names (as kohya's SDXL trainer writes them)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in unet.items():
        module, _, kind = key.rpartition(".lora_")
        name = "lora_unet_" + sgm_name(module)
        out[f"{name}.{ {'A.weight': 'lora_down.weight', 'B.weight': 'lora_up.weight'}[kind]}"] = value
        out[f"{name}.alpha"] = torch.tensor(float(alpha))
    return save_safetensors(path, out)


def fused(factors: dict[str, torch.Tensor], modules: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """One LoRA on a fused projection (qkv) equal to separate LoRAs on its parts (PEFT names, same rank): down
    the parts' downs stacked along the rank, up block-diagonal; row chunk i of up times down is part i's product."""
    downs = [factors[f"{m}.lora_A.weight"] for m in modules]
    ups = [factors[f"{m}.lora_B.weight"] for m in modules]
    return torch.cat(downs, dim=0), torch.block_diag(*ups)


def renamed_file(path: Path, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], prefix: str, flat: bool,
                 kohya_suffixes: bool, alpha: float | None = None, dots: bool = False) -> Path:
    """``{module: (down, up)}`` under another convention: ``prefix`` + the module (kohya: '.' -> '_'), suffixes
    ``lora_down``/``lora_up`` (``lora.down``/``lora.up`` with ``dots``) or ``lora_A``/``lora_B``, an ``alpha`` each
    when given."""
    names = ((".lora.down.weight", ".lora.up.weight") if dots else (".lora_down.weight", ".lora_up.weight")) \
        if kohya_suffixes else (".lora_A.weight", ".lora_B.weight")
    out: dict[str, torch.Tensor] = {}
    for module, (down, up) in pairs.items():
        name = prefix + (module.replace(".", "_") if flat else module)
        out[name + names[0]], out[name + names[1]] = down, up
        if alpha is not None:
            out[f"{name}.alpha"] = torch.tensor(float(alpha))
    return save_safetensors(path, out)


def raw_safetensors(path: Path, header: dict[str, Any] | bytes, data: bytes = b"",
                    declared: int | None = None) -> Path:
    """A file written byte by byte: ``declared`` overrides the header length field (a huge or lying header)."""
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body) if declared is None else declared) + body + data)
    return path


def numpy_delta(factors: dict[str, torch.Tensor], module: str) -> np.ndarray:
    """B @ A of one module (PEFT names), for checks by hand."""
    a = factors[f"{module}.lora_A.weight"].numpy()
    b = factors[f"{module}.lora_B.weight"].numpy()
    return np.asarray(b.reshape(b.shape[0], -1) @ a.reshape(a.shape[0], -1))


def write_safetensors(path: Path, arrays: dict[str, np.ndarray], metadata: dict[str, str] | None = None,
                      header_bytes: int | None = None, dtypes: dict[str, str] | None = None) -> Path:
    """numpy arrays written byte by byte as safetensors (no torch): ``header_bytes`` pads the JSON header with
    spaces to exactly that length (the format allows trailing whitespace); ``dtypes`` overrides a tensor's
    declared dtype (``BF16`` for uint16 arrays holding bfloat16 bits)."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    data, offset = [], 0
    for key, array in arrays.items():
        raw = np.ascontiguousarray(array).tobytes()
        dtype = (dtypes or {}).get(key) or {"float32": "F32", "float16": "F16", "float64": "F64"}[array.dtype.name]
        header[key] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + len(raw)]}
        data.append(raw)
        offset += len(raw)
    body = json.dumps(header).encode()
    if header_bytes is not None:
        assert len(body) <= header_bytes, f"the header alone is {len(body)} bytes"
        body += b" " * (header_bytes - len(body))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(body)) + body + b"".join(data))
    return path


def numpy_lora(model_dir: Path, components: tuple[str, ...] = ("unet",), rank: int = 4, seed: int = 0,
               scale: float = 0.05, limit: int | None = None) -> dict[str, np.ndarray]:
    """Random PEFT-named factors (float32) for the adaptable weights of an ONNX model folder's components (the
    first ``limit`` per component), shaped from the served graphs themselves: a LoRA for any model, no torch."""
    import onnx

    from engines.lora import targets

    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for component in components:
        graph = onnx.load(str(model_dir / component / "model.onnx"), load_external_data=False)
        for module, target in list(targets.find(graph).items())[:limit]:
            out_features, in_features = target.out_in
            out[f"{component}.{module}.lora_A.weight"] = rng.normal(0, scale, (rank, in_features)).astype(np.float32)
            out[f"{component}.{module}.lora_B.weight"] = rng.normal(0, scale, (out_features, rank)).astype(np.float32)
    return out

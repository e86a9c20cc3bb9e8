"""What every DiT export module (engines/build/dit_export.py, qwen_export.py, zimage.py, flux2.py) writes around its
networks, written once: sorted JSON, a component's ONNX file with its weights external past a size, the tokenizer,
the scheduler config, model_index.json and the manifest. Build-time only: imports torch and onnx.

External data (``EXTERNAL_OVER``): protobuf cannot serialize a message over 2 GB, so a component whose graph and
weights pass the threshold is saved as ``model.onnx`` (the graph) plus one ``model.onnx.data`` beside it (every
initializer of 1 KiB or more), whatever the exporter wrote (the legacy exporter scatters an over-2-GB model's
weights into one file per tensor). ONNX Runtime reads the weights from the file the graph names, relative to the
graph's folder (onnxruntime/core/framework/tensorprotoutils.cc ``GetExternalDataInfo``), and the manifest hashes it
as it hashes every file of the folder.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from engines.build.export import OPSET, write_manifest

EXTERNAL_OVER = 2**31 - 2**24
"""Bytes (graph plus weights) past which a component's weights go to ``model.onnx.data`` (protobuf's 2 GiB limit,
less a margin for the graph's own fields)."""
TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
ONNX = ["diffusers", "OnnxRuntimeModel"]
"""model_index.json entry of an ONNX component."""


HALF_TEXT = {"fp16": "fp32", "bf16": "bf16"}
"""The text encoder's dtype per ``--dtype`` of the one-encoder families (FLUX.2 [klein], Z-Image: a Qwen3 language
model): bf16 in bf16, as diffusers runs them; fp32 in fp16, since a language model's hidden states pass fp16's
65504 (their registry rows build its TensorRT engine in bf16, never fp16, for the same reason)."""


def half_plan(dtype: str, vae_config: dict[str, Any]) -> dict[str, str]:
    """Each network's dtype (``text_encoder``, ``transformer``, ``vae``) for ``--dtype`` (fp32, fp16, bf16) of a
    one-encoder family: the transformer in ``dtype``, the text encoder per ``HALF_TEXT``, the VAE in fp16 only when
    its config says ``force_upcast: false`` (never bf16: engines/build/dit_export.py ``PRECISION`` says why)."""
    if dtype == "fp32":
        return dict.fromkeys(("text_encoder", "transformer", "vae"), "fp32")
    if dtype not in HALF_TEXT:
        raise ValueError(f"dtype {dtype!r}: expected fp32, fp16 or bf16")
    vae = "fp32" if vae_config.get("force_upcast", True) else "fp16"
    return {"text_encoder": HALF_TEXT[dtype], "transformer": dtype, "vae": vae}


class Fp32Io(torch.nn.Module):
    """A network cast to ``dtype`` behind fp32 graph inputs and outputs (casts at the graph's edges), so a pipeline
    feeds and reads the same element types for every export dtype (numpy has no bfloat16). The wrapped export
    module's children are registered here under their own names, so every node keeps the scope name it has in the
    fp32 export (LoRA targets are found by it: engines/lora/targets.py ``module_of``)."""

    def __init__(self, inner: torch.nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        for name, child in inner.named_children():
            self.add_module(name, child)
        self.run_inner = inner.forward  # a bound method, not a submodule: it adds no scope to the node names
        self.dtype = dtype

    def forward(self, *args: torch.Tensor) -> Any:
        out = self.run_inner(*(a.to(self.dtype) if a.is_floating_point() else a for a in args))
        return tuple(o.float() for o in out) if isinstance(out, tuple) else out.float()


def with_io(module: torch.nn.Module, dtype: str) -> torch.nn.Module:
    """``module`` as it is for fp32, else behind ``Fp32Io``."""
    return module if dtype == "fp32" else Fp32Io(module, TORCH_DTYPES[dtype])


def load_diffusers(src: Path, dtype: str, text_encoder: Any, transformer: Any, vae: Any) -> tuple[Any, dict[str, Any]]:
    """The detected family of a one-encoder diffusers DiT folder and its networks (the given model classes) and
    scheduler, each network loaded in its ``dtype`` export dtype (``half_plan``: half the memory of an fp32 load),
    the VAE in fp32 (cast after, by its config); ModelLoadError for an sdserve ONNX folder."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from engines.errors import ModelLoadError
    from engines.pipelines.flow_family import detect_dit

    family = detect_dit(src)
    if (src / "manifest.json").exists() or (src / "transformer" / "model.onnx").exists():
        raise ModelLoadError(f"--from {src}: this is an sdserve ONNX model folder already; export reads a diffusers "
                             "folder (transformer/, vae/, text_encoder/ with their config.json and weights)")
    vae_model = vae.from_pretrained(src / "vae")
    plan = {n: TORCH_DTYPES[d] for n, d in half_plan(dtype, config_of(vae_model)).items()}
    return family, {"text_encoder": text_encoder.from_pretrained(src / "text_encoder", dtype=plan["text_encoder"]),
                    "transformer": transformer.from_pretrained(src / "transformer", torch_dtype=plan["transformer"]),
                    "vae": vae_model, "scheduler": FlowMatchEulerDiscreteScheduler.from_pretrained(src / "scheduler")}


def write_json(path: Path, data: Any) -> None:
    """Sorted, indented JSON (diffusers' ``_use_default_values`` set sorted too: same inputs, same bytes)."""
    if isinstance(data, dict) and isinstance(data.get("_use_default_values"), list):
        data = {**data, "_use_default_values": sorted(data["_use_default_values"])}  # a set's order otherwise
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n", encoding="utf-8")


def config_of(model: Any) -> dict[str, Any]:
    """A diffusers or transformers model's config as a plain dict."""
    return dict(model.config.to_dict() if hasattr(model.config, "to_dict") else model.config)


def export_onnx(module: torch.nn.Module, args: tuple[torch.Tensor, ...], path: Path, inputs: list[str],
                outputs: list[str], dynamic: dict[str, dict[int, str]]) -> None:
    """Legacy-exporter ONNX of ``module`` at ``path`` (opset ``OPSET``, constants folded), its weights external past
    ``EXTERNAL_OVER`` (``externalize``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer warns at every Python branch on shapes: expected here
        torch.onnx.export(module.eval(), args, str(path), input_names=inputs, output_names=outputs,
                          dynamic_axes=dynamic, opset_version=OPSET, dynamo=False, do_constant_folding=True)
    externalize(path)


def externalize(path: Path, over: int | None = None) -> bool:
    """Rewrite ``path`` as a graph plus one ``<name>.data`` when graph and weights together pass ``over`` bytes
    (default ``EXTERNAL_OVER``) or the exporter scattered its weights; True when it did."""
    import onnx

    from engines.artifacts import external_files

    limit = EXTERNAL_OVER if over is None else over
    scattered = external_files(path)
    size = path.stat().st_size + sum((path.parent / f).stat().st_size for f in scattered)
    if size <= limit and not scattered:
        return False
    model = onnx.load(str(path))  # the scattered weights read in
    for name in scattered:
        (path.parent / name).unlink()
    onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
              location=f"{path.name}.data", size_threshold=1024)
    return True


def write_tokenizer_json(src: Path, out: Path) -> None:
    """``out/tokenizer.json`` (and the tokenizer's configs) from a diffusers tokenizer folder: tokenizer.json as it
    is, or built by transformers' ``Qwen2Tokenizer`` from vocab.json and merges.txt."""
    from transformers import Qwen2Tokenizer

    out.mkdir(parents=True, exist_ok=True)
    if (src / "tokenizer.json").is_file():
        shutil.copyfile(src / "tokenizer.json", out / "tokenizer.json")
    else:
        Qwen2Tokenizer.from_pretrained(src).backend_tokenizer.save(str(out / "tokenizer.json"))
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)


def write_folder(out: Path, class_name: str, configs: dict[str, dict[str, Any]], tokenizer_dir: Path,
                 scheduler: Any, source: dict[str, Any], native_size: int | None = None,
                 index_extra: dict[str, Any] | None = None) -> Path:
    """Everything of an exported one-tokenizer DiT folder but its networks: each ONNX component's config.json
    (``configs``, component -> config; each is a model_index.json entry), ``tokenizer/`` from ``tokenizer_dir``,
    the scheduler config, model_index.json (``class_name``, ``index_extra`` keys, ``_sdserve_native_size``) and
    the manifest (``source``)."""
    for name, config in configs.items():
        write_json(out / name / "config.json", config)
    write_tokenizer_json(tokenizer_dir, out / "tokenizer")
    write_json(out / "scheduler" / "scheduler_config.json", {"_class_name": type(scheduler).__name__,
                                                             **dict(scheduler.config)})
    index: dict[str, Any] = {"_class_name": class_name, "scheduler": ["diffusers", type(scheduler).__name__],
                             "tokenizer": ["tokenizers", "Tokenizer"], **(index_extra or {}),
                             **dict.fromkeys(configs, ONNX)}
    if native_size is not None:  # engines/pipelines/flow.py NATIVE_SIZE_KEY
        index["_sdserve_native_size"] = native_size
    write_json(out / "model_index.json", index)
    write_manifest(out, source)
    return out

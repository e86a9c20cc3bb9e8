"""Which weights of an exported component a LoRA can change, and the variant graph that lets a run replace them.

The exporter names every node by its module scope (``/model/down_blocks.1/attentions.0/.../to_q/MatMul``), so the
module path of each Linear and Conv is read from the graph itself, with no file beside it:

- a Linear on a 3-D input exports as ``MatMul(x, W^T)``: its initializer is the transposed weight [in, out];
- a Linear on a 2-D input exports as ``Gemm(x, W, transB=1)``: the weight as torch holds it [out, in];
- a Conv keeps its weight [out, in, kh, kw].

The variant lists those initializers as graph inputs too, which makes them overridable initializers: a run that
binds an OrtValue under the initializer's name uses it, a run that binds nothing uses the stored weight
(IO binding's ``bind_ortvalue_input``). ONNX Runtime's own LoRA adapters (``RunOptions.add_active_adapter``) are
not used: ``OrtApis::RunWithBinding`` only logs that they have no effect (onnxruntime/core/session/
onnxruntime_c_api.cc), and every run here goes through IO binding. The base session is never this variant: a
request without LoRA runs exactly the graph it ran before LoRA existed.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import onnx
from onnx import numpy_helper

from engines.lora.keys import kohya_name, normalize

Layout = Literal["transposed", "direct"]
BLOCK_MARKERS = ("attentions.", "transformer_blocks.", "single_transformer_blocks.", "encoder.layers.",
                 "encoder.block.", "joint_blocks.")
"""Module paths inside attention/transformer blocks: ``[runtime.lora] targets = "blocks"`` keeps these only."""


@dataclass(frozen=True)
class Target:
    """One weight a LoRA may change."""

    module: str
    """Normalized dotted module path (``down_blocks.1.attentions.0.proj_in``)."""
    initializer: str
    layout: Layout
    shape: tuple[int, ...]
    """The initializer's shape as stored."""
    dtype: type[np.generic]

    @property
    def out_in(self) -> tuple[int, int]:
        """(out features, in features x kernel) of the torch weight the LoRA factors multiply into."""
        if self.layout == "transposed":
            return self.shape[1], self.shape[0]
        return self.shape[0], int(np.prod(self.shape[1:]))

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize


def module_of(node_name: str) -> str | None:
    """``/model/a.0/b/MatMul`` -> ``a.0.b`` (normalized); None for a node without a module scope. A child of an
    ``nn.Sequential`` is scoped under its parent's scope *and* its own dotted name (Qwen-Image's
    ``/model/transformer_blocks.0/img_mod/img_mod.1/Gemm`` is the module ``transformer_blocks.0.img_mod.1``): a part
    that starts with the previous part and a dot replaces it."""
    parts = [p for p in node_name.split("/") if p]
    if len(parts) < 2:
        return None
    scopes: list[str] = []
    for part in parts[:-1]:
        if scopes and part.startswith(scopes[-1] + "."):
            scopes[-1] = part
        else:
            scopes.append(part)
    return normalize(".".join(scopes))


def find(model: onnx.ModelProto, scope: str = "all") -> dict[str, Target]:
    """Every LoRA-targetable weight of the graph, by normalized module path. A weight shared by two nodes is left
    out (a change to one module would change the other)."""
    inits = {i.name: i for i in model.graph.initializer}
    uses = Counter(name for node in model.graph.node for name in node.input)
    found: dict[str, Target] = {}
    seen: Counter[str] = Counter()
    for node in model.graph.node:
        target = _target(node, inits)
        if target is None or uses[target.initializer] != 1:
            continue
        if scope == "blocks" and not any(m in target.module + "." for m in BLOCK_MARKERS):
            continue
        seen[target.module] += 1
        found[target.module] = target
    return {m: t for m, t in found.items() if seen[m] == 1}


def _target(node: onnx.NodeProto, inits: dict[str, onnx.TensorProto]) -> Target | None:
    if node.op_type not in ("MatMul", "Gemm", "Conv") or len(node.input) < 2 or node.input[1] not in inits:
        return None
    module = module_of(node.name)
    init = inits[node.input[1]]
    if module is None or init.data_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16):
        return None
    shape = tuple(int(d) for d in init.dims)
    if node.op_type == "Conv":
        layout: Layout = "direct"
        if len(shape) != 4:
            return None
    else:
        if len(shape) != 2:
            return None
        trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
        layout = "direct" if node.op_type == "Gemm" and trans_b else "transposed"
    dtype = np.float16 if init.data_type == onnx.TensorProto.FLOAT16 else np.float32
    return Target(module, init.name, layout, shape, dtype)


def with_overridable(model: onnx.ModelProto, targets: dict[str, Target], as_inputs: bool = False) -> bytes:
    """The graph serialized with every target's initializer also a graph input (overridable). ``as_inputs``: the
    initializers removed, plain required inputs: OpenVINO's plugin EP refuses overridable initializers ("Input
    names mismatch between OpenVINO and ONNX. OpenVINO input has no ONNX binding", its ov_compute.h), so on a
    plugin EP every run binds every target, the base values for those a set does not change."""
    variant = onnx.ModelProto()
    variant.CopyFrom(model)
    if as_inputs:
        names = {t.initializer for t in targets.values()}
        kept = [i for i in variant.graph.initializer if i.name not in names]
        del variant.graph.initializer[:]
        variant.graph.initializer.extend(kept)
    listed = {i.name for i in variant.graph.input}
    elem = {np.float16: onnx.TensorProto.FLOAT16, np.float32: onnx.TensorProto.FLOAT}
    for t in targets.values():
        if t.initializer not in listed:
            variant.graph.input.append(onnx.helper.make_tensor_value_info(t.initializer, elem[t.dtype],
                                                                          list(t.shape)))
    variant.ir_version = max(variant.ir_version, 4)
    return bytes(variant.SerializeToString())


def base_weights(model: onnx.ModelProto, targets: dict[str, Target],
                 folder: Path | None = None) -> dict[str, np.ndarray]:
    """The stored value of every target, by initializer name (the W of ``W + s * B @ A``). An initializer kept as
    external data (``model`` loaded without it) is a read-only memory map of its file beside the model, in
    ``folder``: the host holds page cache the kernel can drop, never a second anonymous copy of the weights (a
    Flux transformer's adaptable weights are tens of GB)."""
    wanted = {t.initializer for t in targets.values()}
    out: dict[str, np.ndarray] = {}
    for init in model.graph.initializer:
        if init.name not in wanted:
            continue
        if init.data_location == onnx.TensorProto.EXTERNAL and not init.raw_data:
            if folder is None:
                raise ValueError(f"initializer {init.name} is external data: the model's folder is needed")
            out[init.name] = _mapped(init, folder)
        else:
            out[init.name] = numpy_helper.to_array(init)
    return out


def _mapped(init: onnx.TensorProto, folder: Path) -> np.ndarray:
    """An external initializer as a read-only memory map (onnx's external-data keys: location, offset, length)."""
    where = {e.key: e.value for e in init.external_data}
    dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(init.data_type))
    shape = tuple(int(d) for d in init.dims)
    count = int(np.prod(shape)) if shape else 1
    length = int(where.get("length", count * dtype.itemsize))
    if length != count * dtype.itemsize:
        raise ValueError(f"initializer {init.name}: external length {length} is not {count} x {dtype}")
    mapped = np.memmap(folder / where["location"], dtype=dtype, mode="r", offset=int(where.get("offset", 0)),
                       shape=shape or (1,))
    return mapped.reshape(shape)


def kohya_index(targets: dict[str, Target]) -> dict[str, str]:
    """kohya's flattened names -> dotted module paths (kohya replaces every '.' by '_')."""
    return {kohya_name(m): m for m in targets}


LAST_BLOCK = re.compile(r"^transformer_blocks_(\d+)_(.+)$")


def pruned_sibling(flat: str, index: dict[str, str]) -> str | None:
    """For a module the graph lacks, in kohya's flat naming: the dotted path of the same module in an earlier
    joint block when ``flat`` is in the *last* one, else None. The last joint block's text stream is computed and
    thrown away (Qwen-Image's transformer, like SD 3's ``context_pre_only`` block, reads only the image stream
    after it), so the export prunes its ``attn.to_add_out`` and ``txt_mlp``: a LoRA on them changes nothing, in
    diffusers either. The sibling gives the shape the factors must have."""
    found = LAST_BLOCK.match(flat)
    if found is None:
        return None
    blocks = [int(m.group(1)) for name in index if (m := LAST_BLOCK.match(name)) is not None]
    if not blocks or int(found.group(1)) != max(blocks):
        return None
    return next((index[f"transformer_blocks_{i}_{found.group(2)}"] for i in sorted(set(blocks), reverse=True)
                 if f"transformer_blocks_{i}_{found.group(2)}" in index), None)

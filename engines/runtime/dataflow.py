"""Placement audit by data flow: a node on the CPU provider is allowed only when it computes on shape values.

Why: the CUDA provider leaves small shape computations on the CPU on purpose. `GetCpuPreferredNodes` in
onnxruntime/core/framework/fallback_cpu_capability.cc (read for this module, with the CUDA kernel registrations
onnxruntime/core/providers/cuda/tensor/shape_op.cc, resize.cc, trilu.cc for which outputs/inputs live on the CPU)
starts from outputs the CUDA kernels produce on the CPU (Shape, Size), and moves a consumer to the CPU when every
input is such a CPU value, a graph input or a small initializer (at most kSmallInitializerThreshold = 100 elements),
and the CUDA kernel does not itself take that input on the CPU. On the tiny UNet that is Gather, Unsqueeze, Concat,
Div, Mul, Sqrt, Cast, Slice, Add, ...: an op-name allowlist cannot tell these from compute, their inputs can.

Rule here: a tensor is a *shape value* when it is an output of Shape/Size, a small initializer or Constant
(<= SMALL_CONSTANT_ELEMENTS elements, ORT's threshold), a graph input with a static shape of at most as many
elements (ORT accepts graph inputs there too), or an output of a node without subgraphs whose every input is a shape
value. Graph inputs with symbolic or large dims (latents, embeddings) and large initializers (weights) are not.
A CPU node whose inputs are all shape values is on the shape path (allowed, counted); any other CPU node is refused
whatever its op type, as is any node that holds a subgraph (If/Loop/Scan) or sits inside one, and any name not found
in the graph (fail closed).

Which graph: `get_provider_graph_assignment_info()` names the nodes of the graph the partitioner saw, i.e. after the
level-1 (basic) optimizations and before the extended/layout ones (onnxruntime/core/session/ep_graph_partition_info.h:
"assigned to an EP by the session graph partitioner"). Measured on models/tiny (onnxruntime 1.31.1, CPU provider,
ORT_ENABLE_ALL as engines/runtime/sessions.py builds them): the assigned (name, op_type) pairs equal exactly those of
the model ORT writes at ORT_ENABLE_BASIC (unet 1035 nodes, text_encoder 314, vae_decoder 263, symmetric difference 0);
they are NOT those of the .onnx file (unet: 1860 nodes; 12 assigned names such as `Gather_token_1`, made by the
transpose optimizer from Shape(Transpose), are absent from it) nor of the ORT_ENABLE_ALL dump (146 assigned names such
as `/model/conv_in/Conv` are fused away there, e.g. into FusedConv/NCHWc). `partitioned_graph` writes that basic-level
graph. Unverified on a GPU: that the level-1 graph is the same with the CUDA provider listed; a mismatch shows up as
`unmatched` names and refuses, it cannot pass silently.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx
import onnxruntime as ort

CPU_PROVIDER = "CPUExecutionProvider"
SHAPE_OPS = frozenset({"Shape", "Size"})
SMALL_CONSTANT_ELEMENTS = 100
"""kSmallInitializerThreshold in fallback_cpu_capability.cc: larger constants are weights, not shape values."""


@dataclass(frozen=True)
class DataflowVerdict:
    shape_path: dict[str, int]
    """op_type -> count of CPU nodes computing only on shape values (allowed)."""
    activation_on_cpu: list[str]
    """'OpType name' of CPU nodes fed by anything else (an activation, a weight, a subgraph), in graph order."""
    unmatched: list[str]
    """CPU node names absent from the graph analysed (the wrong graph, e.g. the .onnx file, not the partitioned one)."""
    ok: bool

    def as_dict(self) -> dict[str, Any]:
        return {"shape_path": self.shape_path, "activation_on_cpu": self.activation_on_cpu,
                "unmatched": self.unmatched, "ok": self.ok}


def _elements(dims: Iterable[int]) -> int:
    return math.prod(dims)


def _constant_elements(node: onnx.NodeProto) -> int:
    """Element count of a Constant node's value (large when unknown, so it is never taken for a shape value)."""
    for attr in node.attribute:
        if attr.name == "value":
            return _elements(attr.t.dims)
        if attr.name in ("value_float", "value_int", "value_string"):
            return 1
        if attr.name in ("value_floats", "value_ints", "value_strings"):
            return len(attr.floats) + len(attr.ints) + len(attr.strings)
    return SMALL_CONSTANT_ELEMENTS + 1


def _has_subgraph(node: onnx.NodeProto) -> bool:
    return any(attr.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for attr in node.attribute)


def _small_static_input(value: onnx.ValueInfoProto, limit: int) -> bool:
    """A graph input whose declared shape is fully static and at most ``limit`` elements (e.g. the UNet's
    ``timestep`` [1]). GetCpuPreferredNodes lets a CPU-preferred node read any graph input ("allow placing on CPU
    if it's a small initializer or graph input", fallback_cpu_capability.cc); a latent or embedding input has
    symbolic or large dims and stays an activation here, so the audit is no looser than ORT where it matters."""
    if not value.type.HasField("tensor_type") or not value.type.tensor_type.HasField("shape"):
        return False
    dims = value.type.tensor_type.shape.dim
    return all(d.HasField("dim_value") and d.dim_value > 0 for d in dims) and _elements(
        d.dim_value for d in dims) <= limit


def _seed_shape_values(graph: onnx.GraphProto, limit: int) -> set[str]:
    """Small initializers and small static graph inputs (an initializer also listed as a graph input can be fed
    at run time: it counts as an input, by its declared shape)."""
    inputs = {i.name for i in graph.input}
    seeds = {t.name for t in graph.initializer if _elements(t.dims) <= limit}
    seeds |= {t.values.name for t in graph.sparse_initializer if _elements(t.dims) <= limit}
    return (seeds - inputs) | {i.name for i in graph.input if _small_static_input(i, limit)}


def _derives_shape(node: onnx.NodeProto, known: set[str], limit: int) -> bool:
    if _has_subgraph(node):
        return False
    if node.op_type in SHAPE_OPS and node.domain in ("", "ai.onnx"):
        return True
    if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
        return _constant_elements(node) <= limit
    inputs = [name for name in node.input if name]
    return bool(inputs) and all(name in known for name in inputs)


def shape_tensors(graph: onnx.GraphProto, *, small_constant_elements: int = SMALL_CONSTANT_ELEMENTS) -> set[str]:
    """Names of the tensors derived only from Shape/Size outputs and small constants (a fixed point over the
    graph, so node order does not matter). Graph inputs, large initializers and subgraph outputs are excluded."""
    known = _seed_shape_values(graph, small_constant_elements)
    consumers: defaultdict[str, list[onnx.NodeProto]] = defaultdict(list)
    for node in graph.node:
        for name in node.input:
            consumers[name].append(node)
    pending = [n for n in graph.node if _derives_shape(n, known, small_constant_elements)]
    done: set[int] = set()
    while pending:
        node = pending.pop()
        if id(node) in done:
            continue
        done.add(id(node))
        for out in (o for o in node.output if o and o not in known):
            known.add(out)
            pending.extend(c for c in consumers[out] if _derives_shape(c, known, small_constant_elements))
    return known


def _nested_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """Every node inside the subgraphs of `graph`'s nodes, at any depth."""
    for node in graph.node:
        for attr in node.attribute:
            for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
                yield from sub.node
                yield from _nested_nodes(sub)


def _is_shape_path(node: onnx.NodeProto, shapes: set[str]) -> bool:
    """Reads only shape values and makes only shape values (so Shape of an activation, or a source such as
    RandomNormal, is not on the path even though its outputs or its inputs are)."""
    return (not _has_subgraph(node) and all(name in shapes for name in node.input if name)
            and all(name in shapes for name in node.output if name))


def classify_cpu_nodes(graph: onnx.GraphProto, cpu_nodes: Iterable[str], *,
                       small_constant_elements: int = SMALL_CONSTANT_ELEMENTS) -> DataflowVerdict:
    """Classify the nodes ORT placed on the CPU provider (names as `cpu_node_names` gives them) by what feeds them.
    `graph` must be the partitioned graph (`partitioned_graph`), not the .onnx file: see the module docstring."""
    wanted = set(cpu_nodes)
    shapes = shape_tensors(graph, small_constant_elements=small_constant_elements)
    shape_path: Counter[str] = Counter()
    refused: list[str] = []
    seen: set[str] = set()
    for node in graph.node:
        if node.name in wanted:
            seen.add(node.name)
            if _is_shape_path(node, shapes):
                shape_path[node.op_type] += 1
            else:
                refused.append(f"{node.op_type} {node.name}")
    for node in _nested_nodes(graph):
        if node.name in wanted and node.name not in seen:
            seen.add(node.name)
            refused.append(f"{node.op_type} {node.name}")
    unmatched = sorted(wanted - seen)
    return DataflowVerdict(dict(shape_path), refused, unmatched, ok=not refused and not unmatched)


def cpu_node_names(session: ort.InferenceSession) -> list[str]:
    """Names of the nodes assigned to the CPU provider (the session needs session.record_ep_graph_assignment_info=1)."""
    return [node.name for subgraph in session.get_provider_graph_assignment_info()
            if subgraph.ep_name == CPU_PROVIDER for node in subgraph.get_nodes()]


DISCARD = "weights.discarded"
"""File name ORT writes the dump's weights to: a link to the null device, so no weight reaches the disk."""


def partitioned_graph(model: str | Path | bytes, workdir: str | Path | None = None,
                      external_folder: str | Path | None = None) -> onnx.GraphProto:
    """The graph whose node names `get_provider_graph_assignment_info()` reports: the model after ORT's level-1
    (basic) optimizations, written by a CPU-only session. ``model`` may be serialized bytes (a graph built in
    process, like the scheduler step, or a LoRA variant whose initializers point at external files: then
    ``external_folder`` is the folder they are in, as the session that serves it was told with
    ``session.model_external_initializers_file_folder_path``; without it ORT refuses the bytes, tensorprotoutils.cc
    ValidateExternalDataPathFromDir, "External data path for model loaded from bytes escapes working directory").

    No copy of the weights: ORT writes every initializer over 1024 bytes to
    ``session.optimized_model_external_initializers_file_name``, which here is a symbolic link to the null device,
    so the dump of a 3.4 GB UNet costs the graph's few MB on disk (ORT then removes the link, the written file
    reading as empty), and the graph is read back without external data."""
    with tempfile.TemporaryDirectory(dir=workdir, prefix="sdserve-audit-") as tmp:
        out = Path(tmp) / "partitioned.onnx"
        (Path(tmp) / DISCARD).symlink_to(os.devnull)
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        so.optimized_model_filepath = str(out)
        so.add_session_config_entry("session.optimized_model_external_initializers_file_name", DISCARD)
        so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
        if external_folder is not None:
            so.add_session_config_entry("session.model_external_initializers_file_folder_path", str(external_folder))
        ort.InferenceSession(model if isinstance(model, bytes) else str(model), sess_options=so,
                             providers=[CPU_PROVIDER])
        return onnx.load(str(out), load_external_data=False).graph

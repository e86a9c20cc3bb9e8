"""Placement audit by data flow on the real tiny model and real onnxruntime: the nodes the CUDA provider's
GetCpuPreferredNodes would leave on the CPU are shape path (allowed); an activation op on the CPU is refused by name.

No GPU here, so the CUDA partitioner's rule is emulated on the graph ORT partitions (the rule and the CUDA kernels'
CPU inputs/outputs as read in onnxruntime/core/framework/fallback_cpu_capability.cc and
onnxruntime/core/providers/cuda/tensor/*.cc), and the node names are checked against a real session's assignment."""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from engines.runtime.dataflow import classify_cpu_nodes, cpu_node_names, partitioned_graph, shape_tensors

PARTS = ("unet", "text_encoder", "vae_decoder")
COMPUTE = {"unet": "Conv", "text_encoder": "MatMul", "vae_decoder": "Conv"}

# GetCpuPreferredNodes, as emulated: CUDA kernels whose outputs live on the CPU (Shape, Size: OutputMemoryType
# CPUOutput in shape_op.cc / size.cc), and the inputs CUDA kernels take on the CPU themselves (InputMemoryType
# CPUInput: reshape, expand, unsqueeze, squeeze, slice, tile, resize, upsample, trilu, constant_of_shape, range, ...).
CPU_OUTPUT_OPS = frozenset({"Shape", "Size"})
CUDA_CPU_INPUTS: dict[str, frozenset[int]] = {
    "Reshape": frozenset({1}), "Expand": frozenset({1}), "Unsqueeze": frozenset({1}), "Squeeze": frozenset({1}),
    "Slice": frozenset({1, 2, 3, 4}), "Tile": frozenset({1}), "Resize": frozenset({1, 2, 3}),
    "Upsample": frozenset({1}), "Trilu": frozenset({1}), "ConstantOfShape": frozenset({0}),
    "Range": frozenset({0, 1, 2}), "Split": frozenset({1}), "TopK": frozenset({1}), "Pad": frozenset({1, 2, 3}),
}
SMALL_INITIALIZER = 100  # kSmallInitializerThreshold
NO_CPU = frozenset({TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT8E4M3FNUZ,
                    TensorProto.FLOAT8E5M2, TensorProto.FLOAT8E5M2FNUZ})


def _topological(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    producer = {out: i for i, node in enumerate(graph.node) for out in node.output}
    waiting = [sum(1 for name in set(node.input) if name in producer) for node in graph.node]
    consumers: defaultdict[int, list[int]] = defaultdict(list)
    for i, node in enumerate(graph.node):
        for name in set(node.input):
            if name in producer:
                consumers[producer[name]].append(i)
    ready = [i for i, w in enumerate(waiting) if w == 0]
    order: list[onnx.NodeProto] = []
    while ready:
        i = ready.pop(0)
        order.append(graph.node[i])
        for j in consumers[i]:
            waiting[j] -= 1
            if waiting[j] == 0:
                ready.append(j)
    assert len(order) == len(graph.node), "graph has a cycle"
    return order


def cuda_cpu_preferred_nodes(graph: onnx.GraphProto) -> set[str]:
    """GetCpuPreferredNodes for a graph whose every node has a CUDA kernel: from the consumers of CPU outputs, in
    topological order, a node goes to the CPU when each input is a small initializer, a graph input, or a CPU value
    the CUDA kernel does not take on the CPU itself, and none is float16/bfloat16/float8."""
    initializers = {t.name: math.prod(t.dims) for t in graph.initializer}
    small = {name for name, size in initializers.items() if size <= SMALL_INITIALIZER}
    graph_inputs = {i.name for i in graph.input if i.name not in initializers}
    elem_type = {v.name: v.type.tensor_type.elem_type for v in [*graph.input, *graph.value_info, *graph.output]}
    elem_type |= {t.name: t.data_type for t in graph.initializer}
    cpu_values: set[str] = set()
    candidates: set[str] = set()
    placed: set[str] = set()
    for node in _topological(graph):
        if node.op_type in CPU_OUTPUT_OPS:
            cpu_values.update(node.output)
            continue
        if not any(name in cpu_values for name in node.input):
            continue
        candidates.add(node.name)
        if _goes_to_cpu(node, small | graph_inputs, cpu_values, elem_type):
            placed.add(node.name)
            cpu_values.update(node.output)
    assert placed <= candidates
    return placed


def _goes_to_cpu(node: onnx.NodeProto, free: set[str], cpu_values: set[str], elem_type: dict[str, int]) -> bool:
    for index, name in enumerate(node.input):
        if not name:
            continue
        if elem_type.get(name) in NO_CPU:
            return False
        if name in free:
            continue
        if name not in cpu_values or index in CUDA_CPU_INPUTS.get(node.op_type, frozenset()):
            return False
    return True


@dataclass(frozen=True)
class Part:
    model: Path
    graph: onnx.GraphProto
    assigned: frozenset[tuple[str, str]]
    """(name, op_type) from a real session built as engines/runtime/sessions.py builds them (ORT_ENABLE_ALL)."""
    on_cpu: list[str]
    preferred: set[str]

    def node(self, name: str) -> onnx.NodeProto:
        found: onnx.NodeProto = next(n for n in self.graph.node if n.name == name)
        return found


def _session(model: Path) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    return ort.InferenceSession(str(model), sess_options=so, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def parts(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Part]:
    out: dict[str, Part] = {}
    for name in PARTS:
        model = tiny_model / name / "model.onnx"
        graph = partitioned_graph(model, tmp_path_factory.mktemp(name))
        session = _session(model)
        assigned = frozenset((n.name, n.op_type) for sg in session.get_provider_graph_assignment_info()
                             for n in sg.get_nodes())
        out[name] = Part(model, graph, assigned, cpu_node_names(session), cuda_cpu_preferred_nodes(graph))
    return out


@pytest.mark.parametrize("name", PARTS)
def test_assignment_names_are_those_of_the_partitioned_graph_not_of_the_file(parts: dict[str, Part],
                                                                             name: str) -> None:
    part = parts[name]
    assert part.assigned == {(n.name, n.op_type) for n in part.graph.node}
    original = {n.name for n in onnx.load(str(part.model), load_external_data=False).graph.node}
    assert {n for n, _ in part.assigned} - original  # e.g. Gather_token_1, made from Shape(Transpose) by ORT
    assert sorted(part.on_cpu) == sorted(n for n, _ in part.assigned)  # CPU-only session: every node on the CPU


@pytest.mark.parametrize("name", PARTS)
def test_cuda_cpu_preferred_nodes_are_the_shape_path_and_allowed(parts: dict[str, Part], name: str) -> None:
    part = parts[name]
    assert len(part.preferred) >= 10
    assert {n for n, _ in part.assigned} >= part.preferred  # names a real session reports
    verdict = classify_cpu_nodes(part.graph, part.preferred)
    assert verdict.ok, verdict.activation_on_cpu[:5]
    assert verdict.activation_on_cpu == [] and verdict.unmatched == []
    assert verdict.shape_path == Counter(part.node(n).op_type for n in part.preferred)
    assert {"Gather", "Unsqueeze", "Concat"} <= set(verdict.shape_path)


def test_unet_shape_path_holds_the_arithmetic_an_op_name_allowlist_refuses(parts: dict[str, Part]) -> None:
    verdict = classify_cpu_nodes(parts["unet"].graph, parts["unet"].preferred)
    for op in ("Div", "Mul", "Sqrt", "Add", "Cast"):
        assert verdict.shape_path.get(op, 0) > 0, (op, verdict.shape_path)
    vae = classify_cpu_nodes(parts["vae_decoder"].graph, parts["vae_decoder"].preferred)
    assert vae.shape_path.get("Div", 0) > 0 and vae.shape_path.get("Sqrt", 0) > 0


def _first(part: Part, op: str, activations_only: bool = False) -> onnx.NodeProto:
    shapes = shape_tensors(part.graph)
    initializers = {t.name for t in part.graph.initializer}
    node: onnx.NodeProto
    for node in part.graph.node:
        fed = [i for i in node.input if i]
        if node.op_type == op and (not activations_only or all(i not in shapes and i not in initializers for i in fed)):
            return node
    raise AssertionError(f"no {op} in {part.model}")


@pytest.mark.parametrize("name", PARTS)
def test_a_compute_op_moved_to_the_cpu_is_refused_by_name(parts: dict[str, Part], name: str) -> None:
    part = parts[name]
    allowed = classify_cpu_nodes(part.graph, part.preferred)
    compute = _first(part, COMPUTE[name])
    verdict = classify_cpu_nodes(part.graph, [*part.preferred, compute.name])
    assert not verdict.ok
    assert verdict.activation_on_cpu == [f"{COMPUTE[name]} {compute.name}"]
    assert verdict.shape_path == allowed.shape_path


@pytest.mark.parametrize("name", PARTS)
def test_an_add_of_activations_on_the_cpu_is_refused_though_add_is_on_the_shape_path(parts: dict[str, Part],
                                                                                     name: str) -> None:
    part = parts[name]
    add = _first(part, "Add", activations_only=True)
    assert add.name not in part.preferred
    verdict = classify_cpu_nodes(part.graph, [*part.preferred, add.name])
    assert not verdict.ok and verdict.activation_on_cpu == [f"Add {add.name}"]


@pytest.mark.parametrize("name", PARTS)
def test_a_whole_cpu_session_is_refused_and_its_shape_path_still_counted(parts: dict[str, Part], name: str) -> None:
    part = parts[name]
    verdict = classify_cpu_nodes(part.graph, part.on_cpu)
    assert not verdict.ok and verdict.unmatched == []
    assert any(entry.startswith(f"{COMPUTE[name]} ") for entry in verdict.activation_on_cpu)
    preferred = Counter(part.node(n).op_type for n in part.preferred)
    assert all(verdict.shape_path.get(op, 0) >= count for op, count in preferred.items())
    assert sum(verdict.shape_path.values()) + len(verdict.activation_on_cpu) == len(part.on_cpu)


def test_the_model_file_is_the_wrong_graph_and_fails_closed(parts: dict[str, Part]) -> None:
    part = parts["unet"]
    original = onnx.load(str(part.model), load_external_data=False).graph
    verdict = classify_cpu_nodes(original, part.preferred)
    assert not verdict.ok
    assert verdict.unmatched and all(n not in {m.name for m in original.node} for n in verdict.unmatched)


def _graph(nodes: list[onnx.NodeProto], initializers: list[onnx.TensorProto] | None = None) -> onnx.GraphProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4, "h", "w"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    return helper.make_graph(nodes, "g", [x], [y], initializer=initializers or [])


def test_shape_arithmetic_is_allowed_but_shape_of_an_activation_on_the_cpu_is_not() -> None:
    idx = [helper.make_tensor(n, TensorProto.INT64, [], [v]) for n, v in (("i2", 2), ("i3", 3))]
    graph = _graph([
        helper.make_node("Shape", ["x"], ["s"], name="shape"),
        helper.make_node("Gather", ["s", "i2"], ["h"], name="gh"),
        helper.make_node("Gather", ["s", "i3"], ["w"], name="gw"),
        helper.make_node("Mul", ["h", "w"], ["hw"], name="hxw"),
        helper.make_node("Mul", ["x", "x"], ["y"], name="square"),
    ], idx)
    assert {"s", "h", "w", "hw", "i2", "i3"} <= shape_tensors(graph) and "x" not in shape_tensors(graph)
    assert classify_cpu_nodes(graph, ["gh", "gw", "hxw"]).shape_path == {"Gather": 2, "Mul": 1}
    verdict = classify_cpu_nodes(graph, ["shape", "hxw", "square", "ghost"])
    assert verdict.activation_on_cpu == ["Shape shape", "Mul square"] and verdict.unmatched == ["ghost"]
    assert not verdict.ok


def test_weights_and_graph_inputs_are_not_shape_values() -> None:
    big = helper.make_tensor("weight", TensorProto.FLOAT, [101], [0.0] * 101)
    small = helper.make_tensor("scale", TensorProto.FLOAT, [1], [8.0])
    graph = _graph([
        helper.make_node("Sqrt", ["scale"], ["root"], name="root"),
        helper.make_node("Neg", ["weight"], ["negw"], name="negw"),
        helper.make_node("Cast", ["x"], ["y"], name="cast", to=TensorProto.FLOAT),
    ], [big, small])
    verdict = classify_cpu_nodes(graph, ["root", "negw", "cast"])
    assert verdict.shape_path == {"Sqrt": 1}
    assert verdict.activation_on_cpu == ["Neg negw", "Cast cast"]


def test_subgraphs_are_refused_even_when_fed_by_shapes() -> None:
    branch = helper.make_graph([helper.make_node("Identity", ["s"], ["o"], name="inner")], "b", [],
                               [helper.make_tensor_value_info("o", TensorProto.INT64, None)])
    graph = _graph([
        helper.make_node("Shape", ["x"], ["s"], name="shape"),
        helper.make_node("Size", ["s"], ["n"], name="size"),
        helper.make_node("Cast", ["n"], ["c"], name="cond", to=TensorProto.BOOL),
        helper.make_node("If", ["c"], ["z"], name="if", then_branch=branch, else_branch=branch),
        helper.make_node("Identity", ["z"], ["y"], name="after"),
    ])
    assert "c" in shape_tensors(graph) and "z" not in shape_tensors(graph)
    verdict = classify_cpu_nodes(graph, ["cond", "if", "inner", "after"])
    assert verdict.shape_path == {"Cast": 1}
    assert verdict.activation_on_cpu == ["If if", "Identity after", "Identity inner"]


def test_small_static_graph_inputs_are_shape_values_as_in_get_cpu_preferred_nodes() -> None:
    """GetCpuPreferredNodes (onnxruntime/core/framework/fallback_cpu_capability.cc) lets a node fed by a CPU value
    read graph inputs ("allow placing on CPU if it's a small initializer or graph input"): `Mul(Cast(Gather(Shape(x))),
    t)` with the UNet-like `timestep` input t of shape [1] goes to the CPU, and the audit must allow it. A node that
    mixes a shape value with the latent input x (symbolic dims) stays refused."""
    index = helper.make_tensor("i2", TensorProto.INT64, [], [2])
    t = helper.make_tensor_value_info("t", TensorProto.FLOAT, [1])
    nodes = [helper.make_node("Shape", ["x"], ["s"], name="shape"),
             helper.make_node("Gather", ["s", "i2"], ["h"], name="gh"),
             helper.make_node("Cast", ["h"], ["hf"], name="cast", to=TensorProto.FLOAT),
             helper.make_node("Mul", ["hf", "t"], ["scaled"], name="times_t"),
             helper.make_node("Add", ["x", "hf"], ["y"], name="x_plus_h")]
    graph = _graph(nodes, [index])
    graph.input.append(t)
    assert "times_t" in cuda_cpu_preferred_nodes(graph)
    verdict = classify_cpu_nodes(graph, ["gh", "cast", "times_t", "x_plus_h"])
    assert verdict.shape_path == {"Gather": 1, "Cast": 1, "Mul": 1}
    assert verdict.activation_on_cpu == ["Add x_plus_h"]

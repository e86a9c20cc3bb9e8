"""Per-node placement audit: which provider runs each node, and whether anything on the activation path landed on
the CPU. The verdict is by data flow (engines/runtime/dataflow.py), not by op name: the CUDA provider leaves shape
arithmetic (Gather, Mul, Div, Sqrt, Add, ... on Shape outputs) on the CPU on purpose, and the same op types on
activations are exactly what must not run there."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import onnxruntime as ort

from engines.runtime.dataflow import CPU_PROVIDER, classify_cpu_nodes, partitioned_graph
from engines.types.snapshot import Placement

CONFIG_KEY = "session.record_ep_graph_assignment_info"

# Informational only (reported as compute_on_cpu): the verdict never looks at op names.
COMPUTE_OPS = frozenset({
    "Conv", "ConvTranspose", "MatMul", "Gemm", "MatMulInteger", "QLinearMatMul", "Einsum", "Attention",
    "MultiHeadAttention", "GroupQueryAttention", "PackedAttention", "Softmax", "LayerNormalization",
    "SkipLayerNormalization", "GroupNorm", "GroupNormalization", "InstanceNormalization", "BatchNormalization",
    "BiasGelu", "FastGelu", "Gelu", "BiasSplitGelu", "BiasAdd", "Resize", "Erf", "Sigmoid", "Tanh", "Sin", "Cos",
})
ATTENTION_OPS = frozenset({"Attention", "MultiHeadAttention", "PackedAttention", "PackedMultiHeadAttention",
                           "GroupQueryAttention"})


@dataclass
class PlacementReport:
    session: str
    nodes_by_provider: dict[str, int] = field(default_factory=dict)
    cpu_ops: dict[str, int] = field(default_factory=dict)
    """op_type -> count of nodes on the CPU provider."""
    cpu_nodes: list[str] = field(default_factory=list)
    cpu_named: list[tuple[str, str]] = field(default_factory=list)
    """(op_type, name) of each CPU node, in assignment order."""
    shape_path: dict[str, int] = field(default_factory=dict)
    """op_type -> CPU nodes computing only on shape values (allowed, counted)."""
    activation_on_cpu: list[str] = field(default_factory=list)
    """'OpType name' of CPU nodes on the path of an activation (refused), in graph order."""
    unmatched: list[str] = field(default_factory=list)
    """CPU node names absent from the partitioned graph (refused: the audit cannot vouch for them)."""
    compute_on_cpu: dict[str, int] = field(default_factory=dict)
    attention: dict[str, int] = field(default_factory=dict)
    """provider -> count of fused attention nodes (Attention, MultiHeadAttention, ...)."""
    unclassified: str = ""
    """Why the CPU nodes were not classified (CPU allowed by the profile, or the graph could not be read)."""

    @property
    def ok(self) -> bool:
        return not (self.activation_on_cpu or self.unmatched or self.unclassified)

    @property
    def disallowed(self) -> dict[str, int]:
        """op_type -> count of the refused CPU nodes (activation path, unmatched, or all when unclassified)."""
        if self.unclassified:
            return dict(self.cpu_ops)
        return dict(Counter(entry.split(" ", 1)[0] for entry in self.activation_on_cpu)
                    + Counter({"?": len(self.unmatched)} if self.unmatched else {}))

    def refusal(self) -> str:
        """What an operator reads when the session is refused: the nodes, by name."""
        if self.unclassified:
            return f"{len(self.cpu_nodes)} node(s) on the CPU, not classified: {self.unclassified}"
        parts = []
        if self.activation_on_cpu:
            shown = ", ".join(self.activation_on_cpu[:5])
            more = f" and {len(self.activation_on_cpu) - 5} more" if len(self.activation_on_cpu) > 5 else ""
            parts.append(f"{len(self.activation_on_cpu)} node(s) on the activation path run on the CPU: "
                         f"{shown}{more}")
        if self.unmatched:
            parts.append(f"CPU node(s) not in the partitioned graph: {', '.join(self.unmatched[:5])}")
        return "; ".join(parts) + f" (shape-path nodes allowed on the CPU: {self.shape_path})"

    def to_model(self) -> Placement:
        examples = [*self.activation_on_cpu, *self.unmatched][:10] or ([self.unclassified] if self.unclassified
                                                                     else [])
        return Placement(session=self.session, nodes_by_provider=self.nodes_by_provider, cpu_ops=self.cpu_ops,
                         disallowed_on_cpu=self.disallowed, compute_on_cpu=self.compute_on_cpu,
                         examples=tuple(examples), attention=self.attention, ok=self.ok,
                         shape_path=self.shape_path, activation_on_cpu=tuple(self.activation_on_cpu),
                         unmatched=tuple(self.unmatched))


def _counts(session: ort.InferenceSession, name: str) -> PlacementReport:
    report = PlacementReport(name)
    by_provider: Counter[str] = Counter()
    cpu: Counter[str] = Counter()
    attention: Counter[str] = Counter()
    for subgraph in session.get_provider_graph_assignment_info():
        for node in subgraph.get_nodes():
            by_provider[subgraph.ep_name] += 1
            if node.op_type in ATTENTION_OPS:
                attention[subgraph.ep_name] += 1
            if subgraph.ep_name == CPU_PROVIDER:
                cpu[node.op_type] += 1
                report.cpu_nodes.append(node.name)
                report.cpu_named.append((node.op_type, node.name))
    report.nodes_by_provider, report.cpu_ops, report.attention = dict(by_provider), dict(cpu), dict(attention)
    report.compute_on_cpu = {op: n for op, n in cpu.items() if op in COMPUTE_OPS}
    return report


def audit(session: ort.InferenceSession, name: str, model: Path | bytes, *, classify: bool = True,
          external_folder: Path | str | None = None) -> PlacementReport:
    """Read the recorded assignment (the session must be built with CONFIG_KEY=1) and classify its CPU nodes.

    Cost: only when some node is on the CPU, the model is opened once more by a CPU-only session at
    ORT_ENABLE_BASIC to write the graph the partitioner named (dataflow.partitioned_graph; weights go to a
    link to the null device, never to disk; ``external_folder``: where the initializers of a model given as bytes
    are, as its session was told). A healthy TensorRT EP-context component has no CPU node and pays
    nothing. ``classify=False`` (CPU allowed by the profile) skips it: everything is on the CPU by design."""
    report = _counts(session, name)
    if not report.cpu_nodes:
        return report
    if not classify:
        report.unclassified = "CPU allowed by the profile"
        return report
    try:
        graph = partitioned_graph(model, external_folder=external_folder)
    except Exception as exc:  # e.g. EPContext nodes have no CPU kernel: fail closed, say why
        report.unclassified = f"cannot write the partitioned graph: {str(exc).strip()[:300]}"
        return report
    verdict = classify_cpu_nodes(graph, report.cpu_nodes)
    report.shape_path, report.activation_on_cpu = verdict.shape_path, verdict.activation_on_cpu
    report.unmatched = verdict.unmatched
    return report

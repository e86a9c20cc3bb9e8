"""Per-node placement audit: which provider runs each node, and whether a compute op landed on the CPU."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import onnxruntime as ort

from engines.protocol import Placement

CONFIG_KEY = "session.record_ep_graph_assignment_info"

# Ops that do real arithmetic on activations: never acceptable on the CPU in a GPU session.
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
    disallowed: dict[str, int] = field(default_factory=dict)
    """CPU ops not in the allowlist (compute ops among them)."""
    compute_on_cpu: dict[str, int] = field(default_factory=dict)
    attention: dict[str, int] = field(default_factory=dict)
    """provider -> count of fused attention nodes (Attention, MultiHeadAttention, ...)."""
    examples: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.disallowed

    def to_model(self) -> Placement:
        return Placement(session=self.session, nodes_by_provider=self.nodes_by_provider, cpu_ops=self.cpu_ops,
                         disallowed_on_cpu=self.disallowed, compute_on_cpu=self.compute_on_cpu,
                         examples=tuple(self.examples), attention=self.attention, ok=self.ok)


def audit(session: ort.InferenceSession, name: str, cpu_allowlist: frozenset[str]) -> PlacementReport:
    """Read the recorded assignment (the session must be built with CONFIG_KEY=1)."""
    report = PlacementReport(name)
    by_provider: Counter[str] = Counter()
    cpu: Counter[str] = Counter()
    attention: Counter[str] = Counter()
    for subgraph in session.get_provider_graph_assignment_info():
        for node in subgraph.get_nodes():
            by_provider[subgraph.ep_name] += 1
            if node.op_type in ATTENTION_OPS:
                attention[subgraph.ep_name] += 1
            if subgraph.ep_name == "CPUExecutionProvider":
                cpu[node.op_type] += 1
                if node.op_type not in cpu_allowlist and len(report.examples) < 10:
                    report.examples.append(f"{node.op_type} {node.name}")
    report.nodes_by_provider = dict(by_provider)
    report.cpu_ops = dict(cpu)
    report.disallowed = {op: n for op, n in cpu.items() if op not in cpu_allowlist}
    report.compute_on_cpu = {op: n for op, n in cpu.items() if op in COMPUTE_OPS}
    report.attention = dict(attention)
    return report

"""Fuse exported attention into ONNX Runtime's ``com.microsoft.MultiHeadAttention``, as a graph rewrite.

Why a rewrite of our own rather than ORT's matchers: on torch 2.13's legacy exports, ORT's UNet matcher raises
``TypeError`` in ``FusionAttentionUnet.get_num_heads`` (onnxruntime/transformers/fusion_attention_unet.py calls
``int()`` on a shape-[1] array, which NumPy 2.4 refuses: "only 0-dimensional arrays can be converted to Python
scalars"), and its CLIP matcher expects the eager pattern, not SDPA's. Every attention we serve (diffusers'
``AttnProcessor2_0``, transformers' sdpa CLIP) goes through ``F.scaled_dot_product_attention``, which the legacy
exporter writes one way (``scaled_dot_product_attention`` in torch's symbolic_opset14.py)::

    q3 -> Reshape -> Transpose(0,2,1,3) -> Mul(sqrt(scale)) --\\
    k3 -> Reshape -> Transpose(0,2,3,1) -> Mul(sqrt(scale)) --- MatMul [-> Add(mask)] -> Softmax --\\
    v3 -> Reshape -> Transpose(0,2,1,3) --------------------------------------------------------- MatMul
       -> [Reshape (4-D, CLIP)] -> Transpose(0,2,1,3) -> Reshape -> out3

so one matcher keyed on that pattern covers the UNet, CLIP and the VAE's mid-block attention, and the export itself
stays standard ONNX for TensorRT (one export, two optimize targets). Heads, head size and scale are not guessed from
constants: one probe run of the graph (random inputs, CPU) reads the reshaped Q/K shapes and the scale factors, so
shape arithmetic the exporter left dynamic is no obstacle.

The fused node takes Q/K/V as (batch, tokens, hidden) with separate weights, as ORT's CPU kernel requires
(onnxruntime/contrib_ops/cpu/bert/multihead_attention.cc: packed QKV/KV is ``ORT_NOT_IMPLEMENTED`` on the CPU); with
no mask that kernel runs MLAS flash attention, without the tokens x tokens score buffer.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import NodeProto, helper

log = logging.getLogger(__name__)
MS_DOMAIN = "com.microsoft"
FUSED_OP = "MultiHeadAttention"


class _Graph:
    """Producer and consumer indexes over one graph's nodes."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.graph = graph
        self.producer: dict[str, NodeProto] = {o: n for n in graph.node for o in n.output if o}
        self.consumers: dict[str, list[NodeProto]] = {}
        for node in graph.node:
            for name in node.input:
                self.consumers.setdefault(name, []).append(node)

    def parent(self, node: NodeProto, index: int, op: str) -> NodeProto | None:
        found = self.producer.get(node.input[index]) if index < len(node.input) else None
        return found if found is not None and found.op_type == op else None

    def compute_consumers(self, name: str) -> list[NodeProto]:
        """Consumers that read the tensor's values (a Shape node reads only its shape)."""
        return [n for n in self.consumers.get(name, []) if n.op_type != "Shape"]


def _perm(node: NodeProto) -> list[int]:
    return next((list(a.ints) for a in node.attribute if a.name == "perm"), [])


@dataclass
class Match:
    """One exported attention: its 3-D inputs, optional additive mask, 3-D output and the tensors to probe."""

    softmax: str
    query: str
    key: str
    value: str
    mask: str | None
    output: str
    last: NodeProto
    q4: str
    k4: str
    scales: tuple[str, ...]


def _scaled(g: _Graph, node: NodeProto | None, perm: list[int]) -> tuple[str, NodeProto | None, tuple[str, ...]]:
    """(3-D input, its Reshape, scale tensors) behind ``[Mul(scale)] <- Transpose(perm) <- Reshape <- x``."""
    scales: tuple[str, ...] = ()
    if node is not None and node.op_type == "Mul":
        side = next((i for i in (0, 1) if g.parent(node, i, "Transpose") is not None), None)
        if side is None:
            return "", None, ()
        scales = (node.input[1 - side],)
        node = g.parent(node, side, "Transpose")
    if node is None or node.op_type != "Transpose" or _perm(node) != perm:
        return "", None, ()
    reshape = g.parent(node, 0, "Reshape")
    return (reshape.input[0], reshape, scales) if reshape is not None else ("", None, ())


def _output_chain(g: _Graph, matmul: NodeProto) -> NodeProto | None:
    """The Reshape that ends ``MatMul -> [Reshape]* -> Transpose(0,2,1,3) -> Reshape`` (one value consumer each)."""
    node = matmul
    for _ in range(4):
        users = g.compute_consumers(node.output[0])
        if len(users) != 1:
            return None
        nxt = users[0]
        if nxt.op_type == "Transpose":
            if _perm(nxt) != [0, 2, 1, 3]:
                return None
            final = g.compute_consumers(nxt.output[0])
            return final[0] if len(final) == 1 and final[0].op_type == "Reshape" else None
        if nxt.op_type != "Reshape":
            return None
        node = nxt
    return None


def match(g: _Graph, softmax: NodeProto) -> Match | str:
    """The attention around ``softmax``, or why it is not the exported SDPA pattern."""
    score = g.producer.get(softmax.input[0])
    mask = None
    if score is not None and score.op_type == "Add":
        side = next((i for i in (0, 1) if g.parent(score, i, "MatMul") is not None), None)
        if side is None:
            return "Add before Softmax has no MatMul input"
        mask = score.input[1 - side]
        score = g.parent(score, side, "MatMul")
    if score is None or score.op_type != "MatMul":
        return "Softmax input is not MatMul(Q, K^T)"
    query, q_reshape, q_scales = _scaled(g, g.producer.get(score.input[0]), [0, 2, 1, 3])
    key, k_reshape, k_scales = _scaled(g, g.producer.get(score.input[1]), [0, 2, 3, 1])
    if q_reshape is None or k_reshape is None:
        return "Q or K is not Reshape -> Transpose [-> Mul(scale)]"
    users = g.compute_consumers(softmax.output[0])
    if len(users) != 1 or users[0].op_type != "MatMul" or users[0].input[0] != softmax.output[0]:
        return "Softmax output is not MatMul(P, V)"
    value, v_reshape, _ = _scaled(g, g.producer.get(users[0].input[1]), [0, 2, 1, 3])
    last = _output_chain(g, users[0])
    if v_reshape is None or last is None:
        return "V or the output is not Reshape/Transpose(0,2,1,3)"
    return Match(softmax.name, query, key, value, mask, last.output[0], last, q_reshape.output[0],
                 k_reshape.output[0], q_scales + k_scales)


def _probe(model: onnx.ModelProto, names: list[str], feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run ``model`` once on the CPU with ``names`` added as outputs (ORT infers their types)."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    known = {o.name for o in probe.graph.output}
    probe.graph.output.extend(onnx.ValueInfoProto(name=n) for n in dict.fromkeys(names) if n not in known)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(probe.SerializeToString(), options, providers=["CPUExecutionProvider"])
    wanted = list(dict.fromkeys(names))
    return dict(zip(wanted, session.run(wanted, feeds), strict=True))


def _fused_node(m: Match, values: dict[str, np.ndarray], index: int) -> tuple[NodeProto, list[NodeProto]] | str:
    """The MultiHeadAttention node for ``m`` (+ an Unsqueeze lifting a lower-rank mask to 4-D), or why not."""
    q4, k4, out = values[m.q4].shape, values[m.k4].shape, values[m.output].shape
    if len(q4) != 4 or len(k4) != 4 or q4[2] != k4[2] or q4[3] != k4[3] or len(out) != 3:
        return f"unexpected shapes q {q4}, k {k4}, output {out}"
    heads = int(q4[2])
    scale = 1.0
    for name in m.scales:
        factor = values[name]
        if factor.size != 1:
            return f"scale {name} is not a scalar (shape {factor.shape})"
        scale *= float(factor.reshape(()))
    extra: list[NodeProto] = []
    mask = m.mask or ""
    if m.mask is not None:
        rank = values[m.mask].ndim
        if rank > 4:
            return f"mask of rank {rank}"
        if rank < 4:
            axes = f"{m.softmax}/mha_mask_axes"
            extra.append(helper.make_node("Constant", [], [axes], name=f"{axes}_const",
                                          value=helper.make_tensor(axes, onnx.TensorProto.INT64, [4 - rank],
                                                                   list(range(4 - rank)))))
            mask = f"{m.softmax}/mha_mask_4d"
            extra.append(helper.make_node("Unsqueeze", [m.mask, axes], [mask], name=f"{mask}_unsqueeze"))
    node = helper.make_node(FUSED_OP, [m.query, m.key, m.value, "", "", mask], [m.output],
                            name=f"{FUSED_OP}_{index}", domain=MS_DOMAIN, num_heads=heads, scale=scale)
    return node, extra


def prune(graph: onnx.GraphProto) -> int:
    """Drop nodes (and initializers) nothing reads any more; returns how many nodes went."""
    removed = 0
    while True:
        used = {o.name for o in graph.output} | {i for n in graph.node for i in n.input}
        dead = [n for n in graph.node if not any(o in used for o in n.output)]
        if not dead:
            break
        for node in dead:
            graph.node.remove(node)
        removed += len(dead)
    used = {i for n in graph.node for i in n.input}
    for init in [i for i in graph.initializer if i.name not in used]:
        graph.initializer.remove(init)
    return removed


def fuse_attention(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, Any]:
    """Rewrite every exported SDPA attention in ``model`` (in place) into MultiHeadAttention. Returns the report:
    fused count, heads per node, softmax nodes left (with why each did not match)."""
    g = _Graph(model.graph)
    matches: list[Match] = []
    unmatched: dict[str, str] = {}
    for node in [n for n in model.graph.node if n.op_type == "Softmax"]:
        found = match(g, node)
        if isinstance(found, str):
            unmatched[node.name] = found
        else:
            matches.append(found)
    values = _probe(model, [t for m in matches for t in (m.q4, m.k4, m.output, *m.scales, *(m.mask or "",))
                            if t], feeds) if matches else {}
    heads: Counter[int] = Counter()
    for index, m in enumerate(matches):
        built = _fused_node(m, values, index)
        if isinstance(built, str):
            unmatched[m.softmax] = built
            continue
        node, extra = built
        position = list(model.graph.node).index(m.last)
        model.graph.node.remove(m.last)
        for offset, new in enumerate([*extra, node]):
            model.graph.node.insert(position + offset, new)
        heads[helper.get_attribute_value(next(a for a in node.attribute if a.name == "num_heads"))] += 1
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    pruned = prune(model.graph)
    left = {n.name: unmatched.get(n.name, "still in the graph") for n in model.graph.node if n.op_type == "Softmax"}
    fused = sum(1 for n in model.graph.node if n.op_type == FUSED_OP and n.domain == MS_DOMAIN)
    log.info("attention: %d fused (heads %s), %d softmax left, %d nodes pruned", fused, dict(heads), len(left),
             pruned)
    return {"fused": fused, "heads": {str(k): v for k, v in sorted(heads.items())}, "unfused": left,
            "nodes_pruned": pruned}

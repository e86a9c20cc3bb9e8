"""``W' = W + sum_i s_i * B_i @ A_i`` on the serving device, by a small ONNX graph (no torch at serve time).

Several LoRAs on one weight are one product: their factors are stacked along the rank, each B scaled by its
multiplier times ``alpha / rank`` on the host (they are small), so ``B_cat @ A_cat`` is the sum of the products. The
delta is computed in float32 and added to the float32 base, then cast to the weight's dtype, as diffusers'
``fuse_lora`` and A1111 do it in float32. The result is a new device tensor: the base weight, and every other set's
merged weights, are never written.
"""

from __future__ import annotations

from functools import cache

import numpy as np
from onnx import TensorProto, helper

from engines.lora.targets import Layout

OPSET = 17
ELEM = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16}


@cache
def merge_graph(layout: Layout, dtype: np.dtype[np.generic], rank: int) -> bytes:
    """Inputs ``W`` (the stored weight, of ``rank``: a plugin EP such as OpenVINO needs a known rank), ``B``
    [out, R] and ``A`` [R, in] float32; output ``merged`` like W. ``transposed``: W is [in, out] (a MatMul's
    weight), so the delta is transposed; ``direct``: the delta is reshaped to W's shape ([out, in] or
    [out, in, kh, kw])."""
    elem = ELEM[np.dtype(dtype)]
    nodes = [helper.make_node("MatMul", ["B", "A"], ["delta"])]
    if layout == "transposed":
        nodes.append(helper.make_node("Transpose", ["delta"], ["shaped"], perm=[1, 0]))
    else:
        nodes += [helper.make_node("Shape", ["W"], ["w_shape"]),
                  helper.make_node("Reshape", ["delta", "w_shape"], ["shaped"])]
    if elem == TensorProto.FLOAT:
        nodes.append(helper.make_node("Add", ["W", "shaped"], ["merged"]))
    else:
        nodes += [helper.make_node("Cast", ["W"], ["w32"], to=TensorProto.FLOAT),
                  helper.make_node("Add", ["w32", "shaped"], ["sum32"]),
                  helper.make_node("Cast", ["sum32"], ["merged"], to=elem)]
    graph = helper.make_graph(
        nodes, f"lora_merge_{layout}",
        [helper.make_tensor_value_info("W", elem, [f"w{i}" for i in range(rank)]),
         helper.make_tensor_value_info("B", TensorProto.FLOAT, ["out", "rank"]),
         helper.make_tensor_value_info("A", TensorProto.FLOAT, ["rank", "in"])],
        [helper.make_tensor_value_info("merged", elem, [f"w{i}" for i in range(rank)])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    return bytes(model.SerializeToString())


def stack(factors: list[tuple[float, np.ndarray, np.ndarray]], out_features: int,
          in_features: int) -> tuple[np.ndarray, np.ndarray]:
    """(scale, up, down) per LoRA on one weight -> (B_cat [out, R], A_cat [R, in]) float32, scales folded into B."""
    ups = [scale * up.reshape(out_features, -1).astype(np.float32) for scale, up, _ in factors]
    downs = [down.reshape(up.shape[1], in_features).astype(np.float32) for up, (_, _, down) in zip(ups, factors,
                                                                                                   strict=True)]
    return np.ascontiguousarray(np.concatenate(ups, axis=1)), np.ascontiguousarray(np.concatenate(downs, axis=0))

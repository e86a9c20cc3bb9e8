"""A graph that holds the same weights as an adaptable component, made to take that component's merged LoRA tensors.

ControlNet's residual UNet (``unet_controlnet/``, engines/build/controlnet.py) is the UNet exported a second time with
the residual inputs: diffusers' ``fuse_lora`` adapts that one UNet (and the text encoder), never the ControlNet, so a
set's merged UNet tensors are what the residual UNet must run with too. Its LoRA targets are the same modules with
the same shapes, but the exporter names the weights of MatMul nodes after the node (``onnx::MatMul_2387`` in one
graph, ``onnx::MatMul_2401`` in the other). ``renamed_like`` gives the graph's target initializers the component's
names, so one merged set binds on both variant sessions by name: no second merge, no second copy of merged weights.
FLUX.1's residual transformer (``transformer_controlnet/``, engines/build/controlnet_dit.py) is the same case for the
transformer: a FLUX.1 LoRA adapts the transformer, never the ControlNet (diffusers' FluxLoraLoaderMixin).
"""

from __future__ import annotations

import onnx

from engines.errors import ModelLoadError
from engines.lora.targets import Target


def rename_map(own: dict[str, Target], like: dict[str, Target], what: str, component: str) -> dict[str, str]:
    """Initializer name in the graph -> the component's name for the same module. ModelLoadError when the module
    sets differ, or a module's weight differs in shape, element type or layout (not the same weights)."""
    if set(own) != set(like):
        extra = sorted(set(own) ^ set(like))
        raise ModelLoadError(f"{what}: its adaptable modules differ from {component}'s ({len(own)} vs {len(like)}, "
                             f"e.g. {extra[0]}): not the same {component}, so a LoRA cannot apply to it")
    out: dict[str, str] = {}
    for module, mine in own.items():
        theirs = like[module]
        if (mine.shape, mine.dtype, mine.layout) != (theirs.shape, theirs.dtype, theirs.layout):
            raise ModelLoadError(f"{what}: weight of {module} is {mine.layout} {list(mine.shape)}, {component}'s is "
                                 f"{theirs.layout} {list(theirs.shape)}: not the same {component}")
        out[mine.initializer] = theirs.initializer
    return out


def renamed_like(model: onnx.ModelProto, own: dict[str, Target], like: dict[str, Target], what: str,
                 component: str) -> onnx.ModelProto:
    """A copy of ``model`` whose target initializers carry ``like``'s names (matched by module). A name of the graph
    that one of them takes (another tensor) moves to a fresh one first; every name is substituted at once, so
    swapped names stay distinct. External data references are kept (they name a file and an offset, not a
    tensor)."""
    mapping = rename_map(own, like, what, component)
    graph = model.graph
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in graph.node
           for a in n.attribute):
        raise ModelLoadError(f"{what}: a graph with subgraphs cannot take {component}'s LoRA weights")
    names = {i.name for i in graph.initializer} | {i.name for i in graph.input} | {o.name for o in graph.output} | \
        {v.name for v in graph.value_info} | {x for n in graph.node for x in (*n.input, *n.output)}
    taken = set(mapping.values())
    counter = 0
    for name in sorted(names & taken):
        if name in mapping:
            continue  # moves away itself
        while f"{name}__moved{counter}" in names:
            counter += 1
        mapping[name] = f"{name}__moved{counter}"
        counter += 1
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    graph = copy.graph
    for value in (*graph.initializer, *graph.input, *graph.output, *graph.value_info):
        value.name = mapping.get(value.name, value.name)
    for node in graph.node:
        node.input[:] = [mapping.get(x, x) for x in node.input]
        node.output[:] = [mapping.get(x, x) for x in node.output]
    return copy

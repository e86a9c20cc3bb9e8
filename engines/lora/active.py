"""The LoRA weights one batch binds: passed with the call, from the engine through the pipeline to every component
that can be adapted (engines/pipelines/unet.py OrtModel.run / bound), never read from ambient state, so a
reader and the type checker see each hop, and two batches can never see each other's weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import onnxruntime as ort

Weights = Mapping[str, Mapping[str, ort.OrtValue]]
"""Per component session name (``unet``, ``text_encoder``...), the merged tensors by initializer name."""


@dataclass
class Adapters:
    """One batch's merged LoRA weights, and the components that ran with them bound (recorded by OrtModel.bound):
    the engine compares ``adapted`` with the components it merged for, so no response or signed manifest says a
    LoRA applied to a component that ran its base weights."""

    weights: Weights = field(default_factory=dict)
    adapted: set[str] = field(default_factory=set)

    def of(self, component: str) -> Mapping[str, ort.OrtValue] | None:
        """The tensors to bind on ``component``'s variant; None when this batch runs its base session there (an
        empty mapping runs the variant on its stored weights: the boot warm-up)."""
        return self.weights.get(component)


def none() -> Adapters:
    """A batch without LoRA (a fresh record each call)."""
    return Adapters()

"""The LoRA weights of the batch running in this context: what OrtModel.run binds (engines/diffusion/pipeline.py).

A context variable, not an attribute of a shared session: a batch's weights are set by the engine around its
pipeline call (engines/engine.py), so two batches (two threads, or two asyncio contexts) can never see each other's.
"""

from __future__ import annotations

import contextvars
from collections.abc import Mapping

import onnxruntime as ort

Weights = Mapping[str, Mapping[str, ort.OrtValue]]
"""Per component session name (``unet``, ``text_encoder``...), the merged tensors by initializer name."""
ACTIVE: contextvars.ContextVar[Weights] = contextvars.ContextVar("sdserve_lora_weights", default={})  # noqa: B039
ADAPTED: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar("sdserve_lora_adapted", default=None)
"""The components of the batch in this context that ran their LoRA variant with merged weights bound (recorded by
OrtModel.bound): the engine compares it with the components it merged for, so no response or signed manifest says
a LoRA applied to a component that ran its base weights."""

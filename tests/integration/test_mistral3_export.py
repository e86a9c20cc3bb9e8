"""FLUX.2 [dev]'s text encoder export (engines/build/mistral3.py) on ORT's CPU provider vs transformers'
Mistral3ForConditionalGeneration run as diffusers' pipeline_flux2.py runs it (``_get_mistral_3_small_prompt_embeds``:
hidden states 10, 20, 30 stacked; transformers' models/mistral/modeling_mistral.py for the states)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from engines.build.mistral3 import TINY_TEXT, export_mistral3_text


def test_the_export_is_the_pipelines_stacked_states(tmp_path: Path) -> None:
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    torch.manual_seed(0)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=16)
    config = Mistral3Config(text_config={"model_type": "mistral", **TINY_TEXT},
                            vision_config={"model_type": "pixtral", **vision})
    model = Mistral3ForConditionalGeneration(config).eval()
    ids = torch.randint(0, TINY_TEXT["vocab_size"], (2, 12))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0  # right padding, as the pipeline's padding="max_length"
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
    want = torch.stack([out.hidden_states[k] for k in (10, 20, 30)], dim=1).permute(0, 2, 1, 3).reshape(2, 12, -1)
    path = export_mistral3_text(model.model.language_model, tmp_path / "text_encoder" / "model.onnx")
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = sess.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})[0]
    assert got.shape == (2, 12, 3 * TINY_TEXT["hidden_size"])
    np.testing.assert_allclose(got, want.numpy(), atol=1e-4, rtol=1e-4)
    assert len(model.model.language_model.layers) == 32  # the export truncated a copy, not the model

"""FLUX.2 [dev] txt2img on ONNX Runtime (no torch), as diffusers' ``Flux2Pipeline`` (0.42) does it: FLUX.2 [klein]'s
loop (engines/pipelines/flux2.py: latents, schedule with the empirical shift, rotary tables, decode) with dev's text
encoder and guidance. The folder is the layout engines/build/mistral3.py writes.

1. Text: ``format_input``'s messages (the pipeline's ``SYSTEM_MESSAGE`` as the system turn, the prompt with every
   ``[IMG]`` removed as the user's text turn) in Mistral Small 3.1's chat template, rendered here (``TEMPLATE``:
   ``<s>[SYSTEM_PROMPT]…[/SYSTEM_PROMPT][INST]prompt[/INST]``, no generation prompt), tokenized without added special
   tokens (the template carries the BOS), cut and padded to ``max_sequence_length`` (512) as
   ``padding="max_length", truncation=True`` does, on the sides and with the pad token the folder's
   tokenizer_config.json names. The exported encoder stacks the hidden states of layers 10, 20 and 30; every
   position goes to the transformer (unmasked), as in klein.
2. Guidance: the scale is a transformer input (``guidance_embeds``), one value per image, fed raw (the transformer
   multiplies it by 1000); never classifier-free guidance (one row per image).
3. Reference images (``image=``, a folder with its ``vae_encoder/``): ``Flux2Pipeline`` prepares, encodes and
   places them exactly as ``Flux2KleinPipeline`` does (the same ``check_image_input`` limits, the area rescale past
   1024², the floor to 16 by centre crop, the encoder's mean batch-normalised, T offsets ``10 + 10 k``, the output
   size the first image's, the schedule's shift from the noisy tokens alone), so klein's mixin
   (engines/pipelines/flux2_refs.py) serves them; the text encoder never sees them (only the optional caption
   upsampling, not served, would). What differs is the count: ``REFERENCES`` (Black Forest Labs recommends at most
   6 for [dev], 4 for [klein]; diffusers' pipelines set no limit).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from engines.errors import InvalidRequestError, ModelLoadError
from engines.lora.active import Adapters
from engines.pipelines.flow import DitConditioning, run
from engines.pipelines.flux2 import Flux2Pipeline
from engines.pipelines.flux2_refs import MAX_ASPECT, MIN_SIDE, reference_size, reference_sizes
from engines.pipelines.ort_model import OrtModel
from engines.types.model import ModelInfo
from engines.types.request import Batch

SYSTEM_MESSAGE = ("You are an AI that reasons about image descriptions. You give structured responses focusing on "
                  "object relationships, object\nattribution and actions without speculation.")
"""diffusers' pipelines/flux2/system_messages.py ``SYSTEM_MESSAGE`` (the line break is the released text's)."""
TEMPLATE = "{bos}[SYSTEM_PROMPT]" + SYSTEM_MESSAGE + "[/SYSTEM_PROMPT][INST]{prompt}[/INST]"
"""What Mistral Small 3.1's chat template renders for ``format_input``'s messages (system + one user text turn,
``add_generation_prompt=False``)."""
REFERENCES = 6
"""Input images one edit takes: Black Forest Labs' recommended maximum for FLUX.2 [dev] (each image adds its tokens
to every transformer call)."""
EDIT_RULES = (MIN_SIDE, MAX_ASPECT, reference_sizes)
"""klein's reference rules, named in this module too: engines/build/trtplan_edit.py reads ``MIN_SIDE``,
``MAX_ASPECT`` and ``reference_sizes`` from the module that defines a pipeline's ``REFERENCES`` (the TensorRT edit
bounds at [dev]'s count)."""


def tokenizer_settings(folder: Path) -> dict[str, str]:
    """The tokenizer folder's pad and BOS tokens (required: the padding and the template use them) and its padding
    and truncation sides (a missing side is transformers' default, right), from tokenizer_config.json."""
    path = folder / "tokenizer_config.json"
    try:
        config: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path} is missing or unreadable: {exc}") from exc

    def token(key: str) -> str:
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if not isinstance(value, str) or not value:
            raise ModelLoadError(f"{path} names no {key}: FLUX.2 [dev]'s prompts are padded with it and its "
                                 "template starts with the BOS")
        return value

    settings = {"pad": token("pad_token"), "bos": token("bos_token"),
                "padding_side": str(config.get("padding_side", "right")),
                "truncation_side": str(config.get("truncation_side", "right"))}
    for key in ("padding_side", "truncation_side"):
        if settings[key] not in ("left", "right"):
            raise ModelLoadError(f"{path}: {key} {settings[key]!r} is neither left nor right")
    return settings


def fit(ids: list[int], length: int, pad: int, padding_side: str, truncation_side: str) -> tuple[list[int],
                                                                                              list[int]]:
    """(ids, attention mask) of one row cut to ``length`` on ``truncation_side`` and padded to it on
    ``padding_side`` (transformers' ``padding="max_length", truncation=True``)."""
    kept = ids[:length] if truncation_side == "right" else ids[max(0, len(ids) - length):]
    fill = [pad] * (length - len(kept))
    ones, zeros = [1] * len(kept), [0] * len(fill)
    return (kept + fill, ones + zeros) if padding_side == "right" else (fill + kept, zeros + ones)


class Flux2DevPipeline(Flux2Pipeline):
    """FLUX.2 [dev]: Mistral Small 3.1's stacked states under its system message, the guidance embedded."""

    def load_text(self, folder: Path, models: dict[str, OrtModel]) -> None:
        path = folder / "tokenizer" / "tokenizer.json"
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises plain Exception
            raise ModelLoadError(f"cannot load the Mistral tokenizer {path}: {exc}") from exc
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()
        self.settings = tokenizer_settings(folder / "tokenizer")
        pad = self.tokenizer.token_to_id(self.settings["pad"])
        if pad is None:
            raise ModelLoadError(f"Mistral tokenizer pad token {self.settings['pad']!r} is not in the vocabulary "
                                 f"of {path}")
        self.pad_id = pad
        self.template_tokens = len(self.tokenizer.encode(self.render(""), add_special_tokens=False).ids)
        """The template's own tokens (a prompt may use the rest of the length)."""
        self.text_encoder = models["text_encoder"]
        self.text_encoders.append(self.text_encoder)
        self.distilled = True  # guidance-distilled: the scale is embedded, never classifier-free

    def render(self, prompt: str) -> str:
        """The templated prompt, ``[IMG]`` removed as ``format_input`` removes it."""
        return TEMPLATE.format(bos=self.settings["bos"], prompt=prompt.replace("[IMG]", ""))

    def prompt_tokens(self) -> int:
        return self.max_sequence_length - self.template_tokens

    def uses_cfg(self, guidance: np.ndarray) -> bool:
        return False

    def _reference_sizes(self, batch: Batch) -> list[tuple[int, int]]:
        """klein's, with [dev]'s count of input images (``REFERENCES``)."""
        sets = set()
        for spec in batch.images:
            refs = spec.edit.references if spec.edit is not None else ()
            if not 1 <= len(refs) <= REFERENCES:
                raise InvalidRequestError(f"FLUX.2 [dev] takes 1 to {REFERENCES} input images per edit, not "
                                          f"{len(refs)}", param="image")
            sets.add(tuple(reference_size(r.shape[1], r.shape[0], self.size_multiple) for r in refs))
        if len(sets) > 1:
            raise InvalidRequestError(f"the input images of one batch must have one encoded size each (they give "
                                      f"{sorted(sets)})", param="image")
        return list(next(iter(sets)))

    def model_info(self, name: str, digest: str = "") -> ModelInfo:
        info = super().model_info(name, digest)
        return replace(info, instruct_images=REFERENCES) if info.instruct_images else info

    def describe(self) -> str:
        return f"{self.family.name} (flow matching, guidance embedded)"

    def encode(self, batch: Batch, length: int, cfg: bool, adapters: Adapters | None) -> DitConditioning:
        """The stacked states of each templated prompt at the fixed length."""
        encodings = self.tokenizer.encode_batch([self.render(s.prompt) for s in batch.images],
                                                add_special_tokens=False)
        ids = np.full((len(encodings), length), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(encodings), length), dtype=np.int64)
        for row, enc in enumerate(encodings):
            ids[row], mask[row] = fit(enc.ids, length, self.pad_id, self.settings["padding_side"],
                                      self.settings["truncation_side"])
        cut = tuple(len(e.ids) > length for e in encodings)
        self.checked_tokens(batch, "text encoder (max_sequence_length)", ids, cut, length)
        states = run(self.text_encoder, {"input_ids": ids, "attention_mask": mask}, ["prompt_embeds"], adapters)[0]
        return DitConditioning(states, None, cut, (False,) * len(batch.images))

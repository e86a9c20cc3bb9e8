"""Qwen-Image's prompt tokenization on HF ``tokenizers`` (no transformers at serve time), as diffusers'
``QwenImagePipeline._get_qwen_prompt_embeds`` does it.

Each prompt is wrapped in the pipeline's chat template (``TEMPLATE``: a system instruction, the prompt as the
user's turn, then the assistant's turn opening) and tokenized with the folder's ``tokenizer.json`` (Qwen2's
byte-level BPE; engines/build/qwen_export.py writes it from vocab.json + merges.txt). The text encoder reads the
rows right-padded; the pipeline keeps each row's states from token ``TEMPLATE_DROP`` (the system prefix's 34
tokens) to its end, at most ``max_sequence_length`` of them (diffusers' ``prompt_embeds[:, :max_sequence_length]``).
A prompt whose kept tokens pass that is reported truncated. Since the encoder's attention is causal, the tokens
past ``TEMPLATE_DROP + max_sequence_length`` change nothing kept: they are not fed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from engines.errors import ModelLoadError

TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
            "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
            "<|im_start|>assistant\n")
"""QwenImagePipeline's ``prompt_template_encode``."""
TEMPLATE_DROP = 34
"""Its ``prompt_template_encode_start_idx``: the template's system prefix, dropped from the states."""
PAD = "<|endoftext|>"


@dataclass(frozen=True)
class QwenTokens:
    ids: np.ndarray
    """[rows, tokens] int64, right-padded with the pad token (the text encoder's input)."""
    kept: tuple[int, ...]
    """Per row, how many states the pipeline keeps after dropping the system prefix (at most the limit)."""
    truncated: tuple[bool, ...]


def load_unpadded(path: Path, name: str, where: object) -> tuple[Tokenizer, int]:
    """A Qwen-family ``tokenizer.json`` loaded with padding and truncation off (the pipelines pad themselves), and
    its ``PAD`` id; ModelLoadError naming ``name`` and ``where`` when it cannot load or lacks the pad token."""
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises plain Exception
        raise ModelLoadError(f"cannot load the {name} tokenizer {where}: {exc}") from exc
    pad = tok.token_to_id(PAD)
    if pad is None:
        raise ModelLoadError(f"{name} tokenizer pad token {PAD!r} is not in the vocabulary of {where}")
    tok.no_padding()
    tok.no_truncation()
    return tok, pad


class QwenTokenizer:
    """Prompts -> templated, right-padded ids and the states each row keeps."""

    def __init__(self, folder: Path) -> None:
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{folder} has no tokenizer.json: sdserve reads Qwen's tokenizer with the "
                                 "`tokenizers` library (`sdserve engines export` writes it from vocab.json and "
                                 "merges.txt)")
        self._tok, self.pad_id = load_unpadded(path, "Qwen", f"in {folder}")

    def __call__(self, prompts: list[str], max_sequence_length: int) -> QwenTokens:
        encodings = self._tok.encode_batch([TEMPLATE.format(p) for p in prompts])
        if any(len(e.ids) <= TEMPLATE_DROP for e in encodings):
            raise ModelLoadError("the tokenizer splits Qwen-Image's template differently: its system prefix is "
                                 f"not the {TEMPLATE_DROP} tokens the pipeline drops")
        lengths = [min(len(e.ids), TEMPLATE_DROP + max_sequence_length) for e in encodings]
        ids = np.full((len(prompts), max(lengths)), self.pad_id, dtype=np.int64)
        for row, enc, n in zip(ids, encodings, lengths, strict=True):
            row[:n] = enc.ids[:n]
        return QwenTokens(ids, tuple(n - TEMPLATE_DROP for n in lengths),
                          tuple(len(e.ids) - TEMPLATE_DROP > max_sequence_length for e in encodings))

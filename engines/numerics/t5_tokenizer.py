"""T5 tokenizer on HF ``tokenizers`` for the DiT families' text encoder (no transformers, no sentencepiece at serve
time).

Reads the folder's ``tokenizer.json`` (what diffusers folders of Flux and SD 3 ship beside ``spiece.model``, and
what engines/build/t5_vocab.py writes). Rows are ``max_length`` ids: the prompt's pieces, ``</s>``, then ``<pad>``;
a prompt longer than that keeps its first ``max_length - 1`` pieces and the ``</s>``, as T5TokenizerFast with
``truncation=True`` does, and is reported truncated.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from engines.errors import ModelLoadError
from engines.numerics.tokenizer import Tokens

PAD = "<pad>"


class T5Tokenizer:
    """Prompt -> [batch, max_length] int64 ids, padded with the tokenizer config's pad token."""

    def __init__(self, folder: Path) -> None:
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{folder} has no tokenizer.json: sdserve reads the T5 tokenizer with the "
                                 "`tokenizers` library (convert spiece.model once at build time with transformers' "
                                 "T5TokenizerFast(...).save_pretrained)")
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises plain Exception
            raise ModelLoadError(f"cannot load the T5 tokenizer in {folder}: {exc}") from exc
        config: dict[str, Any] = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):
            if (folder / name).is_file():
                config.update(json.loads((folder / name).read_text(encoding="utf-8")))
        pad = config.get("pad_token", PAD)
        pad = pad.get("content", PAD) if isinstance(pad, dict) else str(pad)
        pad_id = self._tok.token_to_id(pad)
        if pad_id is None:
            raise ModelLoadError(f"T5 tokenizer pad token {pad!r} is not in the vocabulary of {folder}")
        self.pad_id = pad_id
        self.model_max_length = int(config.get("model_max_length", 512))
        self._tok.no_padding()

    def __call__(self, prompts: list[str], max_length: int) -> Tokens:
        if max_length < 2:
            raise ValueError(f"max_length {max_length}: a T5 row needs at least one piece and </s>")
        self._tok.enable_truncation(max_length)  # counts the </s> the post-processor appends
        encodings = self._tok.encode_batch(prompts)
        ids = np.full((len(prompts), max_length), self.pad_id, dtype=np.int64)
        for row, enc in zip(ids, encodings, strict=True):
            row[: len(enc.ids)] = enc.ids
        return Tokens(ids, tuple(bool(enc.overflowing) for enc in encodings))

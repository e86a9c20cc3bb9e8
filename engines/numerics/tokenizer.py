"""CLIP BPE tokenizer on HF ``tokenizers`` (no transformers at serve time).

Loads ``tokenizer/tokenizer.json`` when present; otherwise assembles the CLIP pipeline from ``vocab.json`` and
``merges.txt`` (what ``optimum-cli export onnx`` and older diffusers folders ship).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from engines.errors import ModelLoadError

BOS, EOS = "<|startoftext|>", "<|endoftext|>"
# CLIP's word pattern: special tokens, English contractions, letter runs, single digits, other symbol runs.
_CLIP_PATTERN = r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""


@dataclass(frozen=True)
class Tokens:
    ids: np.ndarray
    """int64 [batch, max_length]"""
    truncated: tuple[bool, ...]
    """Per prompt: whether tokens past ``max_length`` were dropped."""


def build_clip_tokenizer(vocab: dict[str, int], merges: list[tuple[str, str]]) -> Tokenizer:
    """The CLIP tokenizer pipeline: NFC + whitespace folding + lowercase, CLIP word split, byte-level BPE
    with ``</w>`` word ends, wrapped in start/end tokens."""
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=EOS, continuing_subword_prefix="",
                               end_of_word_suffix="</w>", fuse_unk=False))
    tok.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "),
                                           normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_CLIP_PATTERN), behavior="removed", invert=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.RobertaProcessing((EOS, vocab[EOS]), (BOS, vocab[BOS]),
                                                      add_prefix_space=False, trim_offsets=False)
    tok.add_special_tokens([BOS, EOS])
    return tok


def read_merges(path: Path) -> list[tuple[str, str]]:
    lines = path.read_text(encoding="utf-8").splitlines()
    pairs = [tuple(line.split(" ")) for line in lines if line and not line.startswith("#version")]
    return [(a, b) for a, b in pairs]


def _special(config: dict[str, Any], key: str) -> str | None:
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class ClipTokenizer:
    """Prompt -> fixed-length id rows, padded as the model's tokenizer config says (SD1.x pads with EOS)."""

    def __init__(self, folder: Path) -> None:
        try:
            if (folder / "tokenizer.json").is_file():
                self._tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
            else:
                vocab = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
                self._tok = build_clip_tokenizer(vocab, read_merges(folder / "merges.txt"))
        except Exception as exc:  # tokenizers raises plain Exception; json/OS errors too
            raise ModelLoadError(f"cannot load the tokenizer in {folder}: {exc}") from exc
        config: dict[str, Any] = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):
            if (folder / name).is_file():
                config.update(json.loads((folder / name).read_text(encoding="utf-8")))
        self.max_length = int(min(config.get("model_max_length", 77), 77))
        pad = _special(config, "pad_token") or EOS
        pad_id = self._tok.token_to_id(pad)
        if pad_id is None:
            raise ModelLoadError(f"tokenizer pad token {pad!r} is not in the vocabulary of {folder}")
        self.pad_id = pad_id
        self._tok.no_padding()
        self._tok.enable_truncation(self.max_length)

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size())

    def __call__(self, prompts: list[str]) -> Tokens:
        encodings = self._tok.encode_batch(prompts)
        ids = np.full((len(prompts), self.max_length), self.pad_id, dtype=np.int64)
        for row, enc in zip(ids, encodings, strict=True):
            row[: len(enc.ids)] = enc.ids
        return Tokens(ids, tuple(bool(enc.overflowing) for enc in encodings))

"""An offline T5 tokenizer for the tiny DiT models: a ``tokenizers`` Unigram in T5's layout, no sentencepiece, no hub.

T5's vocabulary (``spiece.model`` of t5-v1_1) cannot be fetched here, so the pieces are derived from the CLIP merges
the project already reads offline (engines/build/clip_vocab.py): the most frequent alphabetic CLIP words become
word-initial pieces (``▁word``) and word-continuation pieces (``word``), after T5's fixed ids ``<pad>`` 0, ``</s>``
1, ``<unk>`` 2, the bare ``▁`` and the printable ASCII characters (so every ASCII prompt tokenizes without
``<unk>``). Scores fall with CLIP's merge rank, as log-probabilities do with frequency, so the Viterbi split prefers
whole words. The pipeline is T5TokenizerFast's: NFKC (what T5's precompiled ``nmt_nfkc`` charsmap mostly does),
runs of spaces folded, whitespace split, Metaspace ``▁`` prepended, ``</s>`` appended, pad with ``<pad>``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

PAD, EOS, UNK, SPACE = "<pad>", "</s>", "<unk>", "\u2581"
WORDS = 2000
"""CLIP words taken (each as ``▁word`` and ``word``): about 4,200 pieces in all."""
CHAR_SCORE = -20.0
"""Single characters: the last resort of the Viterbi split."""


def t5_pieces(clip_vocab: dict[str, int], words: int = WORDS) -> list[tuple[str, float]]:
    """(piece, score) in id order: specials, ``▁``, ASCII characters bare and ``▁``-prefixed, then CLIP words."""
    pieces: list[tuple[str, float]] = [(PAD, 0.0), (EOS, 0.0), (UNK, 0.0), (SPACE, -2.0)]
    chars = [chr(c) for c in range(ord("!"), ord("~") + 1)]
    pieces += [(c, CHAR_SCORE) for c in chars] + [(SPACE + c, CHAR_SCORE + 1.0) for c in chars]
    seen = {p for p, _ in pieces}
    ranked = sorted(clip_vocab.items(), key=lambda item: item[1])
    found = [t[:-4] for t, _ in ranked if t.endswith("</w>") and len(t) > 5 and t[:-4].isascii() and t[:-4].isalpha()]
    for rank, word in enumerate(found[:words]):
        score = -3.0 - math.log(rank + 1.0)
        for piece in (SPACE + word, word):
            if piece not in seen:
                seen.add(piece)
                pieces.append((piece, score if piece[0] == SPACE else score - 1.0))
    return pieces


def build_t5_tokenizer(pieces: list[tuple[str, float]]) -> Tokenizer:
    """T5TokenizerFast's pipeline over ``pieces`` (ids 0, 1, 2 must be pad, eos, unk)."""
    if [p for p, _ in pieces[:3]] != [PAD, EOS, UNK]:
        raise ValueError("T5 pieces must start with <pad>, </s>, <unk>")
    tok = Tokenizer(models.Unigram(pieces, unk_id=2, byte_fallback=False))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(Regex(" {2,}"), " ")])
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="always", split=True),
    ])
    tok.decoder = decoders.Metaspace(replacement=SPACE, prepend_scheme="always", split=True)
    tok.post_processor = processors.TemplateProcessing(single=f"$A {EOS}", pair=f"$A {EOS} $B {EOS}",
                                                       special_tokens=[(EOS, 1)])
    tok.add_special_tokens([PAD, EOS, UNK])
    return tok


def write_t5_tokenizer(clip_vocab: dict[str, int], out: Path, max_length: int = 512) -> int:
    """tokenizer.json and the configs transformers' T5TokenizerFast reads; returns the vocabulary size."""
    pieces = t5_pieces(clip_vocab)
    out.mkdir(parents=True, exist_ok=True)
    build_t5_tokenizer(pieces).save(str(out / "tokenizer.json"))
    special = {"eos_token": EOS, "unk_token": UNK, "pad_token": PAD}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2), encoding="utf-8")
    config = {"tokenizer_class": "T5Tokenizer", "model_max_length": max_length, "extra_ids": 0,
              "additional_special_tokens": [], **special}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return len(pieces)

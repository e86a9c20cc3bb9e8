"""The CLIP tokenizer derived offline equals transformers' CLIPTokenizer on the same files."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from engines.build.clip_vocab import clip_vocab, find_bpe_source, write_tokenizer
from engines.numerics.tokenizer import ClipTokenizer

PROMPTS = ["a photo of an astronaut riding a horse", "  Hello,   WORLD!! it's 2026 café  ",
           "naïve résumé — 東京 😀 <|endoftext|> x", "", "masterpiece, (best quality:1.2), 8k uhd, dslr"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    write_tokenizer(find_bpe_source(), out)
    return out


def test_vocabulary_is_clips() -> None:
    vocab, merges = clip_vocab(find_bpe_source())
    assert len(vocab) == 49408 and len(merges) == 48894
    assert vocab["<|startoftext|>"] == 49406 and vocab["<|endoftext|>"] == 49407


def test_known_ids() -> None:
    vocab, merges = clip_vocab(find_bpe_source())
    from engines.numerics.tokenizer import build_clip_tokenizer

    ids = build_clip_tokenizer(vocab, merges).encode("a photo of an astronaut riding a horse").ids
    assert ids == [49406, 320, 1125, 539, 550, 18376, 6765, 320, 4558, 49407]


@pytest.mark.parametrize("with_json", [True, False])
def test_matches_transformers(tokenizer_dir: Path, tmp_path: Path, with_json: bool) -> None:
    from transformers import CLIPTokenizer

    folder = tmp_path / "tokenizer"
    shutil.copytree(tokenizer_dir, folder)
    if not with_json:
        (folder / "tokenizer.json").unlink()  # the vocab.json + merges.txt path
    reference = tmp_path / "reference"  # transformers builds its own pipeline from vocab.json + merges.txt
    shutil.copytree(tokenizer_dir, reference)
    (reference / "tokenizer.json").unlink()
    theirs = CLIPTokenizer.from_pretrained(reference)
    ours = ClipTokenizer(folder)
    expected = theirs(PROMPTS, padding="max_length", max_length=77, truncation=True)["input_ids"]
    assert ours(PROMPTS).ids.tolist() == expected


def test_truncation_is_reported_and_padding_is_eos(tokenizer_dir: Path) -> None:
    tokens = ClipTokenizer(tokenizer_dir)(["word " * 100, "short"])
    assert tokens.truncated == (True, False)
    assert tokens.ids.shape == (2, 77)
    assert tokens.ids[0, -1] == 49407 and tokens.ids[1, -1] == 49407

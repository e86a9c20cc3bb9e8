"""Derive the real CLIP BPE vocabulary offline from the merges file that open-clip-torch's wheel ships.

The file lists BPE merges in rank order. CLIP's vocabulary is the 256 byte-level symbols, the same with the
end-of-word marker ``</w>``, the first 48,894 merges joined, then the start and end tokens: 49,408 entries.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import zipfile
from pathlib import Path

BPE_MEMBER = "open_clip/bpe_simple_vocab_16e6.txt.gz"
NUM_MERGES = 49152 - 256 - 2


def byte_symbols() -> list[str]:
    """The byte -> printable unicode map of byte-level BPE, in its canonical order (printable bytes first)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codes = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return [chr(c) for c in codes]


def find_bpe_source(explicit: Path | None = None) -> Path:
    """The gzip merges file or a wheel holding it: ``explicit``, an installed open_clip, or a wheel in .cache/wheels."""
    if explicit is not None:
        return explicit
    spec = importlib.util.find_spec("open_clip")  # does not import the package (its torchvision breaks here)
    if spec is not None and spec.submodule_search_locations:
        candidate = Path(next(iter(spec.submodule_search_locations))) / Path(BPE_MEMBER).name
        if candidate.is_file():
            return candidate
    wheels = sorted(Path(".cache/wheels").glob("open_clip_torch-*.whl"))
    if wheels:
        return wheels[-1]
    raise FileNotFoundError(
        "CLIP merges not found: pass --bpe with open-clip-torch's wheel or its bpe_simple_vocab_16e6.txt.gz "
        "(`pip download --no-deps open-clip-torch==3.3.0 -d .cache/wheels` fetches the wheel)")


def read_bpe_lines(source: Path) -> list[str]:
    if source.suffix == ".whl":
        with zipfile.ZipFile(source) as wheel:
            raw = wheel.read(BPE_MEMBER)
    else:
        raw = source.read_bytes()
    return gzip.decompress(raw).decode("utf-8").split("\n")


def clip_vocab(source: Path) -> tuple[dict[str, int], list[tuple[str, str]]]:
    lines = read_bpe_lines(source)
    merges = [tuple(line.split()) for line in lines[1 : NUM_MERGES + 1]]
    pairs = [(a, b) for a, b in merges]
    symbols = byte_symbols()
    tokens = [*symbols, *(s + "</w>" for s in symbols), *("".join(p) for p in pairs),
              "<|startoftext|>", "<|endoftext|>"]
    return {tok: i for i, tok in enumerate(tokens)}, pairs


def write_tokenizer(source: Path, out: Path) -> None:
    """Write vocab.json, merges.txt, tokenizer.json and the configs in the layout diffusers/optimum use."""
    from engines.numerics.tokenizer import build_clip_tokenizer

    vocab, merges = clip_vocab(source)
    out.mkdir(parents=True, exist_ok=True)
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (out / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges),
                                    encoding="utf-8")
    build_clip_tokenizer(vocab, merges).save(str(out / "tokenizer.json"))
    special = {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
               "pad_token": "<|endoftext|>"}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2), encoding="utf-8")
    config = {"tokenizer_class": "CLIPTokenizer", "model_max_length": 77, "do_lower_case": True, **special}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")

"""Qwen-Image's TensorRT plan (engines/build/trtplan_dit.py) on the tiny faithful export: every input of the
transformer (the key mask included) and of the text encoder (variable-length ids) gets its profile from the folder
and the serving pipeline's rules, every part is bf16, and every option set passes ONNX Runtime's real option
parser. Before, `engines build` refused the folder naming ``encoder_hidden_states_mask``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from engines.build import trtplan, trtplan_dit
from engines.build.trt_build import parser_verdicts
from engines.numerics.qwen_tokenizer import QwenTokenizer
from engines.pipelines.flow_family import detect_dit

Builder = Callable[[str], tuple[Path, Path]]
SIZES = [(512, 512), (64, 48)]
BATCH_MAX, BATCH_OPT = 4, 2


@pytest.fixture(scope="module")
def qwen(dit_build: Builder) -> Path:
    return dit_build("qwen-image")[0]


@pytest.fixture(scope="module")
def plan(qwen: Path) -> dict:
    return trtplan.plan(qwen, trtplan.profiles_from(SIZES, BATCH_MAX, BATCH_OPT), trtplan.BuildFlags())


def _shapes(options: dict[str, str], bound: str) -> dict[str, list[int]]:
    return {name: [int(d) for d in dims.split("x")] for name, dims in
            (item.split(":") for item in options[f"trt_profile_{bound}_shapes"].split(","))}


def test_every_part_is_planned_in_bf16(plan: dict) -> None:
    components = plan["sizes"]["512x512"]["components"]
    assert set(components) == {"text_encoder", "transformer", "vae_decoder", "vae_encoder"}
    assert plan["build_flags"]["precision"] == dict.fromkeys(components, "bf16")
    for spec in components.values():  # Qwen2.5 overflows fp16: the text encoder too is bf16
        options = spec["provider_options"]
        assert (options["trt_bf16_enable"], options["trt_fp16_enable"]) == ("True", "False")
    assert plan["architecture"] == "qwen-image" and plan["budget_s"] == 2 * trtplan.BUILD_BUDGET_S["qwen-image"]


def test_the_transformer_takes_fixed_text_states_and_their_key_mask(plan: dict, qwen: Path) -> None:
    """512x512: (512/16)^2 packed tokens; text padded to max_sequence_length (512) with its mask; rope over both;
    rows: one image without CFG at min, doubled under true CFG at opt and max."""
    text = detect_dit(qwen).max_sequence_length
    options = plan["sizes"]["512x512"]["components"]["transformer"]["provider_options"]
    for bound, rows in (("min", 1), ("opt", 2 * BATCH_OPT), ("max", 2 * BATCH_MAX)):
        shapes = _shapes(options, bound)
        assert shapes["hidden_states"] == [rows, 32 * 32, 64]
        assert shapes["encoder_hidden_states"][:2] == [rows, text]
        assert shapes["encoder_hidden_states_mask"] == [rows, text]
        assert shapes["timestep"] == [rows]
        assert shapes["rope_cos"][0] == shapes["rope_sin"][0] == text + 32 * 32
    small = _shapes(plan["sizes"]["64x48"]["components"]["transformer"]["provider_options"], "max")
    assert small["hidden_states"][1] == (48 // 16) * (64 // 16)


def test_the_text_encoder_profile_spans_every_prompt_length(plan: dict, qwen: Path) -> None:
    """The pipeline pads a batch's ids to its longest templated prompt (34-token prefix kept, cut at 34 + 512): the
    profile must take the shortest and the longest it can feed."""
    options = plan["sizes"]["512x512"]["components"]["text_encoder"]["provider_options"]
    low, opt, high = (_shapes(options, b)["input_ids"] for b in ("min", "opt", "max"))
    assert low == [1, trtplan_dit.QWEN_TEXT_MIN] and opt == [2 * BATCH_OPT, trtplan_dit.QWEN_TEXT_OPT]
    assert high == [2 * BATCH_MAX, 34 + detect_dit(qwen).max_sequence_length]
    tokenizer = QwenTokenizer(qwen / "tokenizer")
    fed = [tokenizer([p], 512).ids.shape[1] for p in ("", "a cat", "a very long prompt " * 400)]
    assert all(low[1] <= n <= high[1] for n in fed) and fed[-1] == high[1]


def test_the_vae_profiles_use_the_16_channel_latents(plan: dict) -> None:
    components = plan["sizes"]["64x48"]["components"]
    assert _shapes(components["vae_decoder"]["provider_options"], "max")["latent_sample"] == [BATCH_MAX, 16, 6, 8]
    assert _shapes(components["vae_encoder"]["provider_options"], "min")["sample"] == [1, 3, 48, 64]


def test_every_option_set_passes_orts_parser(plan: dict, qwen: Path) -> None:
    verdicts = parser_verdicts(qwen, plan)
    assert len(verdicts) == len(SIZES) * 4
    refused = {k: v for k, v in verdicts.items() if not v["accepted"]}
    assert not refused, refused

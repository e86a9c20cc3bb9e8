"""Issue 57: warnings that tell the truth. Every truncation warning said "CLIP tokens" with the model's
``max_prompt_tokens`` (Qwen-Image: "512 CLIP tokens", an encoder it does not have; Flux: CLIP's 77, though T5 reads
up to its max_sequence_length), and a negative prompt the model never reads (guidance-distilled Flux.1 and
FLUX.2 [klein], Z-Image-Turbo at its guidance 0) went unmentioned. The pipeline now reports the tokens each of its
text encoders reads (ModelInfo.prompt_limits) and whether it reads a negative prompt at a guidance scale
(ModelInfo.reads_negative, its own CFG rule), and the warnings reach clients as before: A1111's ``info.warnings``
and the ``x-sdserve-warnings`` header. The app runs in this process on the real tiny builds over ONNX Runtime's CPU
provider (onnxruntime/core/providers/cpu)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from engines.engine import OrtEngine
from server.app import create_app
from server.settings import load_settings

Builder = Callable[[str], tuple[Path, Path]]
LONG = " ".join(f"cat{i % 10}" for i in range(700))
"""A prompt longer than every tiny model's text encoders read (CLIP's 77, T5's and the Qwen encoders' 512)."""
IGNORED = "negative_prompt ignored"


def _warnings(client: TestClient, **fields: Any) -> list[str]:
    body = {"prompt": "a fox", "width": 64, "height": 64, "steps": 2, "seed": 1, **fields}
    answer = client.post("/sdapi/v1/txt2img", json=body)
    assert answer.status_code == 200, answer.text
    found: list[str] = json.loads(answer.json()["info"])["warnings"]
    assert "; ".join(found) == answer.headers.get("x-sdserve-warnings", ""), answer.headers
    return found


# family -> (a guidance at which the negative prompt is ignored, one at which it is read or None, truncation text)
CASES: dict[str, tuple[float, float | None, str]] = {
    "sd1": (1.0, 7.0, "prompt truncated to 77 CLIP tokens"),
    "flux": (3.5, None, "prompt truncated: the text encoders read at most 77 CLIP tokens and {t} T5 tokens "
                        "(max_sequence_length) of it"),
    "qwen-image": (1.0, 4.0, "prompt truncated to {p} text encoder tokens (max_sequence_length)"),
    "z-image-turbo": (0.0, 2.0, "prompt truncated to {p} text encoder tokens (max_sequence_length)"),
    "flux2-klein": (4.0, None, "prompt truncated to {p} text encoder tokens (max_sequence_length)"),
}


@pytest.mark.slow
@pytest.mark.parametrize("family", list(CASES))
def test_truncation_names_the_encoders_and_an_unread_negative_prompt_is_named(family: str, tiny_model: Path,
                                                                           dit_build: Builder) -> None:
    ignored_at, read_at, truncation = CASES[family]
    settings = load_settings("dev")
    engine = OrtEngine(tiny_model if family == "sd1" else dit_build(family)[0], settings.runtime)
    with TestClient(create_app(engine, settings), base_url="http://localhost") as client:
        deadline = time.monotonic() + 240
        while client.get("/ready").status_code != 200:
            assert time.monotonic() < deadline, client.get("/ready").text
            time.sleep(0.05)
        info = engine.info
        expected = truncation.format(t=info.text_tokens, p=info.max_prompt_tokens)
        long_prompt = _warnings(client, prompt=LONG, cfg_scale=ignored_at)
        assert long_prompt == [expected], long_prompt
        if family not in ("sd1", "flux"):
            assert "CLIP" not in long_prompt[0]  # Qwen-Image said "512 CLIP tokens"
        ignored = _warnings(client, negative_prompt="blurry", cfg_scale=ignored_at)
        assert len(ignored) == 1 and ignored[0].startswith(IGNORED) and f"guidance {ignored_at:g}" in ignored[0]
        assert _warnings(client, cfg_scale=ignored_at) == []  # no negative prompt sent: nothing to say
        if read_at is not None:  # CFG on: the negative prompt is read, no warning
            assert _warnings(client, negative_prompt="blurry", cfg_scale=read_at) == []

"""What would fit, when a memory plan (engines/health/memory_plan.py) does not fit its device: the honest answer
`sdserve doctor` gives instead of an out-of-memory error at boot (FLUX.2 [dev]'s 32B transformer beside its 17B of
Mistral text encoder, ~92 GiB of bf16 weights, on an 80 GB card).

Three ways out, each with the plan's own numbers (weights as counted, activations and overhead unchanged):

- a bigger card: the smallest of ``CARDS`` whose memory holds the whole plan;
- the text encoders on a second device: this device then holds the rest, the second one the encoders' weights and
  activations (sdserve places every component on one device, ``[runtime] device_id``: a deployment choice to make,
  not an option served today);
- lower precision: the largest weights at one byte per parameter (fp8), the transformer first, then the text
  encoders too (sdserve's engines are fp16/bf16/fp32, ``ENGINE_PRECISION``: an fp8 export is not built today).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

GIB = 1 << 30
CARDS: tuple[tuple[str, int], ...] = (("80 GB card (H100 / A100 80GB)", 80 * 10**9),
                                      ("141 GB card (H200)", 141 * 10**9), ("192 GB card (B200)", 192 * 10**9))
"""Data-centre cards by their marketed memory (decimal GB: what the vendor sells, a little more than NVML's usable
figure, so a plan near a card's size is checked against the card's own reading: `sdserve doctor` on it)."""
FP8_BYTES = 1


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def _text(component: Mapping[str, Any]) -> bool:
    return str(component["name"]).startswith("text_encoder")


def advice(components: Sequence[Mapping[str, Any]], device: Mapping[str, Any], have: int | None,
           engines: int = 1, tensorrt: bool = True) -> list[str]:
    """Lines saying what would fit when the plan's base need (``device["base"]``) passes ``have`` bytes; [] when it
    fits or the device's memory is unknown. ``components``: the plan's component dicts; ``engines``: engines per
    component (TensorRT: one per served size, each with its weights and activations)."""
    need = int(device["base"])
    if have is None or need <= have:
        return []
    lines = [f"does not fit: the plan needs {_gib(need)} on one device, which has {_gib(have)}; what would fit:"]
    card = next((name for name, size in CARDS if size >= need and size > have), None)
    lines.append(f"- a bigger card: {_gib(need)} fits a {card}" if card is not None else
                 f"- a bigger card: none of the listed cards holds {_gib(need)}")
    text = [c for c in components if _text(c)]
    if text:
        # under TensorRT each engine holds its activations; ONNX Runtime's arena holds the largest component's
        moved = sum((int(c["weights"]) + (int(c["activations"]) if tensorrt else 0)) * engines for c in text)
        rest = need - moved
        verdict = "fits" if rest <= have else "still does not fit"
        lines.append(f"- the text encoder on a second device: this device needs {_gib(rest)} ({verdict}, margin "
                     f"{_gib(have - rest)}), the second one {_gib(moved)} (a deployment choice: sdserve places "
                     "every component on one device)")
    by_size = sorted((c for c in components if int(c["weights"]) > 0), key=lambda c: -int(c["weights"]))
    denoiser = [c for c in by_size if not _text(c)][:1]
    for chosen in [denoiser] + ([denoiser + text] if text else []):
        if not chosen:
            continue
        saved = sum((int(c["weights"]) - int(c["params"]) * FP8_BYTES) * engines for c in chosen)
        lower = need - saved
        names = " and ".join(str(c["name"]).replace("_", " ") for c in chosen)
        verdict = "fits" if lower <= have else "still does not fit"
        lines.append(f"- a lower precision: the {names} in fp8 (1 byte per parameter): {_gib(lower)} ({verdict}, "
                     f"margin {_gib(have - lower)}; sdserve builds fp16/bf16/fp32 engines, not fp8)")
    return lines
